"""Catalog commit on the coordinator at scale (simulated writer reports, no processes).

FSDP-like layout of bench/plan_scale.py: every tensor (bf16) sharded on dim 0 over all
ranks, each rank writing one fragment per tensor, so rows = ranks x tensors. Every
rank's report is pickled beforehand, as gather_object sends it.

Timed (CPU seconds of this process, then wall seconds; the best of --repeat runs,
interleaved), per path:
  columnar (today, as the saver's commit): unpickle every rank's WriterReport (an
      Arrow table naming tensors by index in the rank's layout metadata), merge_reports
      (concatenate as numpy columns, order by writer / save order / offsets with sort
      indices, the manifest's counts), write_catalog(merged.catalog_bytes()) to a
      memory backend (the merged rows encoded directly, no Catalog built);
  objects (before): unpickle every rank's list of Fragment objects, sort them with
      a lambda key, write_catalog(Catalog(fragments)), the manifest's counts over
      Python sets, as the save did before writers reported Arrow tables.

    python bench/commit_scale.py [--ranks 1024] [--tensors 2000] [--objects-ranks 256]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import time

import numpy as np
import pyarrow as pa

from bcp.backends import backend_for
from bcp.commit import write_catalog
from bcp.metadata import Catalog, FileEntry
from bcp.metadata.keys import data_file_key, generation_name
from bcp.planning import LayoutMeta, TensorPlan
from bcp.planning.writer_rows import REPORT_SCHEMA, WriterReport, merge_reports


def reports(ranks: int, tensors: int, seed: int = 0) -> tuple[list[WriterReport], LayoutMeta]:
    """One report per rank (its fragment of every tensor, in save order, back to back)
    and the layout metadata every rank shares."""
    rng = random.Random(seed)
    shapes = [(rng.randint(1024, 8192), rng.choice([1024, 4096])) for _ in range(tensors)]
    names = [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)]
    paths = [f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]' for i in range(tensors)]
    meta = LayoutMeta(tuple(names), tuple(paths), ("bfloat16",) * tensors, tuple(shapes), (None,) * tensors)
    plans = {i: TensorPlan(names[i], paths[i], "bfloat16", shapes[i], ()) for i in range(tensors)}
    rows = np.array([s[0] for s in shapes], dtype=np.int64)
    cols = np.array([s[1] for s in shapes], dtype=np.int64)
    size = -(-rows // ranks)
    gen = generation_name("0123456789abcdef")
    two = np.arange(0, 2 * tensors + 1, 2, dtype=np.int32)
    out = []
    for r in range(ranks):
        start = np.minimum(r * size, rows)
        length = np.maximum(0, np.minimum(size, rows - r * size))
        nbytes = length * cols * 2
        byte_offset = np.concatenate([[0], np.cumsum(-(-nbytes // 64) * 64)[:-1]])
        blocks = -(-nbytes // (64 << 10))
        table = pa.table(
            [
                pa.array(np.arange(tensors, dtype=np.int32)),
                pa.ListArray.from_arrays(two, np.stack([start, np.zeros_like(start)], 1).ravel()),
                pa.ListArray.from_arrays(two, np.stack([length, cols], 1).ravel()),
                pa.array(byte_offset),
                pa.array(nbytes),
                pa.ListArray.from_arrays(
                    np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32),
                    pa.array(np.arange(int(blocks.sum())) % (1 << 32), pa.uint32()),
                ),
            ],
            schema=REPORT_SCHEMA,
        )
        key = data_file_key(gen, r)
        out.append(WriterReport(table, FileEntry(key, int(byte_offset[-1] + nbytes[-1]), "0" * 8), r, plans))
    return out, meta


def commit_columnar(blobs: list[bytes], order: list[str], backend, meta: LayoutMeta) -> dict:
    got = [pickle.loads(b) for b in blobs]
    merged = merge_reports(got, [meta] * len(got), order)  # rows in catalog order, and the manifest's counts
    entry = write_catalog(backend, "columnar/fragments.arrow", merged.catalog_bytes())
    return {"catalog_bytes": entry.nbytes, **merged.stats}


def commit_objects(blobs: list[bytes], order: list[str], backend, _meta: LayoutMeta) -> dict:
    got = [pickle.loads(b) for b in blobs]
    pos = {n: i for i, n in enumerate(order)}
    fragments = sorted((f for r in got for f in r), key=lambda f: (pos[f.fqn], f.offsets, f.writer_rank))
    entry = write_catalog(backend, "objects/fragments.arrow", Catalog(fragments))
    unique = {(f.file, f.byte_offset, f.offsets, f.lengths) for f in fragments}
    logical = {(f.fqn, f.offsets, f.lengths): f.nbytes for f in fragments}
    stats = {"tensors": len({f.fqn for f in fragments}), "fragments": len(unique)}
    stats["tensor_bytes"] = sum(logical.values())
    return {"catalog_bytes": entry.nbytes, **stats}


def timed(fn, *args):
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return time.process_time() - c0, time.perf_counter() - w0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--objects-ranks", type=int, default=256, help="rank count for the Fragment-object path (0: skip)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    backend = backend_for("memory://commit-scale")
    sizes = sorted({args.objects_ranks, args.ranks} - {0})
    print(f"{'ranks':>6} {'tensors':>7} {'rows':>9} {'path':>9} {'cpu s':>7} {'wall s':>7} {'us/row':>7}  catalog")
    for ranks in sizes:
        reps, meta = reports(ranks, args.tensors)
        order = list(meta.fqns)
        n = ranks * args.tensors
        paths = [("columnar", commit_columnar, [pickle.dumps(r) for r in reps])]
        if ranks <= args.objects_ranks:
            paths.append(("objects", commit_objects, [pickle.dumps(r.fragments) for r in reps]))
        del reps
        results = {}
        for _ in range(args.repeat):  # interleaved: columnar, objects, columnar, objects
            for name, fn, blobs in paths:
                cpu, wall, out = timed(fn, blobs, order, backend, meta)
                best = results.get(name)
                if best is None or cpu < best[0]:
                    results[name] = (cpu, wall, out)
        for name, (cpu, wall, out) in results.items():
            print(
                f"{ranks:>6} {args.tensors:>7} {n:>9,} {name:>9} {cpu:>7.2f} {wall:>7.2f} {cpu / n * 1e6:>7.2f}  "
                f"{out['catalog_bytes'] / 2**20:.1f} MiB, {out['fragments']:,} fragments"
            )
        if len(results) == 2:
            a, b = results["columnar"][2], results["objects"][2]
            assert {k: a[k] for k in ("tensors", "fragments", "tensor_bytes")} == {
                k: b[k] for k in ("tensors", "fragments", "tensor_bytes")
            }, (a, b)


if __name__ == "__main__":
    main()
