"""How long ``bcp.async_save`` blocks the caller, beside a memcpy of the same tensors.

Rows (medians of interleaved samples: bcp, warm memcpy, fresh memcpy, bcp, ...):

* steady state: ``async_save`` with the staging pool warm (the previous save waited
  for), against ``copy_`` of every tensor into destination tensors copied into before
  (warm memory). Target: at most 1.2x.
* first call: ``async_save`` with a new staging pool (its slabs allocated by the call,
  as in the first save of a process; the plan cache stays warm), against a copy into
  freshly allocated tensors (first touch of every page). Target: at most 2x.
* per-tensor fixed costs: the same total bytes as 100, 1,000 and 10,000 equal tensors
  (steady state). Target: 10,000 at most 1.3x the 100-tensor blocking time.

Shapes: ``transformer`` (a Llama-shaped model with AdamW state: embedding, q/k/v/o,
gate/up/down, two norms and biases per layer, ``exp_avg``/``exp_avg_sq`` per
parameter and a 0-dim ``step``) and ``equal`` (48 equal float32 tensors, the shape of
bench/peers.py). The defaults fit a shared machine (about 0.5 GiB); ``--layers 24
--width 1024`` is the 2.6 GiB state of issue 37.

    python bench/async_blocking.py [--samples 7] [--layers 6 --width 768] [--dir /tmp]
    python bench/async_blocking.py --profile steady   # cProfile of one steady call
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import bcp
from bcp.io_scheduler.staging import StagingPool, default_budget


def transformer_state(layers: int, d: int, vocab: int, ffn: int) -> dict[str, torch.Tensor]:
    """A Llama-shaped model's parameters with AdamW state (moments and a 0-dim step each)."""
    params: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            params[p + f"attn.{name}.weight"] = (d, d)
        params[p + "attn.o.bias"] = (d,)
        params[p + "mlp.gate.weight"] = (ffn, d)
        params[p + "mlp.up.weight"] = (ffn, d)
        params[p + "mlp.down.weight"] = (d, ffn)
        params[p + "mlp.down.bias"] = (d,)
        params[p + "norm1.weight"] = (d,)
        params[p + "norm2.weight"] = (d,)
    params["norm.weight"] = (d,)
    params["lm_head.weight"] = (vocab, d)
    state: dict[str, torch.Tensor] = {}
    for name, shape in params.items():
        state[f"model.{name}"] = torch.randn(shape)
        state[f"optim.{name}.exp_avg"] = torch.randn(shape)
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape)
        state[f"optim.{name}.step"] = torch.tensor(10.0)
    return state


