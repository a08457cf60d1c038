"""Lightning's ModelParallelStrategy (FSDP2) with checkpoints through bcp, for
tests/test_integrations_lightning_sharded.py: a model sharded with ``fully_shard`` in
``configure_model``, trained N epochs on 1 or 2 gloo ranks, saved by every rank through
``BcpModelParallelStrategy``, resumed in a fresh Trainer, and compared bit for bit with
an uninterrupted run, or resumed on another number of ranks and compared with what
the saving run held. Run by every rank of dist_jobs.spawn; they assert inside."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import bcp
from integration_jobs import DATA, assert_identical


def sharded_module(lr: float = 0.05, hidden: int = 6, layout: str = "fsdp"):
    """``layout``: "fsdp" (``fully_shard`` over the data-parallel ranks) or "tp" (the
    first layer split by columns, the second by rows, over the tensor-parallel ranks)."""
    import lightning.pytorch as pl
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Sharded(pl.LightningModule):
        def __init__(self, lr: float, hidden: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            # 6 rows and 1: on 2 ranks the second is uneven, one shard of it empty
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def configure_model(self) -> None:
            if layout == "tp":
                parallelize_module(
                    self.net, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
                )
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val", self.net(batch[0]).pow(2).mean(), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    torch.manual_seed(0)
    return Sharded(lr, hidden)


def snapshot(when: str):
    """A callback that keeps the full state at ``when``: "train_start" (just after a
    resume restored it) or "fit_end"."""
    import lightning.pytorch as pl

    class Snapshot(pl.Callback):
        state: dict[str, Any] | None = None

        def on_train_start(self, trainer, module) -> None:
            if when == "train_start":
                self.state = full_state(trainer, module)

        def on_fit_end(self, trainer, module) -> None:
            if when == "fit_end":
                self.state = full_state(trainer, module)

    return Snapshot()


def full_state(trainer, module) -> dict[str, Any]:
    """Weights, optimizer and scheduler states gathered whole (on every rank), and the
    step counters: what a resume must give back exactly."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    model = trainer.strategy.model  # FSDP1's root wrapper; the module itself under ModelParallelStrategy
    return copied(
        {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, trainer.optimizers[0], options=full),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }
    )


def copied(value: Any) -> Any:
    """``value`` with every tensor cloned: on a mesh of one rank a "full" state dict's
    tensors are the parameters themselves, which training goes on changing."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, copied(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(copied(v) for v in value)
    return value


def sharded_fit(
    root: str, epochs: int, world: int, ckpt_path: str | None = None, *, when: str = "fit_end", layout: str = "fsdp"
):
    """Fit to ``epochs`` epochs with BcpModelParallelStrategy on ``world`` ranks (all
    data-parallel, or all tensor-parallel for ``layout="tp"``), a checkpoint per epoch
    at ``root`` kept 1 deep; the full state at ``when``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bcp.integrations.lightning import BcpModelParallelStrategy

    snap = snapshot(when)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=BcpModelParallelStrategy(
            data_parallel_size=1 if layout == "tp" else world,
            tensor_parallel_size=world if layout == "tp" else 1,
            process_group_backend="gloo",
        ),
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=1), snap],
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
    )
    trainer.fit(sharded_module(layout=layout), DataLoader(TensorDataset(DATA), batch_size=4), ckpt_path=ckpt_path)
    assert snap.state is not None
    return snap.state


