"""The local tier (docs/tiers.md) against the copies it is made of, and recovery from
it against recovery from an object store, in one run.

4 gloo ranks on 2 simulated hosts (``BCP_HOST_ID`` host0: ranks 0-1, host1: ranks
2-3; each host's ``LocalTier.dir`` its own directory under /dev/shm). The state is
``--gib`` in total, each rank holding 1/4 of it: row shards (``bcp.TensorShard``) of
8 weight matrices and their AdamW moments (``exp_avg``, ``exp_avg_sq``), trained by a
real ``torch.optim.AdamW``. The persistent tier is S3: ``rclone serve s3`` behind
``tests/netproxy.py`` (``--latency-ms`` per round trip, ``--bandwidth-mbs`` per
connection), both started and stopped here, on 127.0.0.1.

Measured, medians of ``--repeats`` (interleaved):

1. what ``manager.save`` blocks (the local tier, no overlap) against a memcpy of the
   rank's share (``copy_`` into warm buffers of the same sizes, in the same process);
2. the whole local save with replication (``save`` + ``wait``) against a plain gloo
   ``isend``/``irecv`` of each rank's share with its peer on the other host;
3. after host1 is lost (its directory deleted), the recovery on 3 ranks (host0's two
   and a new host2): ``load_latest`` of a manager with the tier (from the local tier)
   and of a manager without it (the same step, drained to S3), each checked bit-exact;
4. the training stall per local save with ``overlap=optimizer``, in % of a step of
   ``--step-seconds``, twice: a step of matmuls on the CPU + ``opt.step()`` + a gradient
   all-reduce (what this CPU-only machine runs: the save's background work takes its CPU
   from training), and a **model of a device-bound step** (a GPU host, where the step's
   compute runs on the device and the host thread waits): a sleep of the matmuls'
   calibrated time + the real ``opt.step()`` + the all-reduce.

Times of collective operations are the slowest rank's. The last line is
``tier_bench: local <s> s, persistent <s> s, ratio <r>, exact <True|False>``.

    python bench/tier_bench.py [--gib 1] [--repeats 3] [--latency-ms 30] [--bandwidth-mbs 20]
    python bench/tier_bench.py --quick   # a small state (1/64 GiB unless --gib), one repetition: a smoke run
    python bench/tier_bench.py --shape transformer   # bench/shapes.py's Llama-shaped state instead

``--shape equal`` (the default) is the 8 weight matrices above; ``--shape transformer``
is bench/shapes.py's Llama-shaped model of ``--gib`` (embedding, q/k/v/o with biases,
gate/up/down, norms, lm_head): every parameter and both AdamW moments row-sharded
(dim 0) over the ranks, and each parameter's 0-dim AdamW ``step`` tensor saved as it
is (the same on every rank); recoveries check the steps too.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the ranks' fork server imports, besides bench/ranks.py's: the S3 client library (the
#: persistent tier) and what an optimizer's first step imports (torch._dynamo and sympy:
#: seconds of CPU in every rank otherwise, before any phase is timed)
RANK_PRELOAD = ("bcp.backends.s3", "torch._dynamo")
# ruff: noqa: E402 - so that the fork server can start before this script imports torch
if __name__ == "__main__":  # the fork server imports torch while this script does (below)
    import ranks

    ranks.start_fork_server(RANK_PRELOAD)

import torch
import torch.distributed as dist

import shapes  # bench/ is not a package
from memcpy_limit import VerifiedReads
from netproxy import proxied
from ranks import gloo_rank, run_ranks
from servers import free_port, make_bucket, running, test_environment

os.environ.update(test_environment())

import bcp
from bcp.backends import backend_for

TENSORS = 8
COLS = 1024
SAVE_WORLD, RANKS_PER_HOST = 4, 2
RECOVER_HOSTS = ("host0", "host0", "host2")  # host1 lost, a new host joins


def rows_per_rank(gib: float) -> int:
    """Rows of each weight on one of 4 ranks: weights + 2 moments, fp32, ``gib`` in total."""
    per_tensor = gib * 2**30 / 3 / TENSORS / 4
    return max(1, int(per_tensor // (COLS * SAVE_WORLD)))


def span(rank: int, world: int, rows: int) -> tuple[int, int]:
    return rank * rows // world, (rank + 1) * rows // world


def global_params(shape: str, gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every parameter of the state's model."""
    if shape == "transformer":
        return list(shapes.transformer_spec(gib).params())
    rows = rows_per_rank(gib) * SAVE_WORLD
    return [(f"w{i}", (rows, COLS)) for i in range(TENSORS)]