def equal_state(nbytes: int, tensors: int) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // tensors // 4)
    return {f"t{i:05d}": torch.randn(per) for i in range(tensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Memcpy:
    """``copy_`` of every tensor: into buffers copied into before (warm) or new ones (fresh)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.src = list(state.values())
        self.dst = [torch.empty_like(t) for t in self.src]
        self.warm()

    def _warm(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)

    def warm(self, kind: str = "warm") -> float:
        return cpu_timed(kind, self._warm)

    def _memmove(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            np.copyto(d.view(-1).view(torch.uint8).numpy(), s.view(-1).view(torch.uint8).numpy())

    def memmove(self) -> float:
        """The same copy as one single-threaded memmove per tensor (numpy), as bcp stages."""
        return cpu_timed("memmove", self._memmove)

    def fresh(self) -> float:
        out: list[torch.Tensor] = []
        seconds = cpu_timed("fresh", lambda: out.extend(torch.empty_like(s).copy_(s) for s in self.src))
        out.clear()  # freed: the next sample allocates fresh memory again
        return seconds


#: CPU seconds (every thread of the process) of the last timed call, by kind
CPU: dict[str, list[float]] = {}


def cpu_timed(kind: str, fn):
    """``fn()``'s wall seconds; its process CPU seconds go to ``CPU[kind]`` (on a shared
    machine the CPU time of the code path is steadier than its wall time)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    CPU.setdefault(kind, []).append(time.process_time() - c0)
    return seconds


def blocking(state, uri: str, pool: StagingPool | None = None, kind: str = "bcp") -> float:
    handles = []
    cpu_timed(kind, lambda: handles.append(bcp.async_save(state, uri, overwrite=True, pool=pool)))
    handles[0].wait()
    return handles[0].blocking_seconds


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def row(label: str, bcp_s: list[float], ref_s: list[float], ref: str, target: float | None, cpu=("", "")) -> None:
    b, r = median(bcp_s), median(ref_s)
    ratio = b / r if r else float("inf")
    goal = f" (target <= {target:.1f}x)" if target else ""
    cb, cr = (median(CPU.pop(k)) for k in cpu) if cpu[0] else (float("nan"), float("nan"))
    print(
        f"| {label} | {b * 1e3:.1f} ms | {ref}: {r * 1e3:.1f} ms | {ratio:.2f}x{goal} "
        f"| {cb * 1e3:.1f} / {cr * 1e3:.1f} ms = {cb / cr:.2f}x |",
        flush=True,
    )


def measure_shape(label: str, state, uri: str, samples: int, first: bool) -> None:
    memcpy = Memcpy(state)
    n = len(state)
    size = state_bytes(state)
    print(f"\n{label}: {n} tensors, {size / 2**20:.1f} MiB", flush=True)
    t0 = time.perf_counter()
    first_process = blocking(state, uri, kind="once")  # the process's first save of this state: plans, fills the pool
    print(f"(first save of this state in the process: {first_process * 1e3:.1f} ms blocking)", flush=True)
    steady, warm, fresh, first_calls, memmove = [], [], [], [], []
    for _ in range(samples):
        steady.append(blocking(state, uri))
        warm.append(memcpy.warm())
        memmove.append(memcpy.memmove())
        fresh.append(memcpy.fresh())
        if first:
            pool = StagingPool(default_budget())  # a new pool: the first call's slab allocation
            first_calls.append(blocking(state, uri, pool, kind="first"))
            del pool
    print("| case | bcp | reference | ratio | CPU seconds, bcp / reference |\n|---|---|---|---|---|")
    bcp_cpu = list(CPU["bcp"])
    row("async_save blocking, steady state", steady, warm, "memcpy into warm buffers", 1.2, ("bcp", "warm"))
    CPU["bcp"] = bcp_cpu
    row("(same, against one-thread memmoves)", steady, memmove, "numpy memmove, warm", None, ("bcp", "memmove"))
    if first:
        row(
            "async_save blocking, first call (new pool)",
            first_calls,
            fresh,
            "memcpy into fresh memory",
            2.0,
            ("first", "fresh"),
        )
    CPU.clear()
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


def measure_counts(total: int, uri: str, samples: int) -> None:
    print(f"\nper-tensor fixed costs: {total / 2**20:.0f} MiB as 100 / 1,000 / 10,000 equal tensors", flush=True)
    states = {n: equal_state(total, n) for n in (100, 1000, 10000)}
    copies = {n: Memcpy(s) for n, s in states.items()}
    for n, s in states.items():
        blocking(s, f"{uri}-{n}", kind="once")  # plan and warm
    times: dict[int, list[float]] = {n: [] for n in states}
    warm: dict[int, list[float]] = {n: [] for n in states}
    for _ in range(samples):
        for n, s in states.items():
            times[n].append(blocking(s, f"{uri}-{n}", kind=f"bcp{n}"))
            warm[n].append(copies[n].warm(kind=f"warm{n}"))
    print(
        "| tensors | bcp blocking | memcpy into warm buffers | ratio | vs 100 tensors "
        "| CPU ms bcp / memcpy | CPU vs 100 tensors |\n|---|---|---|---|---|---|---|"
    )
    base, cpu_base = median(times[100]), median(CPU["bcp100"])
    for n in states:
        b, w = median(times[n]), median(warm[n])
        cb, cw = median(CPU[f"bcp{n}"]), median(CPU[f"warm{n}"])
        print(
            f"| {n:,} | {b * 1e3:.1f} ms | {w * 1e3:.1f} ms | {b / w:.2f}x | {b / base:.2f}x (target <= 1.3x) "
            f"| {cb * 1e3:.1f} / {cw * 1e3:.1f} | {cb / cpu_base:.2f}x |"
        )


def profile(state, uri: str, which: str) -> None:
    blocking(state, uri)
    pool = StagingPool(default_budget()) if which == "first" else None
    prof = cProfile.Profile()
    prof.enable()
    seconds = blocking(state, uri, pool)
    prof.disable()
    print(f"{which} call: {seconds * 1e3:.1f} ms blocking (with cProfile)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--ffn", type=int, default=0, help="MLP width (default 8/3 of --width)")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--only", choices=("transformer", "equal", "counts"), action="append")
    ap.add_argument("--profile", choices=("steady", "first"))
    args = ap.parse_args()
    ffn = args.ffn or (8 * args.width // 3 + 63) // 64 * 64
    only = set(args.only or ("transformer", "equal", "counts"))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bcp-async-blocking-") as root:
        uri = os.path.join(root, "ckpt")
        state = transformer_state(args.layers, args.width, args.vocab, ffn)
        total = state_bytes(state)
        if args.profile:
            profile(state, uri, args.profile)
            return
        if "transformer" in only:
            measure_shape(f"transformer ({args.layers} layers, d={args.width})", state, uri, args.samples, True)
        del state
        if "equal" in only:
            measure_shape("48 equal tensors", equal_state(total, 48), uri + "-eq", args.samples, True)
        if "counts" in only:
            measure_counts(total, uri + "-n", max(3, args.samples // 2))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
