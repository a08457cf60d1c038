"""Where the time goes: each case of bench/peers.py's bcp rows traced once on the
transformer shape, its per-stage summary printed as a markdown table for docs/benchmarks.md.

One process, bench/shapes.py's Llama-shaped state of ``--gib`` (AdamW moments and a step
per parameter). Each case runs once untraced first (imports, plan caches, the staging
pool: what a training loop has paid by its second checkpoint), then once with
``trace=DIR``; the rank file is read back and summarised by ``bcp trace``'s own code
(``bcp.trace_report.read_traces`` + ``summarise``: a stage's time is the union of its
spans, so four writer threads writing at once count once). The cases:

* **sync save**: ``bcp.save`` to a directory on disk (``--dir``);
* **async_save**: the second call (steady state), its ``blocking`` stage (what the
  caller waits for) and the whole save until ``wait()`` returns;
* **cold load**: ``bcp.load`` of the sync save's checkpoint after its pages are evicted
  (``posix_fadvise(DONTNEED)``, as bench/peers.py does; no root needed);
* **warm load**: the same, every page in the page cache (read once first);
* **load from /dev/shm**: a checkpoint saved to tmpfs (``--shm``).

Stages nest (``save`` holds ``plan``, ``stage``, ``write``...; ``read`` holds ``fetch``
and ``verify``) and overlap (``checksum`` and ``write`` run in the writer threads while
``stage`` copies), so the shares of one table add up to more than 100%. "What bounds
it" says what the stage waits on; for stages that copy memory it gives the memcpy of
the same bytes into warm buffers, measured in the same run, as the limit beside it.

    python bench/traces.py [--gib 2] [--dir DIR] [--shm /dev/shm] [--keep-traces DIR]

The last line is ``traces: <case> <seconds> s, ...`` (each case's wall time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bcp
import shapes  # bench/ is not a package
from bcp.trace_report import OperationSummary, read_traces, summarise
from memcpy_limit import WarmMemcpy
from peers import drop_cache, empty_like, warm_cache

#: the cases, in the order they run and print
CASES = ("sync save", "async_save (steady)", "cold load", "warm load", "load from /dev/shm")

#: stage -> what its time is bound by ({memcpy}: the measured memcpy; {source}: where a load reads from)
BOUNDS = {
    "save": "the whole call",
    "blocking": "what the caller waits for: planning and the copy of every tensor to host staging memory",
    "plan": "CPU: planning, per tensor (layout, catalog rows; cached after the first save)",
    "load plan": "CPU: matching the state against the catalog, per tensor",
    "stage": "memory: handing chunks to the writers, copies into staging slabs (memcpy {memcpy})",
    "copy": "memory: the copy into staging slabs (memcpy {memcpy})",
    "checksum": "CPU: CRC32C of every byte written (sync: calling thread, ahead of the writer; async: writers)",
    "write": "the disk's write speed (O_DIRECT), in the writer threads",
    "drain": "waiting for the writer threads to finish",
    "durable": "fsync of the data files: the disk",
    "commit": "catalog and manifest written and made durable, one process",
    "load": "the whole call",
    "catalog": "reading and checking the manifest and the catalog",
    "read": "planning the reads, then fetch and verify",
    "fetch": "{source}",
    "verify": "CPU: CRC32C of every byte read",
    "objects": "placing the non-tensor objects (param_groups, steps)",
    "shared": "reads shared between ranks (one process: none)",
    "h2d": "host-to-device copies",
}

SOURCES = {
    "cold load": "the disk's read speed (caches dropped)",
    "warm load": "memory: copies out of the page cache (memcpy {memcpy})",
    "load from /dev/shm": "memory: copies out of tmpfs (memcpy {memcpy})",
}


def human_bytes(n: int) -> str:
    if not n:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def traced(directory: Path, fn: Callable[[Path], object]) -> OperationSummary:
    """Run ``fn(trace_dir)`` once with a fresh trace directory; the summary of the one
    operation it traced."""
    shutil.rmtree(directory, ignore_errors=True)
    fn(directory)
    ops = summarise(read_traces(directory))
    if len(ops) != 1:
        raise SystemExit(f"{directory}: expected one traced operation, found {len(ops)}")
    return ops[0]


def table(case: str, op: OperationSummary, memcpy_gbps: float) -> list[str]:
    """The markdown rows of one case: stage, seconds, bytes, GB/s, share of the wall time, what bounds it."""
    wall = op.seconds
    source = SOURCES.get(case, "the checkpoint's storage")
    rows = [
        "| stage | seconds | bytes | GB/s | share of the wall time | what bounds it |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for s in op.stages:
        seconds = s.slowest[1]
        share = f"{100 * seconds / wall:.0f}%" if wall > 0 else "-"
        gbps = f"{s.gbps:.2f}" if s.nbytes and seconds > 0 else "-"
        bound = (
            BOUNDS.get(f"{op.kind} {s.stage}", BOUNDS.get(s.stage, "?"))
            .replace("{source}", source)
            .replace("{memcpy}", f"{memcpy_gbps:.2f} GB/s")
        )
        rows.append(f"| {s.stage} | {seconds:.3f} | {human_bytes(s.nbytes)} | {gbps} | {share} | {bound} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="the transformer state's size (bench/shapes.py)")
    p.add_argument("--dir", default=None, help="where the checkpoints on disk go (default: a temporary directory)")
    p.add_argument("--shm", default="/dev/shm", help="a tmpfs directory for the /dev/shm load")
    p.add_argument("--keep-traces", default=None, help="keep the trace files here (for bcp trace DIR --png)")
    args = p.parse_args()

    state = shapes.transformer_state(args.gib)
    n_tensors, total = sum(1 for _ in shapes.tensors(state)), shapes.nbytes(state)
    work = Path(tempfile.mkdtemp(prefix="bcp-traces-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="bcp-traces-", dir=args.shm))
    traces = Path(args.keep_traces) if args.keep_traces else work / "traces"
    memcpy = WarmMemcpy(list(shapes.tensors(state)))
    memcpy_gbps = total / min(memcpy() for _ in range(3)) / 1e9
    print(
        f"transformer state: {n_tensors} tensors, {human_bytes(total)}; checkpoints under {work} and {shm}; "
        f"memcpy into warm buffers {memcpy_gbps:.2f} GB/s; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    del memcpy
    target = empty_like(state)
    results: dict[str, OperationSummary] = {}
    blocking = 0.0
    try:
        disk = str(work / "sync")
        # sync save: a warm-up, then traced
        bcp.save(state, str(work / "warm-up"), overwrite=True)
        shutil.rmtree(work / "warm-up")
        results["sync save"] = traced(traces / "sync-save", lambda d: bcp.save(state, disk, trace=d))

        # async_save: the first call untraced (it allocates the staging pool), the second traced
        bcp.async_save(state, str(work / "async-1")).wait()
        shutil.rmtree(work / "async-1")
        handle_of: dict[str, float] = {}

        def steady(d: Path) -> None:
            handle = bcp.async_save(state, str(work / "async-2"), trace=d)
            handle_of["blocking"] = handle.blocking_seconds
            handle.wait()

        results["async_save (steady)"] = traced(traces / "async-save", steady)
        blocking = handle_of["blocking"]
        shutil.rmtree(work / "async-2")

        bcp.load(target, disk)  # warm-up: imports, the read path's first call
        drop_cache(disk)
        results["cold load"] = traced(traces / "cold-load", lambda d: bcp.load(target, disk, trace=d))
        warm_cache(disk)
        results["warm load"] = traced(traces / "warm-load", lambda d: bcp.load(target, disk, trace=d))

        bcp.save(state, str(shm / "ckpt"))
        bcp.load(target, str(shm / "ckpt"))
        results["load from /dev/shm"] = traced(
            traces / "shm-load", lambda d: bcp.load(target, str(shm / "ckpt"), trace=d)
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)  # the traces too, unless --keep-traces put them elsewhere

    for case in CASES:
        op = results[case]
        print()
        head = f"**{case}** (transformer, {n_tensors} tensors, {human_bytes(total)}): {op.seconds:.3f} s"
        if case.startswith("async_save"):
            head += f" until `wait()` returns, of which the call blocked {blocking:.3f} s"
        print(head + f" (trace `{op.kind} {op.label}`)")
        print()
        for row in table(case, op, memcpy_gbps):
            print(row)
    print()
    parts = [f"{case} {results[case].seconds:.3f} s" for case in CASES]
    parts.insert(2, f"async_save blocking {blocking:.3f} s")
    print("traces: " + ", ".join(parts))


if __name__ == "__main__":
    main()