def local_shape(gshape: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    start, stop = span(rank, world, gshape[0])
    return (stop - start, *gshape[1:])


def state_of(
    params: list[tuple[str, tuple[int, ...]]],
    weights: list[torch.Tensor],
    moments: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    step: int,
    steps: list[torch.Tensor] | None = None,
) -> dict:
    """The saved state: this rank's rows (dim 0) of each weight and of its AdamW moments,
    and with ``steps`` each parameter's AdamW step tensor (the same on every rank)."""

    def shard(t: torch.Tensor, gshape: tuple[int, ...]) -> bcp.TensorShard:
        start = span(rank, world, gshape[0])[0]
        return bcp.TensorShard(t.detach(), tuple(gshape), (start,) + (0,) * (len(gshape) - 1))

    optim = {
        name: {"exp_avg": shard(m, gs), "exp_avg_sq": shard(v, gs)}
        for (name, gs), (m, v) in zip(params, moments, strict=True)
    }
    if steps is not None:
        for (name, _gs), t in zip(params, steps, strict=True):
            optim[name]["step"] = t
    return {
        "model": {name: shard(w, gs) for (name, gs), w in zip(params, weights, strict=True)},
        "optim": optim,
        "step": step,
    }


def steps_of(state: dict) -> list[torch.Tensor]:
    return [moments["step"] for moments in state["optim"].values() if "step" in moments]


def tensors_of(state: dict) -> list[torch.Tensor]:
    out = [s.local for s in state["model"].values()]
    for moments in state["optim"].values():
        out += [moments["exp_avg"].local, moments["exp_avg_sq"].local]
    return out


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def summed(seconds: float) -> float:
    """``seconds`` added up over the ranks (CPU time: steadier than the slowest rank's)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the saving job (4 ranks, 2 hosts) ----------------------------------------------------------------


def save_job(rank: int, world: int, cfg: dict) -> dict:
    host = rank // RANKS_PER_HOST
    os.environ["BCP_HOST_ID"] = f"host{host}"
    shapes_ = [tuple(gs) for _n, gs in cfg["params"]]
    g = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(local_shape(gs, rank, world), generator=g)) for gs in shapes_]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()  # the moments exist
    a = torch.randn(cfg["mat"], cfg["mat"], generator=g)
    grad_sync = torch.zeros(1 << 18)

    def train_step() -> None:
        for _ in range(cfg["matmuls"]):
            torch.mm(a, a)
        dist.all_reduce(grad_sync)  # ranks step together, as data-parallel training does
        opt.step()

    # calibrate the step's matmuls to --step-seconds, with every rank stepping at once
    cfg["matmuls"] = 0
    fixed = slowest(statistics.median(timed(train_step) for _ in range(3)))  # AdamW + all-reduce
    # a matmul timed alone: the difference of two noisy step timings could come out near
    # zero on a loaded machine and ask for hundreds of thousands of matmuls per step
    per = slowest(statistics.median(timed(lambda: [torch.mm(a, a) for _ in range(4)]) for _ in range(3))) / 4
    cfg["matmuls"] = max(1, round((cfg["step_seconds"] - fixed) / max(per, 1e-6)))

    tier = bcp.LocalTier(
        dir=os.path.join(cfg["base"], f"host{host}"), every=1, replicas=1, persist_every=cfg["drain_step"], keep=2
    )
    manager = bcp.CheckpointManager(cfg["root"], tier=tier)
    moments = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]
    steps = [opt.state[p]["step"] for p in params] if cfg["shape"] == "transformer" else None
    state = state_of(cfg["params"], params, moments, rank, world, 0, steps)
    share = tensors_of(state)
    share_bytes = sum(t.numel() * t.element_size() for t in share)
    buffers = [torch.empty_like(t) for t in share]
    for b, t in zip(buffers, share, strict=True):
        b.copy_(t)  # warm, touched
    peer = (rank + RANKS_PER_HOST) % world
    out_wire = torch.ones(share_bytes, dtype=torch.uint8)
    in_wire = torch.zeros(share_bytes, dtype=torch.uint8)

    def memcpy() -> None:
        for b, t in zip(buffers, share, strict=True):
            b.copy_(t)

    def exchange() -> None:
        works = [dist.isend(out_wire, peer), dist.irecv(in_wire, peer)]
        for w in works:
            w.wait()

    res: dict[str, Any] = {"share_bytes": share_bytes, "matmuls": cfg["matmuls"], "rows": []}
    step = 0
    # (1, 2) blocking and whole local saves, memcpy and gloo exchange, interleaved; the first save warms up
    for rep in range(cfg["repeats"] + 1):
        step += 1
        state["step"] = step
        dist.barrier()
        copy_s = timed(memcpy)
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(step, state)
        blocking = time.perf_counter() - t0
        manager.wait()
        total = time.perf_counter() - t0
        dist.barrier()
        wire = timed(exchange)
        row = [slowest(x) for x in (copy_s, blocking, total, wire)]
        if rep > 0:
            res["rows"].append(row)
        if rank == 0:
            tag = "warm-up" if rep == 0 else f"rep {rep}"
            print(
                f"  save {tag}: memcpy {row[0]:.3f} s, save blocks {row[1]:.3f} s, with replication "
                f"{row[2]:.3f} s, gloo exchange {row[3]:.3f} s",
                flush=True,
            )
        opt.step()  # the state changes between saves

    # (4) the stall per save with overlap=optimizer: cycles of k steps, plain and with a save first.
    # Twice: the step as it runs here (its matmuls on the host's CPU, which the save's background
    # work shares), and a model of a device-bound step (a GPU host): the host thread waits for the
    # step's compute (a sleep of the matmuls' calibrated time) and runs the real AdamW + all-reduce
    compute_s = cfg["matmuls"] * per

    def device_step() -> None:
        time.sleep(compute_s)  # the device computes forward/backward; the host thread waits
        dist.all_reduce(grad_sync)
        opt.step()

    manager.overlap = opt
    k = cfg["cycle"]
    for name, step_fn in (("cpu", train_step), ("device", device_step)):
        plain: list[float] = []
        stalls: list[float] = []
        leftover: list[float] = []
        for _rep in range(cfg["repeats"]):
            dist.barrier()
            for _ in range(k):
                plain.append(timed(step_fn))
            base = statistics.median(plain)
            step += 1
            state["step"] = step
            dist.barrier()
            t0 = time.perf_counter()
            manager.save(step, state)
            for _ in range(k):
                step_fn()
            cycle = time.perf_counter() - t0
            leftover.append(timed(manager.wait))  # still in flight after k steps (not counted as stall)
            stalls.append(cycle - k * base)
        res[f"{name}_step_s"] = slowest(statistics.median(plain))
        res[f"{name}_stall_s"] = slowest(statistics.median(stalls))
        res[f"{name}_leftover_s"] = slowest(statistics.median(leftover))
        if rank == 0:
            what = (
                f"{cfg['matmuls']} matmuls on the CPU + AdamW + all-reduce"
                if name == "cpu"
                else f"model of a device-bound step: host waits {compute_s:.3f} s + AdamW + all-reduce"
            )
            print(
                f"  overlap ({name}): step {res[f'{name}_step_s']:.3f} s ({what}), stall per save "
                f"{res[f'{name}_stall_s']:.3f} s, in flight after {k} steps {res[f'{name}_leftover_s']:.3f} s",
                flush=True,
            )

    # the drained step: saved locally and copied to S3
    manager.overlap = None
    step = cfg["drain_step"]
    state["step"] = step
    dist.barrier()
    t0 = time.perf_counter()
    manager.save(step, state)
    saved = {f"t{i}": t.clone() for i, t in enumerate(tensors_of(state))}
    saved["steps"] = torch.stack([t.clone() for t in steps_of(state)]) if steps is not None else torch.zeros(0)
    torch.save(saved, os.path.join(cfg["refs"], f"{rank}.pt"))
    manager.wait()
    res["drain_s"] = slowest(time.perf_counter() - t0)
    manager.close()
    if rank == 0:
        print(f"  step {step} saved and drained to S3 in {res['drain_s']:.1f} s", flush=True)
    return res


# -- the recovering job (3 ranks: host0's two and a new host) ---------------------------------------


def reference(cfg: dict, world_rank: int, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The saved values of this rank's rows at ``world`` ranks, from the saving ranks'
    copies (in ``tensors_of`` order), and the saved AdamW steps (empty for the equal shape)."""
    saved = [torch.load(os.path.join(cfg["refs"], f"{r}.pt"), mmap=True, weights_only=True) for r in range(SAVE_WORLD)]
    gshapes = [tuple(gs) for _n, gs in cfg["params"]]
    out = []
    order = gshapes + [gs for gs in gshapes for _moment in range(2)]  # tensors_of's: weights, then m, v each
    for i, gs in enumerate(order):
        start, stop = span(world_rank, world, gs[0])
        full = torch.cat([s[f"t{i}"] for s in saved])
        out.append(full[start:stop].clone())
    return out, saved[0]["steps"].clone()


def recover_job(rank: int, world: int, cfg: dict) -> dict:
    host = RECOVER_HOSTS[rank]
    os.environ["BCP_HOST_ID"] = host
    want, want_steps = reference(cfg, rank, world)
    tier = bcp.LocalTier(dir=os.path.join(cfg["base"], host), persist_every=None)
    with_tier = bcp.CheckpointManager(cfg["root"], async_save=False, tier=tier)
    without = bcp.CheckpointManager(cfg["root"], async_save=False)

    def template() -> dict:
        locals_ = [local_shape(tuple(gs), rank, world) for _n, gs in cfg["params"]]
        steps = [torch.tensor(-1.0) for _ in locals_] if cfg["shape"] == "transformer" else None
        weights = [torch.zeros(s) for s in locals_]
        moments = [(torch.zeros(s), torch.zeros(s)) for s in locals_]
        return state_of(cfg["params"], weights, moments, rank, world, -1, steps)

    # what the local recovery moved (bcp.tiers.recover logs it at INFO): printed for the last repetition
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("recovered step"):
                said.append(record.getMessage())

    logging.getLogger("bcp.tiers.recover").addHandler(Keep(logging.INFO))
    logging.getLogger("bcp.tiers.recover").setLevel(logging.INFO)
    times: dict[str, list[float]] = {"local": [], "persistent": []}
    exact = True
    for rep in range(cfg["repeats"]):
        for name, manager in (("local", with_tier), ("persistent", without)):
            target = template()
            dist.barrier()
            t0 = time.perf_counter()
            step, loaded = manager.load_latest(target)
            seconds = slowest(time.perf_counter() - t0)
            same = step == cfg["drain_step"] and loaded["step"] == cfg["drain_step"]
            same = same and all(torch.equal(g, w) for g, w in zip(tensors_of(loaded), want, strict=True))
            got_steps = steps_of(loaded)
            same = same and torch.equal(torch.stack(got_steps) if got_steps else torch.zeros(0), want_steps)
            flag = torch.tensor([0 if same else 1])
            dist.all_reduce(flag)
            ok = int(flag.item()) == 0
            exact = exact and ok
            times[name].append(seconds)
            if rank == 0:
                print(f"  recovery rep {rep + 1} from {name}: {seconds:.2f} s, step {step}, exact {ok}", flush=True)
            del loaded, target
    for r in range(world):
        if r == rank and said:
            print(f"  rank {rank} ({host}): {said[-1]}", flush=True)
        dist.barrier()
    with_tier.close()
    without.close()
    return {
        "local_s": statistics.median(times["local"]),
        "persistent_s": statistics.median(times["persistent"]),
        "exact": exact,
    }


# -- local-tier recovery against a page-cached file root (4 ranks, all present) ----------------------


def local_vs_file_job(rank: int, world: int, cfg: dict) -> dict:
    """One step saved to the local tier and drained to a file root; then, interleaved
    repeat by repeat (each first in every other repeat), ``load_latest`` of a manager
    with the tier (recovered from the local tier: every host holds its ranks' files,
    nothing to fetch) and of one without
    it (the same step from the file root, its pages in the page cache), on the same 4
    ranks into the same layout, each checked bit-exact; beside them, the limit: the bare
    verified read of each rank's own data files (``memcpy_limit.VerifiedReads``: ``preadv``
    of 2 MiB pieces into touched memory, CRC32C of each, on the threads a load from
    memory uses) from the local tier and from the file root, in the same order. Times are
    the slowest rank's, wall and CPU (``time.process_time``: this rank's threads), and CPU
    summed over the ranks; with ``cfg["profile"]`` (``--profile``)
    rank 0's cProfile of each counted load is written there."""
    host = f"host{rank // RANKS_PER_HOST}"
    os.environ["BCP_HOST_ID"] = host
    g = torch.Generator().manual_seed(100 + rank)
    locals_ = [local_shape(tuple(gs), rank, world) for _n, gs in cfg["params"]]
    weights = [torch.randn(s, generator=g) for s in locals_]
    moments = [(torch.randn(s, generator=g), torch.rand(s, generator=g)) for s in locals_]
    steps = [torch.tensor(float(i + 1)) for i in range(len(locals_))] if cfg["shape"] == "transformer" else None
    step = cfg["lvf_step"]
    state = state_of(cfg["params"], weights, moments, rank, world, step, steps)
    tier_dir = os.path.join(cfg["lvf_base"], host)
    saver = bcp.CheckpointManager(
        cfg["lvf_root"], tier=bcp.LocalTier(dir=tier_dir, every=1, replicas=1, persist_every=step, keep=2)
    )
    saver.save(step, state)
    saver.wait()  # saved locally, replicated to the other host, drained to the file root
    saver.close()
    want, want_steps = tensors_of(state), steps_of(state)
    del state, weights, moments
    with_tier = bcp.CheckpointManager(
        cfg["lvf_root"], async_save=False, tier=bcp.LocalTier(dir=tier_dir, persist_every=None)
    )
    from_file = bcp.CheckpointManager(cfg["lvf_root"], async_save=False)

    def template() -> dict:
        steps_ = [torch.tensor(-1.0) for _ in locals_] if steps is not None else None
        zeros = [torch.zeros(s) for s in locals_]
        return state_of(
            cfg["params"], zeros, [(torch.zeros(s), torch.zeros(s)) for s in locals_], rank, world, -1, steps_
        )

    # the limit beside them: the bare verified read of this rank's own data files (preadv of 2 MiB
    # pieces into touched memory, CRC32C of each piece while in cache, on the threads a load from
    # memory reads with), from the local step on /dev/shm and from the file root's page cache
    threads = min(backend_for(cfg["lvf_root"]).hints.concurrency, len(os.sched_getaffinity(0)))
    limits = {
        "vread_local": VerifiedReads(files=rank_files(tier_dir, rank), threads=threads),
        "vread_file": VerifiedReads(files=rank_files(cfg["lvf_root"], rank), threads=threads),
    }
    times: dict[str, list[tuple[float, float]]] = {"local": [], "file": [], "vread_local": [], "vread_file": []}
    cpu_sums: dict[str, list[float]] = {"local": [], "file": []}
    exact = True
    # rep 0 warms both up: the file root's pages are read into the page cache (not counted)
    for rep in range(cfg["repeats"] + 1):
        pair = [("local", with_tier), ("file", from_file)]
        for name, manager in pair if rep % 2 else pair[::-1]:  # each goes first in every other repeat
            target = template()
            dist.barrier()
            prof = cProfile.Profile() if cfg.get("profile") and rank == 0 and rep > 0 else None
            cpu0, t0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            got, loaded = manager.load_latest(target)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(cfg["profile"], f"{name}-{rep}.prof"))
            seconds, cpu_s, cpu_sum = slowest(wall), slowest(cpu), summed(cpu)
            same = got == step and loaded["step"] == step
            same = same and all(torch.equal(a, b) for a, b in zip(tensors_of(loaded), want, strict=True))
            same = same and all(torch.equal(a, b) for a, b in zip(steps_of(loaded), want_steps, strict=True))
            flag = torch.tensor([0 if same else 1])
            dist.all_reduce(flag)
            ok = int(flag.item()) == 0
            exact = exact and ok
            if rep > 0:
                times[name].append((seconds, cpu_s))
                cpu_sums[name].append(cpu_sum)
            if rank == 0:
                tag = "warm-up" if rep == 0 else f"rep {rep}"
                print(
                    f"  all ranks present, {tag}: {'local-tier recovery' if name == 'local' else 'file-root load'} "
                    f"{seconds:.3f} s ({cpu_s:.3f} CPU-s), exact {ok}",
                    flush=True,
                )
            del loaded, target
        # the limit beside them, each first in every other repeat (as the loads)
        reads = list(limits.items())
        for name, verified in reads if rep % 2 else reads[::-1]:
            dist.barrier()
            cpu0 = time.process_time()
            wall = verified()
            wall, cpu = slowest(wall), slowest(time.process_time() - cpu0)
            if rep > 0:
                times[name].append((wall, cpu))
        if rank == 0 and rep > 0:
            print(
                f"  verified read of the same files, rep {rep}: /dev/shm {times['vread_local'][-1][0]:.3f} s, "
                f"page cache {times['vread_file'][-1][0]:.3f} s",
                flush=True,
            )
    with_tier.close()
    from_file.close()
    share = sum(t.numel() * t.element_size() for t in want)
    return {
        "share_bytes": share,
        **{f"{name}_s": statistics.median(s for s, _c in rows) for name, rows in times.items()},
        **{f"{name}_cpu_s": statistics.median(c for _s, c in rows) for name, rows in times.items()},
        **{f"{name}_cpu_sum_s": statistics.median(sums) for name, sums in cpu_sums.items()},
        # file / local of each repeat's pair: steadier than the ratio of the medians on busy cores
        "pair_ratio": statistics.median(
            f[0] / lo[0] for lo, f in zip(times["local"], times["file"], strict=True) if lo[0] > 0
        ),
        "vread_pair_ratio": statistics.median(
            f[0] / lo[0] for lo, f in zip(times["vread_local"], times["vread_file"], strict=True) if lo[0] > 0
        ),
        "vread_bytes": limits["vread_local"].nbytes,
        "vread_threads": threads,
        "exact": exact,
    }


