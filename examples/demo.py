"""bcp demo: train, checkpoint mid-run, resume in a fresh model, and check the
resumed run is bit-for-bit the same as the uninterrupted one; then the same with
FSDP2 on 2 processes resumed on 3 (load-time resharding).

    python examples/demo.py [--dir DIR] [--steps N] [--hidden H] [--no-distributed]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

import bcp


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 8),
    )


class Trainer:
    """Model, AdamW, cosine schedule and a synthetic data stream driven by torch's RNG."""

    def __init__(self, hidden: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = make_model(hidden)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=100)
        self.step = 0
        self.samples_seen = 0

    def train_step(self) -> float:
        x = torch.randn(32, 64)
        y = torch.sin(x[:, :8] * 3) + 0.1 * random.random() + 0.01 * float(np.random.rand())
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.samples_seen += x.shape[0]
        return loss.item()

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "trainer": {"step": self.step, "samples_seen": self.samples_seen},
            # per rank: in a multi-process job each rank has its own RNG states
            "rng": bcp.PerRank(
                {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
            ),
        }

    def restore(self, state: dict) -> None:
        self.opt.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["trainer"]["step"]
        self.samples_seen = state["trainer"]["samples_seen"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])


def manager_demo(root: str, hidden: int, steps: int) -> bool:
    """A run under bcp.CheckpointManager: asynchronous saves every 3 steps with
    keep_last=2, a crash (and a save killed half-way), a restart from the newest
    committed step; the resumed losses must equal an uninterrupted run's."""
    from bcp.discovery import scan
    from bcp.metadata.keys import data_file_key, generation_name, step_name

    print(f"\n-- CheckpointManager: {root}, save every 3 steps, keep_last=2, async")
    random.seed(7)
    np.random.seed(7)
    reference_run = Trainer(hidden, seed=7)
    reference = [reference_run.train_step() for _ in range(steps)]

    crash_at = steps - steps // 3
    random.seed(7)
    np.random.seed(7)
    run = Trainer(hidden, seed=7)
    with bcp.CheckpointManager(root, keep_last=2) as manager:
        for step in range(1, crash_at + 1):
            run.train_step()
            if step % 3 == 0:
                manager.save(step, run.state())
    # the job dies after step crash_at; its next save was killed half-way:
    bcp.backends.backend_for(root).write(
        f"{step_name(crash_at + 1)}/{data_file_key(generation_name('dead'), 0)}", b"partial"
    )
    found = scan(bcp.backends.backend_for(root))
    print(
        f"after the crash: committed steps {[s for s, i in sorted(found.items()) if i.committed]}, "
        f"incomplete {[s for s, i in sorted(found.items()) if not i.committed]}"
    )

    resumed = Trainer(hidden, seed=99)
    manager = bcp.CheckpointManager(root, keep_last=2)  # a restart: collects the incomplete step
    step, state = manager.load_latest(resumed.state())
    resumed.restore(state)
    print(f"restart: resumed from step {step}; steps on storage now {manager.steps()}")
    continued = [resumed.train_step() for _ in range(steps - step)]
    same = continued == reference[step:]
    print(f"losses after restart equal the uninterrupted run: {'yes' if same else 'NO'}")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=20, help="training steps in all (checkpoint at half)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--no-distributed", action="store_true", help="skip the 2 -> 3 process FSDP2 part")
    args = p.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="bcp-demo-")
    uri = f"{workdir.rstrip('/')}/step{args.steps // 2}"
    random.seed(0)
    np.random.seed(0)

    run = Trainer(args.hidden, seed=0)
    n_params = sum(p.numel() for p in run.model.parameters())
    print(
        f"model: {n_params / 1e6:.2f} M parameters, AdamW, cosine LR; {args.steps} steps, "
        f"checkpoint at step {args.steps // 2}"
    )
    for _ in range(args.steps // 2):
        run.train_step()
    info = bcp.save(run.state(), uri, overwrite=True)
    print(f"\n{info}")
    print(
        f"  {info.tensors} tensors in {info.fragments} fragments, {info.objects} objects, "
        f"{info.bytes_written:,} bytes in data files"
    )
    reference = [run.train_step() for _ in range(args.steps - args.steps // 2)]

    reader = bcp.open(uri)
    print(f"\ncatalog of {reader.uri} (format v{reader.manifest.version}, {len(reader.tensor_keys())} tensors):")
    print(f"  {'fqn':<34} {'shape':<14} {'dtype':<9} {'bytes':>12}")
    for fqn in sorted(reader.tensor_keys(), key=lambda k: -reader.meta(k).nbytes)[:6]:
        m = reader.meta(fqn)
        print(f"  {fqn:<34} {list(m.shape)!s:<14} {str(m.dtype).removeprefix('torch.'):<9} {m.nbytes:>12,}")
    print(f"  ... objects: {', '.join(reader.object_keys())}")

    resumed = Trainer(args.hidden, seed=1234)  # different init: everything must come from the checkpoint
    t0 = time.perf_counter()
    state = bcp.load(resumed.state(), uri)
    load_s = time.perf_counter() - t0
    resumed.restore(state)
    print(
        f"\nloaded into a fresh model in {load_s:.3f} s ({info.tensor_bytes / load_s / 1e9:.2f} GB/s); "
        f"resuming at step {resumed.step}"
    )
    continued = [resumed.train_step() for _ in range(args.steps - args.steps // 2)]

    same_losses = continued == reference
    same_params = all(
        torch.equal(a, b) for a, b in zip(run.model.parameters(), resumed.model.parameters(), strict=True)
    )
    print(f"losses after resume: {' '.join(f'{v:.5f}' for v in continued[:5])} ...")
    print(f"uninterrupted run:   {' '.join(f'{v:.5f}' for v in reference[:5])} ...")
    print(
        f"training continues identically: {'yes' if same_losses and same_params else 'NO'} "
        f"(losses equal: {same_losses}, final parameters equal: {same_params})"
    )
    ok = same_losses and same_params
    ok = manager_demo(f"{workdir.rstrip('/')}/run", args.hidden, steps=args.steps) and ok
    if not args.no_distributed:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import demo_distributed

        ok = demo_distributed.run(f"{workdir.rstrip('/')}/fsdp-step", steps=args.steps // 2 * 2) and ok
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
