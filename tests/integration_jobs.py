"""Training jobs with the real frameworks for tests/test_integrations.py: Lightning and
Accelerate, each trained N epochs, saved through bcp, resumed in a fresh run for M
more, and compared bit for bit with an uninterrupted N+M run. Run by every rank of
dist_jobs.spawn (gloo) or in the test process itself; they assert inside."""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import bcp

DATA = torch.randn(32, 3, generator=torch.Generator().manual_seed(7))


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Same container types, same key order, same values; tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


# -- Lightning -------------------------------------------------------------------------


def lightning_module(lr: float = 0.05):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float, hidden: int = 5) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(3, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
            )

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    torch.manual_seed(0)
    return Tiny(lr)


def lightning_fit(root: pathlib.Path, epochs: int, world: int, ckpt_path: str | None = None):
    """Fit to ``epochs`` epochs with BcpCheckpointIO, a checkpoint per epoch kept 1 deep."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from bcp.integrations.lightning import BcpCheckpointIO

    kwargs: dict[str, Any] = {}
    if dist.is_initialized():
        kwargs = {"strategy": DDPStrategy(process_group_backend="gloo"), "devices": world}
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        plugins=[BcpCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=str(root), filename="{epoch}", save_top_k=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
        **kwargs,
    )
    model = lightning_module()
    trainer.fit(model, DataLoader(TensorDataset(DATA), batch_size=4), ckpt_path=ckpt_path)
    return (
        model.state_dict(),
        trainer.optimizers[0].state_dict(),
        trainer.lr_scheduler_configs[0].scheduler.state_dict(),
    )


def lightning_resume(rank: int, world: int, tmp: str) -> None:
    if dist.is_initialized():
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    root = pathlib.Path(tmp)
    whole = lightning_fit(root / "whole", 3, world)
    lightning_fit(root / "first", 2, world)
    if rank == 0:  # ModelCheckpoint removed epoch 0's checkpoint through bcp.delete
        assert sorted(p.name for p in (root / "first").iterdir()) == ["epoch=1.ckpt"]
        with bcp.open(str(root / "first" / "epoch=1.ckpt")) as reader:
            assert reader.manifest.world_size == 1  # rank 0 saved alone (bcp.LOCAL)
            assert "state_dict.net.0.weight" in reader.tensor_keys()  # the weights under their names
    resumed = lightning_fit(root / "second", 3, world, ckpt_path=str(root / "first" / "epoch=1.ckpt"))
    assert_identical(whole, resumed, "resumed run")
    assert whole[1]["state"], "the optimizer has state to compare"


# -- Accelerate ------------------------------------------------------------------------


class Counter:
    """A custom object for register_for_checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def accelerate_setup(project: pathlib.Path, uri: str):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from bcp.integrations.accelerate import enable

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2),
    )
    enable(accelerator, uri)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(DATA), batch_size=4)  # accelerate saves no shuffle position (docs)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    return accelerator, model, opt, loader, sched, counter


def accelerate_epoch(accelerator, model, opt, loader, sched, counter) -> None:
    model.train()
    for (x,) in loader:
        loss = model(x + torch.rand(x.shape)).pow(2).mean()  # the global RNG: restored by load_state
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        counter.seen += x.shape[0]
    sched.step()


def accelerate_result(accelerator, model, opt, sched, counter):
    return (
        accelerator.unwrap_model(model).state_dict(),
        opt.state_dict(),
        sched.state_dict(),
        counter.seen,
        torch.get_rng_state(),
    )


def accelerate_resume(rank: int, world: int, tmp: str, uri: str) -> None:
    if dist.is_initialized():  # accelerate reads the launcher's variables; the group is already up
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    root = pathlib.Path(tmp)
    parts = accelerate_setup(root / "whole", f"{uri}/whole")
    for _ in range(4):
        accelerate_epoch(*parts)
    whole = accelerate_result(parts[0], *parts[1:3], *parts[4:])

    parts = accelerate_setup(root / "first", f"{uri}/first")
    for _ in range(2):
        accelerate_epoch(*parts)
        parts[0].save_state()  # checkpoint_0, checkpoint_1, through bcp
    parts[0].save_state()  # checkpoint_2: total_limit=2 removes checkpoint_0
    if rank == 0:
        names = [f"{uri}/first/checkpoints/checkpoint_{i}" for i in range(3)]
        assert [bcp.exists(n) for n in names] == [False, True, True]
        assert not (root / "first" / "checkpoints").exists(), "accelerate's own files were not written"

    parts = accelerate_setup(root / "first", f"{uri}/first")  # a fresh run, same project
    parts[0].load_state()  # the newest: checkpoint_2
    assert parts[0].save_iteration == 3
    for _ in range(2):
        accelerate_epoch(*parts)
    resumed = accelerate_result(parts[0], *parts[1:3], *parts[4:])
    assert_identical(whole, resumed, "resumed run")


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([float(i)]) for i in range(64))


class _Window:
    """A registered object whose state differs by rank and holds a deque (a metrics window)."""

    def __init__(self, rank: int) -> None:
        self.recent = collections.deque([rank], maxlen=4)

    def state_dict(self) -> dict:
        return {"recent": self.recent}

    def load_state_dict(self, state: dict) -> None:
        self.recent = state["recent"]


def accelerate_ranks_differ(rank: int, world: int, tmp: str) -> None:
    """What differs between processes, on 2 ranks: BatchNorm's running statistics (each
    forward updates them), a stateful dataloader's position (accelerate dispatches an
    iterable dataset's batches from the main process) and a registered object's state.
    Failed before: the save refused the BatchNorm buffers (ReplicaMismatchError), the load
    dropped the dataloader's position without a word and refused the registered object."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from bcp.integrations.accelerate import enable

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))

    def setup():
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        enable(acc, tmp, allow_pickle=True)  # the deque
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
        window = _Window(rank)
        acc.register_for_checkpointing(window)
        model, loader = acc.prepare(model, torch.utils.data.DataLoader(_Stream(), batch_size=4))
        return acc, model, loader, window

    acc, model, loader, _window = setup()
    batches = iter(loader)
    for _ in range(3):
        model(torch.cat([next(batches)] * 2, dim=1) + rank)  # each rank's running statistics its own
    bn = acc.unwrap_model(model)[1]
    mine = bn.running_mean.clone()
    main = [bn.running_mean.clone() for _ in range(world)]
    dist.all_gather(main, bn.running_mean)
    assert not torch.equal(main[0], main[1])
    path = f"{tmp}/ck"
    acc.save_state(path)
    assert torch.equal(bn.running_mean, mine), "the save changed the live buffer"
    following = [next(batches) for _ in range(2)]
    torch.manual_seed(100 + rank)
    rng_after = torch.get_rng_state()
    acc.save_state(f"{tmp}/ck2")
    draws = torch.rand(3)
    del batches

    acc2, model2, loader2, window2 = setup()
    acc2.load_state(path)
    assert torch.equal(acc2.unwrap_model(model2)[1].running_mean, main[0])  # the main process's, as accelerate
    got = [b for _, b in zip(range(2), loader2, strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, following, strict=True)), (got, following)  # each its own
    assert list(window2.recent) == [0]  # the main process's, as accelerate
    acc2.load_state(f"{tmp}/ck2")
    assert torch.equal(torch.get_rng_state(), rng_after) and torch.equal(torch.rand(3), draws)
    acc2.wait_for_everyone()
