"""What one loading rank fetches and decodes of the catalog, whole vs in part (catalog v2).

Layout: bench/plan_scale.py's FSDP layout (bf16 tensors of 1k-8k rows x 1k or 4k
columns, each split on dim 0 over all ranks as torch.chunk splits), one catalog row
per (rank, tensor), built directly as an Arrow table (no tensor data) and encoded
with ``Catalog.to_arrow`` (catalog v2). Each case runs in its own child process.

Timed, in CPU seconds of the child (partial: one child per sampled rank, 0, R'/3,
R'/2 and R'-1, medians shown):
  whole:   Catalog.from_arrow of the whole file (what every rank did before catalog
           v2: the coordinator broadcast the whole catalog), then the TensorEntry of
           every tensor (what matching the state builds).
  partial: Catalog.from_head on the head and trailer (what the coordinator shares),
           then catalog.require(the rank's wanted boxes) (ranged reads of the
           sections those boxes need, served from memory here), then the entries.
"fetched" is the catalog bytes the rank holds: the whole file, or head + trailer +
the sections it read. The catalog is built once by the parent and read from a file
by each child, so the RSS is the reading rank's. Ranks load the same layout (R ranks) or resharded to R' ranks
(rank r' wants chunk r' of R' of every tensor). Memory: the child's peak RSS
(VmHWM) over its RSS once bcp is imported and the file read.

    python bench/catalog_fetch_scale.py                  # 1,024 ranks x 2,000 tensors, same and 768
    python bench/catalog_fetch_scale.py --ranks 256,1024 --tensors 2000 --reshard 192,768
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

from bcp.metadata import Catalog
from bcp.metadata.catalog.sections import TRAILER


def shapes(tensors: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)  # as bench/plan_scale.py
    return [(rng.randint(1024, 8192), rng.choice([1024, 4096])) for _ in range(tensors)]


def chunks(rows: np.ndarray, ranks: int, r: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) on dim 0 of chunk r of ``ranks`` (torch.chunk's split)."""
    size = -(-rows // ranks)
    off = np.minimum(r * size, rows)
    return off, np.maximum(0, np.minimum(size, rows - off))


def catalog_bytes(ranks: int, tensors: int) -> bytes:
    dims = shapes(tensors)
    rows = np.array([s[0] for s in dims], dtype=np.int64)
    cols = np.array([s[1] for s in dims], dtype=np.int64)
    t = np.tile(np.arange(tensors), ranks)  # rank-major: each writer's rows in save order
    r = np.repeat(np.arange(ranks), tensors)
    n = len(t)
    off, ln = chunks(rows[t], ranks, r)
    nbytes = ln * cols[t] * 2
    byte_offset = np.zeros(n, dtype=np.int64)
    per_rank = nbytes.reshape(ranks, tensors)
    byte_offset[:] = (np.cumsum(per_rank, axis=1) - per_rank).reshape(-1)
    block = 64 << 10
    n_sums = -(-nbytes // block)
    names = [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)]
    paths = [f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]' for i in range(tensors)]

    def lst(starts: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), pa.array(values, type_))

    two = np.arange(0, 2 * n + 1, 2)
    table = pa.table(
        {
            "fqn": pa.DictionaryArray.from_arrays(pa.array(t.astype(np.int32)), pa.array(names)),
            "key_path": pa.DictionaryArray.from_arrays(pa.array(t.astype(np.int32)), pa.array(paths)),
            "dtype": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["bfloat16"])),
            "global_shape": lst(two, np.stack([rows[t], cols[t]], 1).reshape(-1), pa.int64()),
            "offsets": lst(two, np.stack([off, np.zeros(n, np.int64)], 1).reshape(-1), pa.int64()),
            "lengths": lst(two, np.stack([ln, cols[t]], 1).reshape(-1), pa.int64()),
            "file": pa.DictionaryArray.from_arrays(
                pa.array(r.astype(np.int32)), pa.array([f"gen-x/data/rank{k:05d}-0.bin" for k in range(ranks)])
            ),
            "byte_offset": pa.array(byte_offset),
            "nbytes": pa.array(nbytes),
            "checksums": lst(
                np.concatenate([[0], np.cumsum(n_sums)]), np.full(int(n_sums.sum()), 7, np.uint32), pa.uint32()
            ),
            "writer_rank": pa.array(r.astype(np.int32)),
        }
    )
    return Catalog.from_table(table).to_arrow()


def wanted(tensors: int, ranks: int, r: int) -> list[tuple[str, tuple[tuple[int, int], tuple[int, int]]]]:
    dims = shapes(tensors)
    rows = np.array([s[0] for s in dims], dtype=np.int64)
    off, ln = chunks(rows, ranks, r)
    names = [f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors)]
    return [(names[i], ((int(off[i]), 0), (int(ln[i]), dims[i][1]))) for i in range(tensors) if ln[i] > 0]


