"""Coordinator save planning at scale: bcp's plan_save beside PyTorch DCP's planner.

Simulated ranks, no processes. FSDP layout: every tensor (bfloat16, 1k-8k rows x 1k
or 4k columns) sharded along dim 0 over all ranks as torch.chunk splits (trailing
ranks may hold the same empty shard), so boxes = ranks x tensors. Also one 8,192 x
8,192 tensor in 4,096 boxes cut along dim 1 or on a 64 x 64 mesh (2-D).

Each case runs in its own child process, bcp and DCP interleaved (bcp, DCP, bcp,
DCP, ...), and the table shows medians. Timed, in CPU seconds of the child:
  bcp: plan_save(layouts), the coordinator's whole planning (validation, tiling,
       deduplication, balancing, each rank's write list) from every rank's
       LocalLayout (what the ranks send).
  DCP: DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans) on one
       SavePlan per rank of WriteItems (SHARD, ChunkStorageMetadata) for the same
       boxes: DCP's coordinator (dedup, global plan + Metadata, overlap validation).
Peak RSS is the child's ru_maxrss (inputs included); "input" is the RSS once the
inputs are built, before planning. DCP is skipped past --dcp-up-to boxes (printed
with an estimate from the largest measured size, time ~ boxes^1.67 as measured).

"unchanged layout" rows: what a second save with the same layout costs (the plan
cache keys the plan by every rank's LocalLayout.digest()): each rank's digest of
its own layout (median per rank) and the coordinator's lookup of the tuple of
digests, beside planning from scratch.

    python bench/plan_scale.py                       # 256 and 1,024 ranks x 2,000, single tensors
    python bench/plan_scale.py --ranks 256,1024,4096,16384 --tensors 2000,4000 --dcp-up-to 2100000
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from bcp.planning import LayoutMeta, LocalLayout, plan_save
from bcp.planning.local_layout import meta_digest

DCP_EXPONENT = 1.67  # DCP's planning time grows as boxes^1.67 (256 -> 1,024 ranks x 2,000)


def shapes(tensors: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1024, 8192), rng.choice([1024, 4096])) for _ in range(tensors)]


def names(tensors: int) -> list[str]:
    return [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)]


def fsdp_layouts(ranks: int, tensors: int) -> list[LocalLayout]:
    """Every rank's layout, sharing one meta bytes object (as the coordinator keeps
    one per digest)."""
    dims = shapes(tensors)
    fq = names(tensors)
    paths = [f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]' for i in range(tensors)]
    meta = LayoutMeta(tuple(fq), tuple(paths), ("bfloat16",) * tensors, tuple(dims), (None,) * tensors).encode()
    digest = meta_digest(meta)
    rows = np.array([s[0] for s in dims], dtype=np.int64)
    cols = np.array([s[1] for s in dims], dtype=np.int32)
    size = -(-rows // ranks)
    counts = np.ones(tensors, dtype=np.int32)
    out = []
    for r in range(ranks):
        offs = np.zeros((tensors, 2), dtype=np.int32)
        lens = np.empty((tensors, 2), dtype=np.int32)
        offs[:, 0] = np.minimum(r * size, rows)
        lens[:, 0] = np.maximum(0, np.minimum(size, rows - r * size))
        lens[:, 1] = cols
        out.append(LocalLayout(r, meta, digest, counts, offs.reshape(-1), lens.reshape(-1)))
    return out


def single_layouts(kind: str) -> list[LocalLayout]:
    """One 8,192 x 8,192 bf16 tensor in 4,096 boxes: along dim 1, or a 64 x 64 mesh."""
    n, world = 8192, 4096
    meta = LayoutMeta(("w",), ('[["d","w"]]',), ("bfloat16",), ((n, n),), (None,)).encode()
    digest = meta_digest(meta)
    counts = np.ones(1, dtype=np.int32)
    out = []
    for r in range(world):
        if kind == "dim1":
            off, lens = (0, r * 2), (n, 2)
        else:
            off, lens = ((r // 64) * 128, (r % 64) * 128), (128, 128)
        out.append(LocalLayout(r, meta, digest, counts, np.array(off, np.int32), np.array(lens, np.int32)))
    return out


def layouts_for(case: str) -> list[LocalLayout]:
    kind, ranks, tensors = case.split(":")
    return fsdp_layouts(int(ranks), int(tensors)) if kind == "fsdp" else single_layouts(kind)


def dcp_plans(layouts: list[LocalLayout]) -> list:
    """One DCP SavePlan per rank: a SHARD WriteItem per box, as DCP's planner builds for DTensors."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    meta = LayoutMeta.decode(layouts[0].meta)
    sizes = [torch.Size(s) for s in meta.shapes]
    props = TensorProperties(dtype=torch.bfloat16)
    plans = []
    for layout in layouts:
        items = []
        nd = 0
        offs, lens = layout.offsets.tolist(), layout.lengths.tolist()
        for fqn, size in zip(meta.fqns, sizes, strict=True):
            k = len(size)
            off = torch.Size(offs[nd : nd + k])
            chunk = ChunkStorageMetadata(offsets=off, sizes=torch.Size(lens[nd : nd + k]))
            nd += k
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
                )
            )
        plans.append(SavePlan(items))
    return plans


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def child(case: str, impl: str) -> dict:
    """Run one case in this process; returns the measurements."""
    import gc

    layouts = layouts_for(case)
    boxes = sum(len(lay.counts) for lay in layouts)
    if impl == "dcp":
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        plans = dcp_plans(layouts)
        del layouts
        gc.collect()
        before = rss_gb()
        t0 = time.process_time()
        DefaultSavePlanner(flatten_state_dict=False).create_global_plan(plans)
        return {"s": time.process_time() - t0, "rss": rss_gb(), "input": before, "boxes": boxes}
    gc.collect()
    before = rss_gb()
    if impl == "bcp":
        t0 = time.process_time()
        plan = plan_save(layouts)
        spent = time.process_time() - t0
        return {"s": spent, "rss": rss_gb(), "input": before, "boxes": boxes, "writes": plan.total_bytes}
    # impl == "cached": every rank digests its own layout; the coordinator looks the tuple up
    per_rank = []
    digests = []
    for layout in layouts[:: max(1, len(layouts) // 256)]:
        t0 = time.process_time()
        digests.append(layout.digest())
        per_rank.append(time.process_time() - t0)
    key = tuple(lay.digest() for lay in layouts)
    cache = {key: "plan"}
    probe = tuple(bytes(d) for d in key)  # received over the wire: equal, not identical
    t0 = time.process_time()
    hit = cache.get(probe)
    lookup = time.process_time() - t0
    assert hit == "plan"
    return {"s": statistics.median(per_rank) + lookup, "rank": statistics.median(per_rank), "lookup": lookup}


def run_child(case: str, impl: str, timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--child", case, "--impl", impl]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{case} {impl} failed:\n{e.stderr}") from None
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="256,1024")
    p.add_argument("--tensors", default="2000")
    p.add_argument("--repeat", type=int, default=3, help="runs of each case (medians)")
    p.add_argument("--dcp-up-to", type=int, default=600_000, help="largest number of boxes DCP plans")
    p.add_argument("--no-single", action="store_true", help="skip the one-tensor-in-4,096-boxes rows")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.impl)))
        return
    cases = [f"fsdp:{r}:{t}" for t in args.tensors.split(",") for r in args.ranks.split(",")]
    if not args.no_single:
        cases += ["dim1:4096:1", "2d:4096:1"]
    print(
        f"{'case':<22} {'boxes':>10} {'bcp s':>8} {'bcp peak GB':>11} {'(input)':>8} {'DCP s':>20} "
        f"{'DCP peak GB':>11} {'(input)':>8} {'2nd save s':>10}"
    )
    measured: tuple[int, float] | None = None  # (boxes, DCP seconds) of the largest DCP run
    for case in cases:
        runs: dict[str, list[dict]] = {"bcp": [], "dcp": []}
        boxes = 0
        for _ in range(args.repeat):
            res = run_child(case, "bcp", args.timeout)
            assert res is not None
            runs["bcp"].append(res)
            boxes = res["boxes"]
            if boxes <= args.dcp_up_to:
                res = run_child(case, "dcp", args.timeout)
                if res is not None:
                    runs["dcp"].append(res)
        cached = run_child(case, "cached", args.timeout) if case.startswith("fsdp") else None

        def med(impl: str, key: str, runs: dict[str, list[dict]] = runs) -> float:
            return statistics.median(r[key] for r in runs[impl])

        if runs["dcp"]:
            dcp = f"{med('dcp', 's'):.2f}"
            dcp_rss, dcp_in = f"{med('dcp', 'rss'):.2f}", f"{med('dcp', 'input'):.2f}"
            if case.startswith("fsdp") and (measured is None or boxes > measured[0]):
                measured = (boxes, med("dcp", "s"))
        else:
            est = f"est. {measured[1] * (boxes / measured[0]) ** DCP_EXPONENT:.0f} s" if measured else "no estimate"
            dcp, dcp_rss, dcp_in = f"skipped ({est})", "-", "-"
        second = f"{cached['s']:.4f}" if cached else "-"
        print(
            f"{case:<22} {boxes:>10,} {med('bcp', 's'):>8.3f} {med('bcp', 'rss'):>11.2f} {med('bcp', 'input'):>8.2f} "
            f"{dcp:>20} {dcp_rss:>11} {dcp_in:>8} {second:>10}",
            flush=True,
        )


if __name__ == "__main__":
    main()
