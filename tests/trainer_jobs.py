"""Hugging Face Trainer runs for tests/test_integrations_transformers.py: a tiny model
with dropout (so the RNG state matters) trained a few steps on CPU, its checkpoints
mirrored to a bcp URI by BcpCheckpointCallback, and a run resumed from that URI. Used
in the test process (1 rank) and in gloo workers (2 ranks, DDP)."""

from __future__ import annotations

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


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def trainer(output_dir: str, uri: str, extra_callbacks=(), **args):
    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
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
    return Trainer(model=Tiny(), args=targs, train_dataset=Rows(), callbacks=callbacks), callback


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


def assert_resumed_bit_identical(result: dict, where: str) -> None:
    assert result["full"].keys() == result["resumed"].keys()
    for k, v in result["full"].items():
        assert torch.equal(v, result["resumed"][k]), f"{where}: {k} differs after resuming from bcp"
    assert result["resumed_losses"] == result["full_losses"], f"{where}: {result['resumed_losses']}"
    assert [s for s, _ in result["full_losses"]] == list(range(1, STEPS + 1)), result["full_losses"]
