"""Distributed save balance and resharding load, with and without read sharing.

Real gloo processes on this machine, on the file backend or (``--store``) on a local
S3 server started for the run. Medians of --repeats runs.

    python bench/distributed_bench.py [--mib 512] [--repeats 3] [--dir /tmp/bcp-bench] [--store rclone|moto]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bcp


def _port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank, world, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = fn(rank, world, *args)
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world, *args):
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_run, args=(world, _port(), fn, args, results), nprocs=world)
    return results.get()


def make_state(mib: int, rows: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cols = 1024
    n = max(1, mib * 2**20 // (rows * cols * 4))
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


def rows_of(rank: int, world: int, rows: int) -> tuple[int, int]:
    size = -(-rows // world)
    return min(rank * size, rows), max(0, min(size, rows - rank * size))


def save_replicated(rank, world, uri, mib):
    state = make_state(mib)
    dist.barrier()
    t0 = time.perf_counter()
    info = bcp.save(state, uri, overwrite=True)
    return time.perf_counter() - t0, info.rank_bytes_written, info.tensor_bytes


def save_sharded(rank, world, uri, mib):
    full = make_state(mib)
    state = {}
    for k, t in full.items():
        start, n = rows_of(rank, world, t.shape[0])
        state[k] = bcp.TensorShard(t[start : start + n].clone(), tuple(t.shape), (start, 0))
    dist.barrier()
    t0 = time.perf_counter()
    info = bcp.save(state, uri, overwrite=True)
    return time.perf_counter() - t0, info.rank_bytes_written, info.tensor_bytes


def load_full(rank, world, uri, mib, share):
    state = {k: torch.empty_like(v) for k, v in make_state(mib).items()}
    for t in state.values():
        t.fill_(0)  # touch the memory first: measure I/O, not page faults
    dist.barrier()
    t0 = time.perf_counter()
    info = bcp.load_with_info(state, uri, share_reads=share)
    return time.perf_counter() - t0, info.bytes_read


def load_sharded(rank, world, uri, mib, share):
    meta = make_state(mib)
    state = {}
    for k, t in meta.items():
        start, n = rows_of(rank, world, t.shape[0])
        state[k] = bcp.TensorShard(torch.zeros(n, t.shape[1]), tuple(t.shape), (start, 0))
    dist.barrier()
    t0 = time.perf_counter()
    info = bcp.load_with_info(state, uri, share_reads=share)
    return time.perf_counter() - t0, info.bytes_read


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp-bench")
    p.add_argument("--store", choices=("file", "rclone", "moto"), default="file")
    args = p.parse_args()
    if args.store == "file":
        run(args, os.path.join(args.dir, "ddp"), os.path.join(args.dir, "fsdp"))
        return
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from servers import make_bucket, running, test_environment

    os.environ.update(test_environment())  # the spawned ranks inherit the test credentials
    with running(args.store) as server:
        make_bucket(server, "bench")
        query = f"?endpoint_url={server.endpoint}" + ("&conditional_writes=false" if args.store == "rclone" else "")
        run(args, f"s3://bench/ddp{query}", f"s3://bench/fsdp{query}")


def run(args, ddp_uri: str, fsdp_uri: str) -> None:
    os.makedirs(args.dir, exist_ok=True)
    print(f"store: {args.store}")
    total = sum(t.numel() * 4 for t in make_state(args.mib).values())
    print(
        f"state: {total / 2**20:.0f} MiB of float32 in {len(make_state(args.mib))} tensors; medians of {args.repeats}"
    )

    rows = []
    res = [spawn(save_replicated, 4, ddp_uri, args.mib) for _ in range(args.repeats)]
    t = statistics.median(max(r[0] for r in run) for run in res)
    shares = [b / total for _t, b, _tb in res[-1]]
    rows.append(
        ("DDP save, 4 ranks (replicated)", t, total / t / 1e9, "bytes per rank " + " ".join(f"{s:.2f}" for s in shares))
    )
    res = [spawn(save_sharded, 2, fsdp_uri, args.mib) for _ in range(args.repeats)]
    t = statistics.median(max(r[0] for r in run) for run in res)
    rows.append(("row-sharded save, 2 ranks", t, total / t / 1e9, ""))
    for label, fn, uri in (
        ("replicated load 2->3 ranks (every rank all)", load_full, ddp_uri),
        ("row-sharded load 2->3 ranks (reshard)", load_sharded, fsdp_uri),
    ):
        for share in (False, True):
            res = [spawn(fn, 3, uri, args.mib, share) for _ in range(args.repeats)]
            t = statistics.median(max(r[0] for r in run) for run in res)
            read = sum(r[1] for r in res[-1])
            rows.append(
                (f"{label}, share_reads={share}", t, total / t / 1e9, f"storage bytes read {read / total:.2f}x state")
            )
    print(f"{'case':<60} {'s':>7} {'GB/s':>6}  notes")
    for name, t, gbps, note in rows:
        print(f"{name:<60} {t:>7.3f} {gbps:>6.2f}  {note}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
