"""Coordinator planning and catalog size at scale (simulated ranks, no processes).

FSDP-like layout: every tensor is sharded along dim 0 over all ranks (uneven, as
torch.chunk splits), so fragments = ranks x tensors. Reports plan_save time, time per
fragment, and the bytes of fragments.arrow, for growing rank counts.

    python bench/plan_scale.py [--tensors 2000] [--ranks 64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import time

from bcp.metadata import Catalog, Fragment
from bcp.metadata.layout import data_file_key, generation_name
from bcp.save_plan import LocalPlan, TensorPlan, plan_save


def chunk_bounds(rows: int, ranks: int) -> list[tuple[int, int]]:
    size = -(-rows // ranks)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(ranks)]


def local_plans(ranks: int, tensors: int, seed: int = 0) -> list[LocalPlan]:
    rng = random.Random(seed)
    shapes = [(rng.randint(1024, 8192), rng.choice([1024, 4096])) for _ in range(tensors)]
    names = [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)]
    paths = [f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]' for i in range(tensors)]
    bounds = [chunk_bounds(rows, ranks) for rows, _cols in shapes]
    plans = []
    for r in range(ranks):
        ts = tuple(
            TensorPlan(
                names[i], paths[i], "bfloat16", shapes[i], (((bounds[i][r][0], 0), (bounds[i][r][1], shapes[i][1])),)
            )
            for i in range(tensors)
        )
        plans.append(LocalPlan(r, ts))
    return plans


def catalog_bytes(plan, ranks: int, tensors: int, meta: dict) -> int:
    frags = []
    for r, items in plan.writes.items():
        offset = 0
        for fqn, (off, lens) in items:
            path, shape = meta[fqn]
            nbytes = math.prod(lens) * 2
            blocks = -(-nbytes // (1 << 20))
            frags.append(
                Fragment(
                    fqn,
                    path,
                    "bfloat16",
                    shape,
                    off,
                    lens,
                    data_file_key(generation_name("x"), r),
                    offset,
                    nbytes,
                    (123456789,) * blocks,
                    r,
                )
            )
            offset += nbytes
    return len(Catalog(frags).to_arrow())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--ranks", default="64,256,1024,4096")
    p.add_argument("--catalog-up-to", type=int, default=4096, help="largest rank count whose catalog is built")
    args = p.parse_args()
    print(
        f"{'ranks':>6} {'tensors':>8} {'fragments':>10} {'plan s':>8} {'us/frag':>8} {'catalog MB':>11} "
        f"{'B/frag':>7} {'peak RSS GB':>12}"
    )
    for ranks in [int(x) for x in args.ranks.split(",")]:
        plans = local_plans(ranks, args.tensors)
        meta = {t.fqn: (t.key_path, t.global_shape) for t in plans[0].tensors}
        gc.collect()
        t0 = time.perf_counter()
        plan = plan_save(plans)
        dt = time.perf_counter() - t0
        frags = sum(len(w) for w in plan.writes.values())
        cat = catalog_bytes(plan, ranks, args.tensors, meta) if ranks <= args.catalog_up_to else float("nan")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"{ranks:>6} {args.tensors:>8} {frags:>10} {dt:>8.2f} {dt / frags * 1e6:>8.2f} {cat / 1e6:>11.1f} "
            f"{cat / frags:>7.0f} {rss:>12.1f}",
            flush=True,
        )
        del plans, plan


if __name__ == "__main__":
    main()