def _launched(rank: int, world: int) -> None:
    """Lightning takes the ranks that dist_jobs.spawn started (no launcher of its own)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")


def _files(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def sharded_resume(rank: int, world: int, uri: str) -> None:
    """3 epochs whole == 2 epochs, then a fresh Trainer resumed (``ckpt_path=``) to 3."""
    _launched(rank, world)
    whole = sharded_fit(f"{uri}/whole", 3, world)
    first = sharded_fit(f"{uri}/first", 2, world)
    ckpt = f"{uri}/first/epoch=1.ckpt"
    if rank == 0:
        assert not bcp.exists(f"{uri}/first/epoch=0.ckpt"), "ModelCheckpoint removed epoch 0's through bcp.delete"
        if not uri.startswith("memory://"):  # nothing of epoch 0's left, not even an empty directory
            assert {f.split("/")[0] for f in _files(pathlib.Path(uri) / "first")} == {"epoch=1.ckpt"}
        with bcp.open(ckpt) as reader:
            assert reader.manifest.world_size == world  # every rank saved
            writers = {f.writer_rank for f in reader.meta("state_dict.net.0.weight").fragments}
            assert writers == set(range(world)), f"each rank wrote its own shard, not one gathered copy: {writers}"
            assert reader.read_object("epoch") == 1 and reader.read_object("global_step") == first["global_step"]
    resumed = sharded_fit(f"{uri}/second", 3, world, ckpt_path=ckpt)
    assert_identical(whole, resumed, "resumed run")
    assert whole["optim"]["state"], "the optimizer has state to compare"


def sharded_save(rank: int, world: int, tmp: str, layout: str = "fsdp") -> None:
    """2 epochs on ``world`` ranks; rank 0 keeps the state the checkpoint must hold."""
    _launched(rank, world)
    saved = sharded_fit(f"{tmp}/saved", 2, world, layout=layout)
    if rank == 0:
        torch.save(saved, f"{tmp}/expected.pt")


def sharded_reload(rank: int, world: int, tmp: str, layout: str = "fsdp") -> None:
    """Resume another world size's (or layout's) checkpoint: the state just after the
    restore is the saved one, bit for bit; one more epoch trains on it."""
    _launched(rank, world)
    expected = torch.load(f"{tmp}/expected.pt", weights_only=True)
    ckpt = f"{tmp}/saved/epoch=1.ckpt"
    restored = sharded_fit(f"{tmp}/again", 3, world, ckpt_path=ckpt, when="train_start", layout=layout)
    assert_identical(expected, restored, f"restored on {world} ranks ({layout})")


def _trainer(world: int, **kwargs: Any):
    import lightning.pytorch as pl

    from bcp.integrations.lightning import BcpModelParallelStrategy

    strategy = BcpModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **kwargs,
    )


def sharded_details(rank: int, world: int, uri: str) -> None:
    """validate() from a checkpoint loads the weights only; a weights-only checkpoint,
    one not saved through Lightning and a model of another shape fail naming the
    checkpoint and the key."""
    import pytest
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _launched(rank, world)
    loader = DataLoader(TensorDataset(DATA), batch_size=4)
    trainer = _trainer(world, max_epochs=1)
    trained = sharded_module()
    trainer.fit(trained, loader)
    expected = copied(get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True)))
    trainer.save_checkpoint(f"{uri}/full")
    trainer.save_checkpoint(f"{uri}/weights", weights_only=True)

    module = sharded_module()  # the weights before training
    _trainer(world).validate(module, loader, ckpt_path=f"{uri}/full", verbose=False)  # no optimizer: weights only
    assert_identical(expected, get_model_state_dict(module, options=StateDictOptions(full_state_dict=True)))

    with pytest.raises(KeyError, match=r"weights holds no 'optimizer_states'"):
        _trainer(world, max_epochs=2).fit(sharded_module(), loader, ckpt_path=f"{uri}/weights")
    bcp.save({"state_dict": {"net.0.weight": torch.zeros(6, 3)}}, f"{uri}/plain")
    with pytest.raises(bcp.CheckpointError, match=r"plain holds no 'bcp.lightning.layout'"):
        _trainer(world, max_epochs=2).fit(sharded_module(), loader, ckpt_path=f"{uri}/plain")
    with pytest.raises(bcp.StateMismatchError, match=r"state_dict.net.0.weight \(\[4, 3\], \[6, 3\]\)"):
        _trainer(world, max_epochs=2).fit(sharded_module(hidden=4), loader, ckpt_path=f"{uri}/full")


# -- FSDP1 (BcpFSDPStrategy): CUDA only, run by tests/test_cuda.py --------------------


def plain_module(lr: float = 0.05, hidden: int = 5):
    """The same network without ``configure_model``: FSDPStrategy wraps it (each Linear
    its own FSDP unit, by the auto-wrap policy)."""
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self, lr: float, hidden: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.trainer.model.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    torch.manual_seed(0)
    return Plain(lr, hidden)


def fsdp1_fit(root: str, epochs: int, world: int, ckpt_path: str | None = None, *, when: str = "fit_end"):
    """``sharded_fit`` with BcpFSDPStrategy on ``world`` GPUs."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bcp.integrations.lightning import BcpFSDPStrategy

    snap = snapshot(when)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=world,
        strategy=BcpFSDPStrategy(auto_wrap_policy={torch.nn.Linear}),
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=1), snap],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
    )
    trainer.fit(plain_module(), DataLoader(TensorDataset(DATA), batch_size=4), ckpt_path=ckpt_path)
    assert snap.state is not None
    return snap.state


