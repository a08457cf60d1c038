"""How long a checkpoint stalls a training step: sync save, async_save, and
async_save(overlap=optimizer), on a small MLP trained with AdamW.

Stall of a save = (time of the step that saves + time of the next step) minus two
median plain steps. Medians over --saves saves.

    python bench/overlap_bench.py [--hidden 4096] [--layers 6] [--saves 5] [--dir /tmp/bcp-overlap]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

import bcp


def build(hidden: int, layers: int):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def step(model, opt, x) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--dir", default="/tmp/bcp-overlap")
    p.add_argument(
        "--train-threads",
        type=int,
        default=0,
        help="torch threads for training (1 leaves a core to bcp's background work, as a GPU job would)",
    )
    args = p.parse_args()
    if args.train_threads:
        torch.set_num_threads(args.train_threads)
    model, opt = build(args.hidden, args.layers)
    x = torch.randn(args.batch, args.hidden)
    for _ in range(3):
        step(model, opt, x)  # optimizer state exists, memory warm
    state_bytes = sum(t.numel() * 4 for t in model.state_dict().values()) * 3
    plain = []
    for _ in range(6):
        t0 = time.perf_counter()
        step(model, opt, x)
        plain.append(time.perf_counter() - t0)
    base = statistics.median(plain)
    print(
        f"model {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params; state {state_bytes / 2**30:.2f} GiB "
        f"(weights + AdamW moments); plain step {base:.3f} s (median of {len(plain)})"
    )

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    rows = []
    for mode in ("sync save", "async_save", "async_save(overlap=optimizer)"):
        stalls, blocking = [], []
        for k in range(args.saves):
            uri = os.path.join(args.dir, f"{k % 2}")
            t0 = time.perf_counter()
            if mode == "sync save":
                bcp.save(state(), uri, overwrite=True)
                handle = None
            elif mode == "async_save":
                handle = bcp.async_save(state(), uri, overwrite=True)
            else:
                handle = bcp.async_save(state(), uri, overwrite=True, overlap=opt)
            returned = time.perf_counter() - t0
            step(model, opt, x)
            step(model, opt, x)
            t2 = time.perf_counter()
            if handle is not None:
                handle.wait()
            blocking.append(returned)
            stalls.append((t2 - t0) - 2 * base)
        rows.append((mode, statistics.median(blocking), statistics.median(stalls)))
    print("\n| mode | call returns after (s) | stall per save (s) | stall / plain step |")
    print("|---|---:|---:|---:|")
    for mode, b, s in rows:
        print(f"| {mode} | {b:.3f} | {s:.3f} | {s / base:.2f} |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
