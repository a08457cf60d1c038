"""What the replica check (SaveOptions.check_replicas) costs a DDP save.

Default: 2 gloo ranks, each holding the same ~2 GiB of plain tensors (32 weights of
64 MiB, 32 biases of 16 KiB, a step counter), saved with the check "off", "small"
(the default) and "all", interleaved (off, small, all, then small, all, off, ...)
so the noisy disk treats the three alike; the page cache is flushed (sync) before each save. Prints
the median of the slowest rank's save seconds, each mode's ratio to "off", and the
check's own work timed alone (the slowest rank's fastest of 3: checksums and the
coordinator's comparison), which the noisy save times hold.

``--sweep``: the per-tensor threshold behind "small". For tensors of one size per
state, 2 ranks: the checksum work each rank does (what "all" adds, timed in
process) against the save itself with the check off, per tensor; the fastest of
--repeats runs of each (the machine is shared: the minimum is the cost itself).

    python bench/replica_check_bench.py [--repeats 3] [--dir /tmp/bcp-replica-bench] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

import bcp
from bcp.planning import LayoutMeta, TensorPlan
from bcp.replicas import ReplicaSummer, check_replicas
from bcp.shards import holds_replica, local_pieces
from bcp.state import flatten_state
from distributed_bench import spawn

MODES = ("off", "small", "all")


def ddp_state(weights: int = 32, rows: int = 4096, cols: int = 4096) -> dict:
    g = torch.Generator().manual_seed(0)  # the same values on every rank
    state: dict = {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(weights)}
    state.update({f"layer{i}.bias": torch.randn(rows, generator=g) for i in range(weights)})
    state["step"] = torch.tensor(1000)
    return state


def _timed_save(rank: int, state: dict, uri: str, mode: str) -> float:
    if rank == 0:
        shutil.rmtree(uri, ignore_errors=True)
        os.sync()  # the previous save's dirty pages are not this one's cost
    dist.barrier()
    t0 = time.perf_counter()
    bcp.save(state, uri, check_replicas=mode)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return seconds


def interleaved(rank: int, world: int, root: str, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    state = ddp_state()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    _timed_save(rank, state, f"{root}/warm", "off")  # first-save costs (pool, imports) out of the way
    for k in range(repeats):
        for mode in MODES[k % 3 :] + MODES[: k % 3]:  # rotated: no mode always follows another
            times[mode].append(_timed_save(rank, state, f"{root}/ck", mode))
    dist.barrier()
    # the check's own work, timed alone: what the save times above hold beside the noise
    work = {mode: _check_seconds(state, world, mode, reps=3) for mode in MODES[1:]}
    return times, work


def _check_seconds(state: dict, world: int, mode: str = "all", reps: int = 5) -> float:
    """What check_replicas=mode adds to a save of ``state``: on each rank, checksum
    every replicated box (as ``saver._prepare`` does, after the flattening the save
    does anyway); on the coordinator, compare ``world`` ranks' sums."""
    leaves = [leaf for leaf in flatten_state(state).values() if leaf.is_tensor]
    pieces = [(i, leaf.value, local_pieces(leaf.value, leaf.fqn)) for i, leaf in enumerate(leaves)]
    meta = LayoutMeta.of([TensorPlan(leaf.fqn, leaf.fqn, "float32", tuple(leaf.value.shape), ()) for leaf in leaves])
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        summer = ReplicaSummer(mode)
        for i, value, local in pieces:
            if holds_replica(value):
                for piece in local.pieces:
                    summer.add(i, piece.box, local.global_shape, piece.tensor)
        sums = summer.finish()
        check_replicas([sums] * world, [b"m"] * world, {b"m": meta})
        runs.append(time.perf_counter() - t0)
    return min(runs)


def sweep(rank: int, world: int, root: str, repeats: int) -> list[tuple[int, int, float, float]]:
    out = []
    for nbytes in (16, 1 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
        count = max(256, min(4096, (256 << 20) // nbytes))
        g = torch.Generator().manual_seed(nbytes)
        state = {f"t{i}": torch.randn(max(1, nbytes // 4), generator=g) for i in range(count)}
        saves = [_timed_save(rank, state, f"{root}/sweep", "off") for _ in range(repeats)]
        out.append((nbytes, count, min(saves), _check_seconds(state, world)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp-replica-bench")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        if args.sweep:
            ranks = spawn(sweep, 2, args.dir, args.repeats)
            print("2 ranks, every tensor replicated; per tensor: save (check off, slowest rank) vs checksum")
            print(f"{'tensor bytes':>12} {'tensors':>7} {'save us':>9} {'check us':>9} {'check/save':>10}")
            for row in zip(*ranks, strict=True):
                nbytes, count = row[0][0], row[0][1]
                save = max(r[2] for r in row) / count
                check = max(r[3] for r in row) / count
                print(f"{nbytes:>12} {count:>7} {save * 1e6:>9.1f} {check * 1e6:>9.2f} {check / save:>10.2%}")
            return
        ranks = spawn(interleaved, 2, args.dir, args.repeats)
        state = ddp_state()
        total = sum(t.numel() * t.element_size() for t in state.values())
        print(
            f"state: {total / 2**30:.2f} GiB in {len(state)} plain tensors on each of 2 ranks; "
            f"medians of {args.repeats}, interleaved"
        )
        slowest = {m: [max(r[0][m][i] for r in ranks) for i in range(args.repeats)] for m in MODES}
        work = {m: max(r[1][m] for r in ranks) for m in MODES[1:]}
        base = statistics.median(slowest["off"])
        print(f"{'check_replicas':<15} {'s':>7} {'vs off':>7} {'check work s':>12}  runs")
        for mode in MODES:
            t = statistics.median(slowest[mode])
            runs = " ".join(f"{x:.3f}" for x in slowest[mode])
            alone = f"{work[mode]:.4f}" if mode in work else "-"
            print(f"{mode:<15} {t:>7.3f} {t / base:>7.3f} {alone:>12}  {runs}")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