def status_gb(field: str) -> float:
    """A memory field of /proc/self/status in GB (Linux). VmHWM, unlike ru_maxrss, is
    not inherited across exec from the parent that built the catalog."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_now() -> float:
    return status_gb("VmRSS")


def cpu() -> float:
    return time.process_time()


def child(args: argparse.Namespace) -> None:
    with open(args.path, "rb") as f:
        data = f.read()
    base = rss_now()
    block = 64 << 10
    out: dict[str, object] = {"file_bytes": len(data)}
    if args.mode == "whole":
        t0 = cpu()
        cat = Catalog.from_arrow(data, where="bench", checksum_block_bytes=block)
        t1 = cpu()
        for fqn in cat.tensors:
            cat.tensors[fqn]
        t2 = cpu()
        out.update(fetched=len(data), decode_s=t1 - t0, entries_s=t2 - t1, sections=1)
    else:
        load_ranks = args.load_ranks
        rows = []
        head_len = Catalog.tail_bytes(len(data), data[-TRAILER.size :])
        for r in [args.sample_rank]:
            fetched = [head_len]

            def fetch(offset: int, length: int, fetched: list[int] = fetched) -> bytes:
                fetched.append(length)
                return data[offset : offset + length]

            want = wanted(args.tensors, load_ranks, r)
            t0 = cpu()
            cat = Catalog.from_head(
                data[len(data) - head_len :], file_size=len(data), fetch=fetch, where="b", checksum_block_bytes=block
            )
            t1 = cpu()
            cat.require(want)
            t2 = cpu()
            for fqn, _box in want:
                cat.tensors[fqn]
            t3 = cpu()
            held, total = cat.sections_held
            rows.append((sum(fetched), t1 - t0, t2 - t1, t3 - t2, held, total, len(cat)))
        (fetched_bytes, head_s, require_s, entries_s, held, total, rows_held) = rows[0]
        out.update(
            head_bytes=head_len,
            fetched=fetched_bytes,
            head_s=head_s,
            require_s=require_s,
            entries_s=entries_s,
            sections=held,
            total_sections=total,
            rows_held=rows_held,
        )
    out["peak_rss_gb"] = status_gb("VmHWM")
    out["extra_gb"] = out["peak_rss_gb"] - base
    print(json.dumps(out))


def run(path: str, ranks: int, tensors: int, mode: str, load_ranks: int, sample: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--ranks", str(ranks), "--tensors", str(tensors)]
    cmd += ["--load-ranks", str(load_ranks), "--path", path, "--sample-rank", str(sample)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024")
    p.add_argument("--tensors", default="2000")
    p.add_argument("--reshard", default="768", help="load world sizes besides the saving one (one per --ranks)")
    p.add_argument("--child", choices=["whole", "partial"])
    p.add_argument("--load-ranks", type=int, default=0)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--sample-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.mode, args.ranks, args.tensors = args.child, int(args.ranks), int(args.tensors)
        child(args)
        return
    reshard = [int(x) for x in args.reshard.split(",")]
    print("| ranks x tensors | load ranks | fetch | catalog bytes fetched | sections read | CPU s (decode + entries) "
          "| peak RSS over baseline |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    for i, ranks in enumerate(int(x) for x in args.ranks.split(",")):
        for tensors in (int(x) for x in args.tensors.split(",")):
            t0 = time.perf_counter()
            data = catalog_bytes(ranks, tensors)
            encode_s = time.perf_counter() - t0
            with tempfile.NamedTemporaryFile(suffix=".arrow", delete=False) as f:
                f.write(data)
                path = f.name
            run_case = functools.partial(run, path, ranks, tensors)
            whole = run_case("whole", ranks)
            print(
                f"| {ranks:,} x {tensors:,} | any | whole | {whole['fetched'] / 1e6:.1f} MB | all "
                f"| {whole['decode_s']:.2f} + {whole['entries_s']:.2f} | {whole['extra_gb']:.2f} GB |"
            )
            for load in (ranks, reshard[min(i, len(reshard) - 1)]):
                samples = sorted({0, load // 3, load // 2, load - 1})
                runs = [run_case("partial", load, r) for r in samples]

                def med(key: str, runs: list[dict] = runs) -> float:
                    return statistics.median(x[key] for x in runs)

                print(
                    f"| {ranks:,} x {tensors:,} | {load:,} | part | {med('fetched') / 1e6:.2f} MB "
                    f"(head {runs[0]['head_bytes'] / 1e6:.2f}) | {med('sections'):g}/{runs[0]['total_sections']} "
                    f"| {med('head_s'):.2f} + {med('require_s'):.2f} + {med('entries_s'):.2f} "
                    f"| {med('extra_gb'):.3f} GB |"
                )
            os.unlink(path)
            print(f"\n(encoding the catalog, Catalog.from_table + to_arrow: {encode_s:.2f} s wall)\n")


if __name__ == "__main__":
    main()