def fsdp1_entry(rank: int, world: int, port: int, job, args) -> None:
    """One GPU rank: Lightning sets up NCCL itself on the variables a launcher sets."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _launched(rank, world)
    torch.cuda.set_device(rank)
    try:
        job(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fsdp1_resume(rank: int, world: int, root: str) -> None:
    whole = fsdp1_fit(f"{root}/whole", 3, world)
    fsdp1_fit(f"{root}/first", 2, world)
    ckpt = f"{root}/first/epoch=1.ckpt"
    if rank == 0:
        assert not bcp.exists(f"{root}/first/epoch=0.ckpt")
        assert {f.split("/")[0] for f in _files(pathlib.Path(root) / "first")} == {"epoch=1.ckpt"}
        with bcp.open(ckpt) as reader:
            assert reader.manifest.world_size == world
            writers = {f.writer_rank for f in reader.meta("state_dict.net.0.weight").fragments}
            assert writers == set(range(world)), writers
    resumed = fsdp1_fit(f"{root}/second", 3, world, ckpt_path=ckpt)
    assert_identical(whole, resumed, "resumed run")
    assert whole["optim"]["state"], "the optimizer has state to compare"


def fsdp1_save(rank: int, world: int, root: str) -> None:
    saved = fsdp1_fit(f"{root}/saved", 2, world)
    if rank == 0:
        torch.save(copied(saved), f"{root}/expected.pt")


def fsdp1_reload(rank: int, world: int, root: str) -> None:
    expected = torch.load(f"{root}/expected.pt", weights_only=True, map_location=f"cuda:{rank}")
    restored = fsdp1_fit(f"{root}/again", 3, world, ckpt_path=f"{root}/saved/epoch=1.ckpt", when="train_start")
    assert_identical(expected, restored, f"restored on {world} GPUs")


def batchnorm_fit(rank: int, world: int, root: str) -> None:
    """A BatchNorm model under FSDP2 on ``world`` ranks: each rank's running statistics
    come from its own batches, and the checkpoint holds rank 0's (not a refused save,
    not a mix of ranks')."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.fsdp import fully_shard

    from bcp.integrations.lightning import BcpModelParallelStrategy

    _launched(rank, world)

    class WithNorm(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))

        def configure_model(self) -> None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = WithNorm()
    strategy = BcpModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}")],
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(DATA), batch_size=4))
    copies: list[Any] = [None] * world
    dist.all_gather_object(copies, module.net[1].running_mean.detach().clone())
    assert not torch.equal(copies[0], copies[1]), "each rank's statistics are its own"
    with bcp.open(f"{root}/epoch=0.ckpt") as reader:
        key = "state_dict.net.1.running_mean"
        assert torch.equal(reader.read_tensors([key])[key], copies[0]), "rank 0's statistics"
