"""One rank's load planning and the coordinator's share_reads planning at scale
(simulated ranks, no processes, no I/O), beside PyTorch DCP's load planner.

Layout (as bench/plan_scale.py): 2,000 bf16 tensors of random shape (1,024-8,192 rows x
1,024 or 4,096 columns), each sharded on dim 0 over R saving ranks as torch.chunk
splits: R x T fragments. The catalog is built directly as an Arrow table of those rows
(Catalog.from_table; not timed) in writer order, one data file per writer.

What is timed, CPU seconds of one process, each case in a fresh subprocess:

* ``plan``: one loading rank (the middle one of M loading ranks, M = R: same layout,
  M < R: resharded) plans its reads: for every tensor, look the tensor up in the
  catalog (the entry's columns are built on first use, with the tiling check),
  check the shape, and ``plan_tensor_reads`` of its dim-0 chunk. ``old``: the
  planner before the columnar catalog (every fragment of the tensor as a Fragment,
  intersected in Python; kept here as the reference). ``dcp``: DCP's
  DefaultLoadPlanner core for a DTensor shard,
  ``planner_helpers.create_read_items_for_chunk_list`` with the rank's chunk against
  the saved ChunkStorageMetadata list of each tensor (building DCP's Metadata is not
  timed, as building bcp's catalog is not). ``partial``: the same with the catalog
  as a loading rank of a large job holds it (catalog v2): from the head alone,
  ``Catalog.from_head`` + ``require`` of the rank's boxes (reading and checking only
  the sections they need, from memory here) are timed too.
* ``share``: share_reads planning on the coordinator for M loading ranks, each wanting
  its dim-0 chunk of every tensor (``plan_shares`` + ``parts``); ``--share-dp 2``
  lets pairs of ranks want the same chunk (every fragment then shared), ``--share-scalars K``
  adds K 0-d tensors every rank wants (AdamW's step counters, stored once). ``old``: every
  rank computing the plan over every rank's list (the previous algorithm, one rank's
  cost; quadratic, so only for small R).

Peak RSS: the child's peak resident memory; "extra" is its growth during the timed
part (peak reset just before it, /proc/self/clear_refs). "entries/parts", for ``plan`` rows,
is the part of the CPU seconds spent building the catalog's per-tensor entries
(TensorEntry columns, with the catalog's whole-tensor tiling check) that the planner
then reads; for ``share`` rows it is the part spent in ``SharePlan.parts`` (the plan
itself gathers only the stored boxes, ``Catalog.boxes``, and counts them in the rest).
``share`` rows end with the user and system CPU seconds apart: the system share (the
kernel faulting in and compacting memory for new large arrays) swings run to run on a
shared host, the user share is the plan's own work.

    python bench/load_plan_scale.py                  # 256 and 1,024 ranks
    python bench/load_plan_scale.py --ranks 256 --old
    python bench/load_plan_scale.py --ranks 1024,4096 --only share --share-dp 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import types
from typing import Any

import numpy as np
import pyarrow as pa

from bcp.io_scheduler.read_plan import plan_tensor_reads
from bcp.metadata import CATALOG_SCHEMA, Catalog
from bcp.metadata.catalog import TRAILER_BYTES
from bcp.metadata.geometry import common_runs, intersect
from bcp.metadata.keys import data_file_key, generation_name
from bcp.shared_read import Wanted, plan_shares


def chunk_bounds(rows: int, ranks: int) -> list[tuple[int, int]]:
    size = -(-rows // ranks)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(ranks)]


def layout(tensors: int, seed: int = 0) -> tuple[list[str], list[tuple[int, int]]]:
    rng = random.Random(seed)
    shapes = [(rng.randint(1024, 8192), rng.choice([1024, 4096])) for _ in range(tensors)]
    return [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)], shapes


def catalog(ranks: int, tensors: int, scalars: int = 0) -> tuple[Catalog, list[str], list[tuple[int, int]]]:
    """The FSDP catalog: rows grouped by writer, each writer's tensors in save order;
    then ``scalars`` 0-d tensors (an optimizer's step counters) in rank 0's file."""
    names, shapes = layout(tensors)
    rows_of = np.array([s[0] for s in shapes], np.int64)
    cols_of = np.array([s[1] for s in shapes], np.int64)
    size = -(-rows_of // ranks)  # per tensor
    r = np.repeat(np.arange(ranks, dtype=np.int64), tensors)
    t = np.tile(np.arange(tensors, dtype=np.int64), ranks)
    start = np.minimum(r * size[t], rows_of[t])
    count = np.clip(rows_of[t] - r * size[t], 0, size[t])
    nbytes = count * cols_of[t] * 2
    byte_offset = np.zeros_like(nbytes)
    per_writer = nbytes.reshape(ranks, tensors)
    byte_offset = (np.cumsum(per_writer, axis=1) - per_writer).reshape(-1)
    blocks = -(-nbytes // (64 << 10))
    n = len(r)

    def pairs(a: np.ndarray, b: np.ndarray) -> pa.ListArray:  # then an empty list a scalar
        starts = np.r_[np.arange(0, 2 * n + 1, 2), np.full(scalars, 2 * n)].astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(starts), pa.array(np.stack([a, b], 1).reshape(-1)))

    if scalars:  # rank 0 writes them after its own rows: the tables' columns take them last
        names = [*names, *(f"optim.state.{i}.step" for i in range(scalars))]
        first = int(per_writer[0].sum()) if tensors else 0
        t = np.r_[t, np.arange(tensors, tensors + scalars)]
        r = np.r_[r, np.zeros(scalars, np.int64)]
        byte_offset = np.r_[byte_offset, first + 2 * np.arange(scalars)]
        nbytes = np.r_[nbytes, np.full(scalars, 2)]
        blocks = np.r_[blocks, np.ones(scalars, np.int64)]

    gen = generation_name("bench")
    files = [data_file_key(gen, w) for w in range(ranks)]
    sums = pa.ListArray.from_arrays(
        pa.array(np.r_[0, np.cumsum(blocks)].astype(np.int64)),
        pa.array(np.full(int(blocks.sum()), 123456789, np.uint32)),
    )
    paths = [f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]' for i in range(tensors)]
    paths += [f'[["d","optim"],["d","state"],["i",{i}],["d","step"]]' for i in range(scalars)]
    table = pa.table(
        {
            "fqn": pa.DictionaryArray.from_arrays(pa.array(t.astype(np.int32)), pa.array(names)),
            "key_path": pa.DictionaryArray.from_arrays(pa.array(t.astype(np.int32)), pa.array(paths)),
            "dtype": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n + scalars, np.int32)), pa.array(["bfloat16"])),
            "global_shape": pairs(rows_of[t[:n]], cols_of[t[:n]]),
            "offsets": pairs(start, np.zeros(n, np.int64)),
            "lengths": pairs(count, cols_of[t[:n]]),
            "file": pa.DictionaryArray.from_arrays(pa.array(r.astype(np.int32)), pa.array(files)),
            "byte_offset": pa.array(byte_offset),
            "nbytes": pa.array(nbytes),
            "checksums": sums,
            "writer_rank": pa.array(r.astype(np.int32)),
        }
    )
    assert table.column_names == CATALOG_SCHEMA.names
    return Catalog.from_table(table, where="bench"), names, shapes


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the planners ------------------------------------------------------------------------


def old_plan(entry: Any, box: Any, prefer_rank: int) -> list:
    """read_plan before the columnar catalog: every fragment a Fragment, in Python."""
    by_box: dict = {}
    for f in entry.fragments:
        by_box.setdefault((f.offsets, f.lengths), []).append(f)
    fragments = [frags[prefer_rank % len(frags)] for frags in by_box.values()]
    d_off, d_len = box
    plans, covered = [], 0
    for frag in fragments:
        region = intersect(d_off, d_len, frag.offsets, frag.lengths)
        if region is None:
            continue
        covered += math.prod(region[1])
        plans.append((frag, common_runs(*region, frag.offsets, frag.lengths, d_off, d_len)))
    assert covered == math.prod(d_len)
    return plans


def run_plan(impl: str, ranks: int, load: int, tensors: int) -> dict:
    cat, names, shapes = catalog(ranks, tensors)
    me = load // 2
    boxes = []
    for rows, cols in shapes:
        start, count = chunk_bounds(rows, load)[me]
        boxes.append(((start, 0), (count, cols)))
    if impl == "dcp":
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        mds = {}
        for i, (rows, cols) in enumerate(shapes):
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size((s, 0)), sizes=torch.Size((c, cols)))
                for s, c in chunk_bounds(rows, ranks)
            ]
            mds[names[i]] = TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), torch.Size((rows, cols)), chunks
            )
        local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes]
    if impl == "partial":  # the rank holds the v2 catalog's head only, and reads its sections
        data = cat.to_arrow()
        head_len = Catalog.tail_bytes(len(data), data[-TRAILER_BYTES:])
        del cat
    base = rss_now()
    exact = reset_peak()
    t0 = time.process_time()
    items = 0
    if impl == "partial":
        cat = Catalog.from_head(
            data[len(data) - head_len :],
            file_size=len(data),
            fetch=lambda offset, length: data[offset : offset + length],
            where="bench",
            checksum_block_bytes=64 << 10,
        )
        cat.require([(fqn, boxes[i]) for i, fqn in enumerate(names)])
        impl = "bcp"
    if impl == "dcp":
        t1 = t0
        for i, fqn in enumerate(names):
            items += len(create_read_items_for_chunk_list(fqn, mds[fqn], [local[i]]))
    else:
        entries = []
        for i, fqn in enumerate(names):
            entries.append(cat.tensors[fqn])  # match: look the tensor up, check its shape
            assert entries[-1].global_shape == shapes[i]
        t1 = time.process_time()
        for i, entry in enumerate(entries):
            if impl == "bcp":
                items += len(plan_tensor_reads(entry, [boxes[i]], prefer_rank=me))
            else:
                items += len(old_plan(entry, boxes[i], me))
    t2 = time.process_time()
    peak = peak_rss()
    extra = (peak - base) / 1e9 if exact else float("nan")
    return {"seconds": t2 - t0, "match": t1 - t0, "items": items, "extra_gb": extra, "peak_gb": peak / 1e9}


def old_share_one_rank(cat: Catalog, wanted_by_rank: list[list[tuple[str, Any]]]) -> int:
    """The previous plan_sharing: what every rank computed (its needers pass)."""
    needers: dict = {}
    for rank, wanted in enumerate(wanted_by_rank):
        for fqn, (b_off, b_len) in wanted:
            for frag in cat.tensors[fqn].fragments:
                region = intersect(b_off, b_len, frag.offsets, frag.lengths)
                if region is not None:
                    needers.setdefault((fqn, frag.offsets), []).append(rank)
    return sum(len(v) > 1 for v in needers.values())


def run_share(impl: str, ranks: int, load: int, tensors: int, dp: int, scalars: int = 0) -> dict:
    assert impl == "bcp" or not scalars, "the old plan is timed without scalars"
    cat, names, shapes = catalog(ranks, tensors, scalars)
    groups = load // dp
    bounds = [chunk_bounds(rows, groups) for rows, _c in shapes]
    wanted = []
    for m in range(load):
        g = m // dp
        offs = np.array([[b[g][0], 0] for b in bounds], np.int64).reshape(-1)
        lens = np.array([[b[g][1], s[1]] for b, s in zip(bounds, shapes, strict=True)], np.int64).reshape(-1)
        wanted.append(Wanted(np.arange(tensors + scalars, dtype=np.int32), offs, lens))  # a scalar: no values
    if impl == "old":
        lists = [
            [(names[i], ((b[m // dp][0], 0), (b[m // dp][1], shapes[i][1]))) for i, b in enumerate(bounds)]
            for m in range(load)
        ]
    reader: Any = types.SimpleNamespace(catalog=cat)
    base = rss_now()
    exact = reset_peak()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.process_time()
    if impl == "bcp":
        plan = plan_shares(reader, wanted)  # gathers the used tensors' stored boxes (Catalog.boxes)
        t1 = time.process_time()
        parts = plan.parts(load)
        shared = len(plan.owners)
        # every (fragment, needing rank) pair in exactly one part, counted without
        # expanding the needers (plan.needers: 0.14 GB at 4,096 ranks, dp 2, that the
        # coordinator never builds)
        sizes = np.bincount(plan.rank_class).astype(np.int64)
        needers = int(np.bincount(plan.pair_classes, minlength=len(sizes)).astype(np.int64) @ sizes)
        assert sum(len(p.tags) for p in parts) == needers
    else:
        cat.entries(names)
        t1 = time.process_time()
        shared = old_share_one_rank(cat, lists)
    t2 = time.process_time()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = peak_rss()
    extra = (peak - base) / 1e9 if exact else float("nan")
    # user and system CPU apart: the kernel's share swings run to run (first touches of
    # large arrays, huge-page compaction), bcp's own work is the user share
    user, system = u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime
    return {
        "seconds": t2 - t0,
        "match": t2 - t1,
        "shared": shared,
        "extra_gb": extra,
        "peak_gb": peak / 1e9,
        "user": user,
        "system": system,
    }


# -- driver ------------------------------------------------------------------------------


def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="256,1024")
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=2, help="runs of bcp and DCP each, interleaved (medians)")
    p.add_argument("--old", action="store_true", help="also the previous planners (slow: 20+ s at 1,024 ranks)")
    p.add_argument("--share-old-up-to", type=int, default=0, help="largest rank count for the old share_reads plan")
    p.add_argument("--share-dp", type=int, default=1, help="ranks wanting each chunk in the share case")
    p.add_argument(
        "--share-scalars", type=int, default=0, help="0-d tensors (step counters) every rank wants, in the share case"
    )
    p.add_argument("--only", choices=["plan", "share"], help="run one kind of case")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, impl, ranks, load, tensors, dp, *scalars = a.child
        if kind == "plan":
            result = run_plan(impl, int(ranks), int(load), int(tensors))
        else:
            result = run_share(impl, int(ranks), int(load), int(tensors), int(dp), int(scalars[0]) if scalars else 0)
        print(json.dumps(result))
        return
    print(f"{'case':<34} {'impl':<5} {'CPU s':>8} {'entries/parts':>13} {'extra GB':>9} {'peak GB':>8} {'items':>9}")
    for ranks in [int(x) for x in a.ranks.split(",")]:
        loads = [ranks, ranks * 3 // 4]
        for load in loads if a.only != "share" else []:
            case = f"plan {ranks} -> {load} x {a.tensors}"
            runs: dict[str, list[dict]] = {"bcp": [], "dcp": []}
            for _ in range(a.repeat):
                for impl in ("bcp", "dcp"):
                    runs[impl].append(child(["plan", impl, str(ranks), str(load), str(a.tensors), "1"]))
            runs["partial"] = [child(["plan", "partial", str(ranks), str(load), str(a.tensors), "1"])]
            if a.old:
                runs["old"] = [child(["plan", "old", str(ranks), str(load), str(a.tensors), "1"])]
            for impl, rs in runs.items():
                sec = statistics.median(r["seconds"] for r in rs)
                match = statistics.median(r["match"] for r in rs)
                extra = statistics.median(r["extra_gb"] for r in rs)
                peak = statistics.median(r["peak_gb"] for r in rs)
                row = f"{sec:>8.3f} {match:>13.3f} {extra:>9.3f} {peak:>8.2f} {rs[0]['items']:>9}"
                print(f"{case:<34} {impl:<5} {row}", flush=True)
        for load in loads if a.only != "plan" else []:
            scalars = f" + {a.share_scalars} 0-d" if a.share_scalars else ""
            case = f"share {ranks} -> {load} x {a.tensors}{scalars} dp{a.share_dp}"
            impls = ["bcp", *(["old"] if ranks <= a.share_old_up_to and not a.share_scalars else [])]
            for impl in impls:
                rs = [
                    child(["share", impl, str(ranks), str(load), str(a.tensors), str(a.share_dp), str(a.share_scalars)])
                    for _ in range(a.repeat if impl == "bcp" else 1)
                ]
                sec = statistics.median(r["seconds"] for r in rs)
                match = statistics.median(r["match"] for r in rs)
                extra = statistics.median(r["extra_gb"] for r in rs)
                peak = statistics.median(r["peak_gb"] for r in rs)
                row = f"{sec:>8.3f} {match:>13.3f} {extra:>9.3f} {peak:>8.2f} {rs[0]['shared']:>9}"
                user = statistics.median(r["user"] for r in rs)
                system = statistics.median(r["system"] for r in rs)
                print(f"{case:<34} {impl:<5} {row}  (user {user:.3f} s, system {system:.3f} s)", flush=True)


if __name__ == "__main__":
    main()
