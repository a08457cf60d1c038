"""The blocking copy of a steady ``async_save`` alone: how its schedule uses the cores.

The same bytes (``--tensors`` equal float32 tensors, ``--gib`` in all; or ``--shape
transformer``: bench/shapes.py's Llama-shaped state with AdamW moments, hundreds of tensors
from 4 bytes to hundreds of MiB) copied into warm 32 MiB slabs in 4 MiB parts, as a kept
plan stages them (``chunk_bytes.RunCopies``):

* ``stream``: chunk after chunk, the caller setting up the next chunk while the helpers
  finish their parts of the last (how bcp stages);
* ``join``: every chunk waited for before the next (``finish()`` per chunk: how bcp
  staged before issue 37's fix; a core idles at each chunk's end);
* ``copy_``: ``Tensor.copy_`` of each tensor into warm tensors (torch's intra-op threads).

Rounds interleave the three in rotating order; the table gives medians of wall and CPU
seconds, the cores used (CPU / wall) and the ratio to ``copy_`` in the same round. The
machine is shared: each sample also records the cores other processes used meanwhile
(/proc/stat), and ``--quiet 0.3`` waits (up to 5 s) before each round for a moment when
they use less than that, and keeps only the rounds they stayed under it.

    python bench/stage_copy.py [--gib 2] [--tensors 40] [--rounds 15] [--quiet 0.3] [--shape transformer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bcp.io_scheduler.chunk_bytes import RunCopies
from bcp.io_scheduler.chunk_plan import COPY_PART_BYTES, split_parts
from bcp.io_scheduler.staging import DEFAULT_SLAB_BYTES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # bench/ is not a package


def busy_seconds() -> float:
    """CPU seconds every process has used (all cores), from /proc/stat (0 elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def timed(fn) -> tuple[float, float, float]:
    """``fn()``'s wall and process CPU seconds, and the cores other processes used meanwhile."""
    b0, c0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, max(0.0, busy_seconds() - b0 - cpu) / wall


def wait_quiet(limit: float, budget: float = 5.0) -> None:
    end = time.monotonic() + budget
    while time.monotonic() < end:
        b0, c0 = busy_seconds(), time.process_time()
        time.sleep(0.2)
        if (busy_seconds() - b0 - (time.process_time() - c0)) / 0.2 < limit:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quiet", type=float, default=None, help="keep rounds where others used fewer cores")
    ap.add_argument("--shape", choices=("equal", "transformer"), default="equal")
    args = ap.parse_args()
    if args.shape == "transformer":
        src = list(shapes.tensors(shapes.transformer_state(args.gib)))
    else:
        per = max(4, int(args.gib * 2**30 / args.tensors) // 4 * 4)
        src = [torch.randn(per // 4) for _ in range(args.tensors)]
    dst = [torch.zeros_like(t) for t in src]
    total, slab = sum(t.nbytes for t in src), DEFAULT_SLAB_BYTES
    slabs = [torch.ones(min(slab, total - at), dtype=torch.uint8) for at in range(0, total, slab)]
    runs, at = [], 0
    for t in src:
        runs.append((at, t.data_ptr(), t.nbytes))
        at += t.nbytes
    chunks = []  # (slab address, the parts of the runs that fall in it)
    for c, buf in enumerate(slabs):
        lo, hi = c * slab, c * slab + buf.numel()
        cut = [
            (max(a, lo) - lo, p + max(a, lo) - a, min(a + n, hi) - max(a, lo))
            for a, p, n in runs
            if a < hi and a + n > lo
        ]
        chunks.append((buf.data_ptr(), split_parts(cut, COPY_PART_BYTES)))

    def stream() -> None:
        copies = RunCopies()
        for i, (base, parts) in enumerate(chunks):
            copies.copy(base, parts, i)
        copies.finish()

    def join() -> None:
        copies = RunCopies()
        for i, (base, parts) in enumerate(chunks):
            copies.copy(base, parts, i)
            copies.finish()

    def copy_() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    cases = {"stream": stream, "join": join, "copy_": copy_}
    for fn in cases.values():
        fn()  # warm
    flat = torch.cat(slabs)
    assert torch.equal(flat, torch.cat([t.reshape(-1).view(torch.uint8) for t in src])), "the staged bytes differ"
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.rounds):
        if args.quiet is not None:
            wait_quiet(args.quiet)
        for k in names[r % 3 :] + names[: r % 3]:
            samples[k].append(timed(cases[k]))
    keep = [r for r in range(args.rounds) if args.quiet is None or max(samples[k][r][2] for k in cases) < args.quiet]
    print(
        f"{len(src)} tensors, {total / 2**30:.2f} GiB, {len(chunks)} chunks of {len(chunks[0][1])} parts; "
        f"shape {args.shape}; "
        f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; "
        f"rounds kept {len(keep)} of {args.rounds}"
    )
    if not keep:
        return
    print("| schedule | wall | CPU | cores | / copy_ (per round) | others' cores |\n|---|---|---|---|---|---|")
    for k in cases:
        wall = statistics.median(samples[k][r][0] for r in keep)
        cpu = statistics.median(samples[k][r][1] for r in keep)
        ratio = statistics.median(samples[k][r][0] / samples["copy_"][r][0] for r in keep)
        others = statistics.median(samples[k][r][2] for r in keep)
        print(f"| {k} | {wall * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {cpu / wall:.2f} | {ratio:.3f}x | {others:.2f} |")


if __name__ == "__main__":
    main()