def rank_files(root: str, rank: int) -> list[str]:
    """The data files ``rank`` wrote under ``root`` (a local tier's directory or a file root)."""
    return sorted(glob.glob(os.path.join(root, "**", "data", f"rank{rank:05d}-*.bin"), recursive=True))


def local_vs_file_rows(res: dict) -> list[str]:
    """The table rows of :func:`local_vs_file_job`'s result and its summary line."""
    share = res["share_bytes"]
    ratio = res["file_s"] / res["local_s"]
    return [
        f"| recovery on 4 ranks (all present), local tier | {res['local_s']:.3f} | {share / res['local_s'] / 1e9:.2f} "
        f"| {res['local_cpu_s']:.3f} CPU-s ({res['local_cpu_sum_s']:.3f} summed over the ranks); {ratio:.2f}x the "
        f"file-root load's speed (median of each repeat's {res['pair_ratio']:.2f}x) |",
        f"| load of the same step from a page-cached file root, same 4 ranks | {res['file_s']:.3f} | "
        f"{share / res['file_s'] / 1e9:.2f} | {res['file_cpu_s']:.3f} CPU-s ({res['file_cpu_sum_s']:.3f} summed) |",
        *(
            f"| verified read of each rank's files from the {where}: `preadv` + CRC32C of each 2 MiB piece, "
            f"{res['vread_threads']} threads (the limit) | {res[f'{name}_s']:.3f} | "
            f"{res['vread_bytes'] / max(res[f'{name}_s'], 1e-9) / 1e9:.2f} | {res[f'{name}_cpu_s']:.3f} CPU-s{tail} |"
            for name, where, tail in (
                ("vread_local", "local tier (/dev/shm)", ""),
                (
                    "vread_file",
                    "file root (page cache)",
                    f"; the machine's ratio {limit_ratio(res):.2f}x (median of each repeat's "
                    f"{res['vread_pair_ratio']:.2f}x); recovery - load {res['local_cpu_s'] - res['file_cpu_s']:+.3f} "
                    f"CPU-s, of which the verified reads' difference "
                    f"{res['vread_local_cpu_s'] - res['vread_file_cpu_s']:+.3f}",
                ),
            )
        ),
    ]


