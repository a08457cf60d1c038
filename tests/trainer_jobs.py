"""Hugging Face Trainer runs for tests/test_integrations_transformers.py: a tiny model
with dropout (so the RNG state matters) trained a few steps on CPU, its checkpoints
mirrored to a bcp URI by BcpCheckpointCallback, and a run resumed from that URI. Used
in the test process (1 rank) and in gloo workers (2 ranks, DDP); a 32 MiB model on 2
and 4 ranks, saved at every step."""

from __future__ import annotations

import json
import os

import torch

from bcp.integrations.transformers import BcpCheckpointCallback, restore_checkpoint

STEPS = 4
SAVE_EVERY = 2


class Tiny(torch.nn.Module):
    """A Linear, Dropout, Linear regressor returning its loss as the Trainer wants."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Big(torch.nn.Module):
    """A Linear(2048, 4096) (32 MiB of weights) and Dropout: its checkpoint takes long
    enough to write that a rank listing the folder before rank 0 is done would see
    safetensors' temporary file."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(BIG_IN, 4096)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.drop(self.linear(x)).mean(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


BIG_IN = 2048
BIG_STEPS = 3


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, features: int = 6) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, features, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def trainer(output_dir: str, uri: str, extra_callbacks=(), *, big: bool = False, **args):
    """A Trainer of Tiny (``big``: of Big, saving at every step) mirroring to ``uri``."""
    from transformers import Trainer, TrainingArguments

    args = {"max_steps": BIG_STEPS if big else STEPS, "save_steps": 1 if big else SAVE_EVERY, **args}
    targs = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=3,
        disable_tqdm=True,
        **args,
    )
    callback = BcpCheckpointCallback(uri)
    callbacks = [callback, *extra_callbacks]
    model, data = (Big(), Rows(32, BIG_IN)) if big else (Tiny(), Rows())
    return Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks), callback


def losses(t) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in t.state.log_history if "loss" in e]


def params(t) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def run(work: str, uri: str, extra_callbacks=(), **args) -> dict:
    """The uninterrupted run (mirroring checkpoints 2 and 4 to ``uri``), then a fresh
    Trainer in a fresh folder resumed from checkpoint 2 restored from ``uri``; the
    parameters and losses of both, and the restored folder."""
    full, callback = trainer(os.path.join(work, "full"), uri, extra_callbacks, **args)
    full.train()
    assert callback.mirrored == [2, 4], callback.mirrored
    resumed, _ = trainer(os.path.join(work, "resumed"), uri, **args)
    path = restore_checkpoint(uri, os.path.join(work, "restored"), step=SAVE_EVERY)
    resumed.train(resume_from_checkpoint=path)
    return {
        "full": params(full),
        "resumed": params(resumed),
        "full_losses": losses(full),
        "resumed_losses": losses(resumed),
        "restored": path,
        "original": os.path.join(work, "full", f"checkpoint-{SAVE_EVERY}"),
    }


def ddp_job(rank: int, world: int, work: str, uri: str, result_path: str) -> None:
    """:func:`run` on every rank of a gloo group (the Trainer's DDP on CPU); rank 0
    saves the results for the test to judge."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result = run(work, uri, ddp_backend="gloo")
    assert_resumed_bit_identical(result, f"rank {rank}")
    if rank == 0:
        torch.save(result, result_path)


def assert_resumed_bit_identical(result: dict, where: str, steps: int = STEPS) -> None:
    assert result["full"].keys() == result["resumed"].keys()
    for k, v in result["full"].items():
        assert torch.equal(v, result["resumed"][k]), f"{where}: {k} differs after resuming from bcp"
    assert result["resumed_losses"] == result["full_losses"], f"{where}: {result['resumed_losses']}"
    assert [s for s, _ in result["full_losses"]] == list(range(1, steps + 1)), result["full_losses"]


def local_files(folder: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
        for d, _, files in os.walk(folder)
        for f in files
    }


def big_ddp_job(rank: int, world: int, work: str, uri: str, summary_path: str) -> None:
    """Big on ``world`` gloo ranks, saved and mirrored at every step: every mirrored
    checkpoint holds exactly the files of the local one (no temporary file), and a run
    resumed from the store's checkpoint 1 ends bit-identical to the uninterrupted one."""
    from bcp.backends import backend_for
    from bcp.integrations.transformers import MANIFEST_NAME, read_manifest

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    full, callback = trainer(os.path.join(work, "full"), uri, big=True, ddp_backend="gloo")
    full.train()
    assert callback.mirrored == list(range(1, BIG_STEPS + 1)), callback.mirrored
    backend = backend_for(uri)
    stored = {}
    for step in callback.mirrored:
        name = f"checkpoint-{step}"
        local = local_files(os.path.join(work, "full", name))
        assert {f"rng_state_{r}.pth" for r in range(world)} | {"model.safetensors", "optimizer.pt"} <= local
        assert set(read_manifest(backend, name)) == local, f"rank {rank}: {name} manifest"
        keys = {k.removeprefix(f"{name}/") for k in backend.list(f"{name}/")}
        assert keys == local | {MANIFEST_NAME}, f"rank {rank}: {name} holds {sorted(keys - local)}"
        stored[name] = sorted(keys)
    resumed, _ = trainer(os.path.join(work, "resumed"), uri, big=True, ddp_backend="gloo")
    path = restore_checkpoint(uri, os.path.join(work, f"restored-{rank}"), step=1)
    resumed.train(resume_from_checkpoint=path)
    result = {"full": params(full), "resumed": params(resumed), "full_losses": losses(full)}
    result["resumed_losses"] = losses(resumed)
    assert_resumed_bit_identical(result, f"rank {rank}", steps=BIG_STEPS)
    if rank == 0:
        with open(summary_path, "w") as f:
            json.dump({"stored": stored, "losses": result["full_losses"]}, f)
