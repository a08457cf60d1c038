"""What an incremental save costs on dense training, where every piece changes.

Prints (1) the digest candidates' speed on one buffer (XXH3-128, BLAKE3 on one and
two threads, CRC32C as bcp computes it; the fastest of --repeats), then (2) a full
save against an incremental save whose base differs in every byte (the state is
changed in place before each pair), interleaved (full, incremental, incremental,
full, ...) so the shared disk and CPU treat both alike: the medians of wall seconds
and of process CPU seconds (all threads), their ratios, and the bytes each wrote.

    python bench/incremental_cost.py [--mib 256] [--tensors 8] [--rounds 5] [--dir /tmp/bcp-incr-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import numpy as np
import torch
import xxhash

import bcp
from bcp.metadata import crc32c


def digest_speeds(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s (10^9) of each candidate over ``nbytes`` random bytes: the fastest of ``repeats``."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    fns = {"xxh3_128": lambda: xxhash.xxh3_128_digest(data), "crc32c": lambda: crc32c(data)}
    try:
        import blake3

        fns["blake3 (1 thread)"] = lambda: blake3.blake3(data).digest()
        fns["blake3 (2 threads)"] = lambda: blake3.blake3(data, max_threads=2).digest()
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bcp-incr-bench")
    args = ap.parse_args()

    for name, gbps in digest_speeds(min(args.mib, 256) << 20, args.repeats).items():
        print(f"digest {name:20s} {gbps:6.1f} GB/s")

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows = (args.mib << 20) // args.tensors // 4 // 1024
    state = {f"w{i}": torch.randn(rows, 1024) for i in range(args.tensors)}
    base = os.path.join(args.dir, "incr-base")
    bcp.save(state, base, incremental=True)
    times: dict[str, list[tuple[float, float]]] = {"full": [], "incremental": []}
    written: dict[str, int] = {}
    for r in range(args.rounds):
        for t in state.values():
            t.add_(1.0)  # every piece changes
        order = ["full", "incremental"] if r % 2 == 0 else ["incremental", "full"]
        for kind in order:
            uri = os.path.join(args.dir, f"{kind}-{r}")
            os.sync()
            wall, cpu = time.perf_counter(), time.process_time()
            info = bcp.save(state, uri) if kind == "full" else bcp.save(state, uri, base=base)
            times[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
            written[kind] = info.bytes_written
        shutil.rmtree(os.path.join(args.dir, f"full-{r}"))
        # the next incremental save's base is this one (its predecessor is no longer needed)
        old, base = base, os.path.join(args.dir, f"incremental-{r}")
        shutil.rmtree(old)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    for kind, (w, c) in med.items():
        print(f"{kind:12s} wall {w:7.3f} s  cpu {c:7.3f} s  wrote {written[kind] / 2**20:9.1f} MiB")
    print(
        f"incremental_cost: all changed, {args.mib} MiB: time {med['incremental'][0] / med['full'][0]:.3f}x, "
        f"cpu {med['incremental'][1] / med['full'][1]:.3f}x, bytes {written['incremental'] / written['full']:.4f}x"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