def limit_ratio(res: dict) -> float:
    """The machine's own ratio: the verified read from the file root's page cache over the
    same read from /dev/shm (seconds); above 1, /dev/shm is the faster place to read from."""
    return res["vread_file_s"] / max(res["vread_local_s"], 1e-9)


def local_vs_file_line(res: dict) -> str:
    ratio = res["file_s"] / res["local_s"]
    return (
        f"tier_bench local-vs-file: local {res['local_s']:.3f} s ({res['local_cpu_s']:.3f} CPU-s), file "
        f"{res['file_s']:.3f} s ({res['file_cpu_s']:.3f} CPU-s), ratio {ratio:.2f}, exact {res['exact']}"
    )


def local_vs_file_limit_line(res: dict) -> str:
    """bcp's ratio beside the machine's (the verified reads'): the target (recovery faster,
    a ratio above 1) is out of this machine's reach where the machine's own ratio is below 1."""
    ratio, machine = res["file_s"] / res["local_s"], limit_ratio(res)
    # the file-root load with only its bytes' cost changed to /dev/shm's: what a recovery that
    # does nothing beyond the load would reach
    swapped = res["file_s"] / max(res["file_s"] + res["vread_local_s"] - res["vread_file_s"], 1e-9)
    return (
        f"tier_bench local-vs-file limit: verified read /dev/shm {res['vread_local_s']:.4f} s, page cache "
        f"{res['vread_file_s']:.4f} s, the machine's ratio {machine:.2f} (bcp's {ratio:.2f}, "
        f"{ratio / max(machine, 1e-9):.2f}x the machine's; the file-root load with its reads' time from /dev/shm "
        f"instead: {swapped:.2f}); a recovery faster than the file-root load "
        f"{'is within' if machine > 1 else 'is beyond'} this machine's reach"
    )


