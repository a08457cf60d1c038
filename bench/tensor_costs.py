"""Per-tensor fixed costs: the same total bytes in 100, 1,000 or 10,000 tensors.

Builds a state of n CPU float32 tensors of mixed sizes (log-uniform, a few 0-dim
``step`` scalars like AdamW's) that sum to the same bytes for every n, then times, in
one process, interleaved (n=100, n=1,000, n=10,000, n=100, ...), medians over rounds:
  save    bcp.save(state, dir, overwrite=True)   (sync save: plan, stage, write, commit)
  async   bcp.async_save(...) until it returns (the caller's blocking part), steady state
  load    bcp.load(state, dir)                   (load plan, read, verify every block)
Each is given as wall seconds and CPU seconds of the process (time.process_time: all
threads), and "10k/100" the ratio of the largest n to the smallest (target <= 1.3).
Below, the stage totals of bcp's trace (``trace=True``: plan, copy, checksum, stage,
write, drain, durable, commit; load: catalog, plan, fetch, verify, read) per n.
``--profile N`` prints a cProfile (cumulative, top 30) of one save and one load at n=N,
to find what grows with the number of tensors. The checkpoints go to --dir (default
a temporary directory under /dev/shm when it exists, so the disk's swings do not hide
the fixed costs).

    python bench/tensor_costs.py                              # 100, 1,000, 10,000 x 512 MiB
    python bench/tensor_costs.py --total-mib 1024 --rounds 5
    python bench/tensor_costs.py --profile 10000
    python bench/tensor_costs.py --ranks 2            # 2 gloo processes, the same state on each (DDP)

With ``--ranks R`` the save and load run in R gloo processes on this machine, every
rank holding the same n tensors (replicated: bcp writes each once, balanced over the
ranks); the table then gives rank 0's wall and CPU seconds, medians, and no async row.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import bcp


def build_state(n: int, total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """n float32 tensors of mixed sizes summing to total_bytes (every 20th a 0-dim scalar)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)  # every rank builds the same values
    scalars = n // 20
    big = n - scalars
    weights = np.exp(rng.uniform(0.0, np.log(4096.0), size=big))
    elems = total_bytes // 4 - scalars
    counts = np.maximum(1, np.floor(weights / weights.sum() * elems)).astype(np.int64)
    counts[np.argmax(counts)] += elems - int(counts.sum())
    state: dict[str, torch.Tensor] = {}
    k = 0
    for i in range(n):
        if scalars and i % 20 == 19:
            state[f"optim.state.{i}.step"] = torch.tensor(float(i))
            continue
        c = int(counts[k])
        k += 1
        cols = 1024 if c % 1024 == 0 and c >= 1024 else 1
        state[f"model.layers.{i // 16}.w{i % 16}"] = (
            torch.randn(c // cols, cols, generator=gen) if cols > 1 else torch.randn(c, generator=gen)
        )
    return state


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


class Run:
    """One timed operation; ``finish`` waits for an async save and returns its stages."""

    def __init__(self, op: str, state: dict[str, torch.Tensor], uri: str) -> None:
        self.op, self.state, self.uri = op, state, uri
        self.handle: bcp.AsyncSaveHandle | None = None
        self.info: bcp.SaveInfo | bcp.LoadInfo | None = None

    def __call__(self) -> None:
        if self.op == "save":
            self.info = bcp.save(self.state, self.uri, overwrite=True, trace=True)
        elif self.op == "async":
            self.handle = bcp.async_save(self.state, self.uri + "a", overwrite=True, trace=True)
        else:
            self.info = bcp.load_with_info(self.state, self.uri, trace=True)

    def finish(self) -> dict[str, float]:
        info = self.handle.wait() if self.handle is not None else self.info
        return {k: v.seconds for k, v in (info.stages or {}).items()} if info is not None else {}


def _rank_main(rank: int, world: int, port: int, root: str, counts: list[int], total: int, rounds: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    states = {n: build_state(n, total) for n in counts}
    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for n in counts:
        bcp.save(states[n], f"{root}/d{n}", overwrite=True)
        bcp.load(states[n], f"{root}/d{n}")
    for _ in range(rounds):
        for n in counts:
            for op in ("save", "load"):
                dist.barrier()
                if op == "save":
                    r = timed(lambda n=n: bcp.save(states[n], f"{root}/d{n}", overwrite=True))
                else:
                    r = timed(lambda n=n: bcp.load(states[n], f"{root}/d{n}"))
                res.setdefault((op, n), []).append(r)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def distributed(ranks: int, root: Path, counts: list[int], total: int, rounds: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, ranks, port, str(root), counts, total, rounds, out))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    res = out.get()
    for proc in procs:
        proc.join()
    print(f"{total >> 20} MiB in n tensors on each of {ranks} gloo ranks (replicated), rank 0, medians of {rounds}")
    print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print("op     " + "".join(f"{'n=' + str(n):>22}" for n in counts) + f"{'ratio':>16}")
    for op in ("save", "load"):
        walls = [statistics.median(r[0] for r in res[(op, n)]) for n in counts]
        cpus = [statistics.median(r[1] for r in res[(op, n)]) for n in counts]
        cells = "".join(f"{w:>11.3f}{c:>11.3f}" for w, c in zip(walls, cpus, strict=True))
        print(f"{op:<7}{cells}{walls[-1] / walls[0]:>8.2f}{cpus[-1] / cpus[0]:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="100,1000,10000")
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--profile", type=int, default=0, help="profile one save and one load at this n")
    ap.add_argument("--ops", default="save,async,load")
    ap.add_argument("--ranks", type=int, default=1, help="run save and load in this many gloo processes")
    args = ap.parse_args()
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = Path(tempfile.mkdtemp(prefix="bcp-tensor-costs-", dir=base))
    total = args.total_mib << 20
    counts = [int(x) for x in args.counts.split(",")]
    ops = args.ops.split(",")
    if args.ranks > 1:
        try:
            distributed(args.ranks, root, counts, total, args.rounds)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        return
    states = {n: build_state(n, total) for n in counts}
    try:
        if args.profile:
            st = states.get(args.profile) or build_state(args.profile, total)
            uri = str(root / f"p{args.profile}")
            bcp.save(st, uri, overwrite=True)
            bcp.load(st, uri)
            for name, fn in (
                ("save", lambda: bcp.save(st, uri, overwrite=True)),
                ("load", lambda: bcp.load(st, uri)),
            ):
                prof = cProfile.Profile()
                prof.enable()
                fn()
                prof.disable()
                print(f"==== {name} n={args.profile}")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
            return
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        stages: dict[tuple[str, int], list[dict[str, float]]] = {}
        for n in counts:  # warm: first save of each structure, async staging
            uri = str(root / f"n{n}")
            bcp.save(states[n], uri, overwrite=True)
            if "async" in ops:
                bcp.async_save(states[n], uri + "a", overwrite=True).wait()
            bcp.load(states[n], uri)
        for _ in range(args.rounds):
            for n in counts:
                for op in ops:
                    run = Run(op, states[n], str(root / f"n{n}"))
                    results.setdefault((op, n), []).append(timed(run))
                    stages.setdefault((op, n), []).append(run.finish())
        print(f"{args.total_mib} MiB in n tensors, medians of {args.rounds} rounds, dir {root.parent}")
        print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        head = "op     " + "".join(f"{'n=' + str(n):>22}" for n in counts) + f"{'ratio':>16}"
        print(head)
        print("       " + "".join(f"{'wall s':>11}{'cpu s':>11}" for _ in counts) + f"{'wall':>8}{'cpu':>8}")
        for op in ops:
            cells, walls, cpus = "", [], []
            for n in counts:
                w = statistics.median(r[0] for r in results[(op, n)])
                c = statistics.median(r[1] for r in results[(op, n)])
                walls.append(w)
                cpus.append(c)
                cells += f"{w:>11.3f}{c:>11.3f}"
            print(f"{op:<7}{cells}{walls[-1] / walls[0]:>8.2f}{cpus[-1] / cpus[0]:>8.2f}")
        print("\nstage seconds (bcp trace spans, wall, medians; async: the save's whole timeline)")
        for op in ops:
            names = sorted({k for (o, _n), rows in stages.items() if o == op for row in rows for k in row})
            for name in names:
                vals = [statistics.median(row.get(name, 0.0) for row in stages[(op, n)]) for n in counts]
                ratio = f"{vals[-1] / vals[0]:>8.2f}" if vals[0] > 0 else f"{'-':>8}"
                print(f"{op + '.' + name:<16}" + "".join(f"{v:>11.4f}" for v in vals) + ratio)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