# -- processes ---------------------------------------------------------------------------------------


def _entry(job: str, rank: int, world: int, port: int, cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BCP_COLLECTIVE_TIMEOUT="900")
    torch.set_num_threads(1)
    jobs = {"save": save_job, "recover": recover_job, "local-vs-file": local_vs_file_job}
    gloo_rank(rank, world, cfg["out"], lambda: jobs[job](rank, world, cfg))


def run(job: str, world: int, cfg: dict, timeout: float) -> dict:
    port = free_port()
    run_ranks(
        _entry,
        lambda r: (job, r, world, port, cfg),
        world,
        timeout,
        f"tier_bench: the {job} job",
        preload=RANK_PRELOAD,
    )
    return json.loads(Path(cfg["out"]).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--gib", type=float, default=None, help="the whole state (weights + AdamW moments), GiB (1; 1/64 with --quick)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=30.0, help="round trip the proxy adds to S3")
    p.add_argument("--bandwidth-mbs", type=float, default=20.0, help="MB/s per S3 connection and direction")
    p.add_argument("--step-seconds", type=float, default=0.7, help="a training step's compute (calibrated)")
    p.add_argument("--cycle", type=int, default=4, help="training steps between two local saves (overlap)")
    p.add_argument("--shape", choices=("equal", "transformer"), default="equal", help="the state (see above)")
    p.add_argument("--quick", action="store_true", help="a small state, one repetition, short steps: a smoke run")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each job may take")
    p.add_argument(
        "--only",
        choices=("all", "local-vs-file"),
        default="all",
        help="local-vs-file: only the local-tier recovery beside a load from a page-cached file root (no S3)",
    )
    p.add_argument(
        "--profile", default=None, help="a directory: rank 0's cProfile of each counted local-vs-file load goes there"
    )
    p.add_argument("--dir", default=None, help="where the file root goes (default: a temporary directory on disk)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.step_seconds, args.cycle = 1, 0.1, 2
    if args.gib is None:  # an explicit --gib wins over --quick's (the tests' smoke run is smaller still)
        args.gib = 1 / 64 if args.quick else 1.0
    params = global_params(args.shape, args.gib)
    total = sum(math.prod(gs) for _n, gs in params) * 4 * 3 + (4 * len(params) if args.shape == "transformer" else 0)
    work = Path(tempfile.mkdtemp(prefix="bcp-tierbench-", dir=args.dir))
    base = tempfile.mkdtemp(prefix="bcp-tierbench-", dir="/dev/shm")
    (work / "refs").mkdir()
    print(
        f"state ({args.shape}: {len(params)} parameters) {total / 2**30:.3f} GiB on 4 ranks / 2 hosts "
        f"({total / 4 / 2**20:.0f} MiB per rank: weights + AdamW "
        f"moments); local tier under {base}; "
        + (
            ""
            if args.only == "local-vs-file"
            else f"S3 = rclone through a proxy adding {args.latency_ms:g} ms, "
            f"{args.bandwidth_mbs:g} MB/s per connection; "
        )
        + f"file root under {work}; medians of {args.repeats}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    cfg: dict[str, Any] = {
        "params": params,
        "shape": args.shape,
        "repeats": args.repeats,
        "lvf_base": os.path.join(base, "local-vs-file"),
        "lvf_root": str(work / "file-root"),
        "lvf_step": 1,
        "out": str(work / "local-vs-file.json"),
        "profile": args.profile,
    }
    try:
        lvf = run("local-vs-file", SAVE_WORLD, cfg, args.timeout)
        shutil.rmtree(cfg["lvf_base"], ignore_errors=True)
        shutil.rmtree(cfg["lvf_root"], ignore_errors=True)
        if args.only == "local-vs-file":
            print()
            print(f"| measure ({lvf['share_bytes'] / 2**20:.0f} MiB per rank) | seconds | GB/s per rank | vs |")
            print("|---|---:|---:|---|")
            for row in local_vs_file_rows(lvf):
                print(row)
            print(local_vs_file_limit_line(lvf))
            print(local_vs_file_line(lvf))
            return
        with (
            running("rclone") as server,
            proxied(server.endpoint, latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbs * 1e6) as endpoint,
        ):
            bucket = f"tier{uuid.uuid4().hex[:8]}"
            make_bucket(server, bucket)
            cfg.update(
                {
                    "base": base,
                    "refs": str(work / "refs"),
                    "root": f"s3://{bucket}/job?endpoint_url={endpoint}&conditional_writes=false",
                    "step_seconds": args.step_seconds,
                    "cycle": args.cycle,
                    "mat": 256 if args.quick else 512,
                    "matmuls": 1,
                    "drain_step": args.repeats + 1 + 2 * args.repeats + 1,
                    "out": str(work / "save.json"),
                }
            )
            saved = run("save", SAVE_WORLD, cfg, args.timeout)
            shutil.rmtree(os.path.join(base, "host1"))  # host1 is lost
            cfg["out"] = str(work / "recover.json")
            rec = run("recover", len(RECOVER_HOSTS), cfg, args.timeout)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    share = saved["share_bytes"]
    med = [statistics.median(r[i] for r in saved["rows"]) for i in range(4)]
    copy_s, block_s, total_s, wire_s = med
    print()
    print(f"| measure (4 ranks, 2 hosts; {share / 2**20:.0f} MiB per rank) | seconds | GB/s per rank | vs |")
    print("|---|---:|---:|---|")
    print(f"| memcpy of the rank's share (warm buffers) | {copy_s:.3f} | {share / copy_s / 1e9:.2f} | |")
    print(
        f"| local save: manager.save blocks | {block_s:.3f} | {share / block_s / 1e9:.2f} | "
        f"{block_s / copy_s:.2f}x memcpy |"
    )
    print(f"| gloo isend/irecv of the share with the other host | {wire_s:.3f} | {share / wire_s / 1e9:.2f} | |")
    print(
        f"| local save with replication (save + wait) | {total_s:.3f} | {share / total_s / 1e9:.2f} | "
        f"{total_s / wire_s:.2f}x gloo exchange |"
    )
    print(f"| drained step (local save + upload of {total / 2**30:.2f} GiB to S3) | {saved['drain_s']:.2f} | | |")
    stall_pct = {}
    for name, label in (("cpu", "CPU-bound step (this machine)"), ("device", "model of a device-bound step")):
        stall_pct[name] = 100 * max(saved[f"{name}_stall_s"], 0.0) / saved[f"{name}_step_s"]
        print(
            f"| overlap=optimizer: stall per local save, {label} | {saved[f'{name}_stall_s']:.3f} | | "
            f"{stall_pct[name]:.1f}% of a {saved[f'{name}_step_s']:.3f} s step |"
        )
    for row in local_vs_file_rows(lvf):
        print(row)
    print(f"| recovery on 3 ranks (host1 lost), local tier | {rec['local_s']:.2f} | | |")
    print(
        f"| recovery on 3 ranks, persistent tier (S3) | {rec['persistent_s']:.2f} | | "
        f"{rec['persistent_s'] / rec['local_s']:.1f}x local |"
    )
    print(
        f"targets: save blocks <= 1.2x memcpy: {block_s / copy_s <= 1.2}; stall <= 5%: CPU-bound step "
        f"{stall_pct['cpu'] <= 5}, device-bound model {stall_pct['device'] <= 5}; "
        f"persistent/local >= 5: {rec['persistent_s'] / rec['local_s'] >= 5}; local recovery faster than a "
        f"page-cached file-root load: {lvf['local_s'] < lvf['file_s']}"
    )
    print(local_vs_file_limit_line(lvf))
    print(local_vs_file_line(lvf))
    ratio = rec["persistent_s"] / rec["local_s"]
    print(
        f"tier_bench: local {rec['local_s']:.2f} s, persistent {rec['persistent_s']:.2f} s, ratio {ratio:.1f}, "
        f"exact {rec['exact']}"
    )


if __name__ == "__main__":
    main()
