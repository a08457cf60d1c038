"""Per-tensor fixed costs: the same bytes as 100, 1,000 and 10,000 tensors.

bench/shapes.py's ``count_state``: float32 tensors of mixed sizes (log-uniform over
three decades) adding to exactly ``--gib``. For each count, in a fresh process per
(repeat, count), counts interleaved repeat by repeat:

* ``bcp.save`` (sync, to ``--dir``), a warm-up call then the median of ``--calls``, and
  beside it the raw O_DIRECT write of the tensors' own memory (``peers.py``'s limit);
* ``bcp.async_save`` blocking, steady state (after a warm-up call that allocates the
  staging pool), median of ``--calls``;
* ``bcp.load`` from the page cache (the files read once through it) into existing
  tensors, a warm-up call then the median of ``--calls``;
* beside them, the same bytes through peers: safetensors ``load_file`` and ``torch.load``
  from the page cache, each tensor then copied into the existing one (no checksums), and
  a ``copy_`` of each tensor from memory: what a tensor costs a loop of plain Python;
* the load's limit beside it: the bare verified read of each tensor's bytes in the same
  files (``preadv`` and a CRC32C call a piece, 2 threads, no catalog, plan or checks),
  into one buffer and into the state's own tensors (``verified_own``).

A flat cost per tensor shows as a ratio near 1 between the largest and the smallest
count (the issue's target: at most 1.3x). The last line is

    tensor_count_scale: save <r>x, async <r>x, load <r>x (target 1.3x)
    peers beside: safetensors <r>x, torch <r>x, copy <r>x, raw <r>x, verified <r>x, verified_own <r>x

    python bench/tensor_count_scale.py [--gib 1] [--counts 100,1000,10000] [--repeats 2] [--calls 3]
    python bench/tensor_count_scale.py --cases load     # the load row only (one untimed save)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # bench/ is not a package
from peers import warm_cache

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CASES = (
    ("save", "bcp.save (sync)"),
    ("async", "async_save blocking (steady)"),
    ("load", "bcp.load (page cache)"),
    # the same bytes through peers, beside: what a tensor costs them
    ("safetensors", "safetensors load_file+copy (page cache)"),
    ("torch", "torch.load+copy (page cache)"),
    ("copy", "copy_ of each tensor (memory)"),
    # the load's limit beside it: what a verified read costs a tensor with no planning
    ("verified", "bare verified read of each tensor (page cache)"),
    # the same into the state's own tensors, as a load writes them (many small allocations)
    ("verified_own", "bare verified read into the state's tensors (page cache)"),
    # the save's limit beside it: the disk taking each tensor's own memory (its pages)
    ("raw", "raw O_DIRECT write of each tensor's memory"),
)


def run_count(n: int, args) -> dict[str, float]:
    """One process's medians for ``n`` tensors."""
    import torch

    import bcp

    state = shapes.count_state(int(args.gib * 2**30), n)
    root = os.path.join(args.dir, f"n{n}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    sync_uri, async_uri = os.path.join(root, "sync"), os.path.join(root, "async")
    dst = {k: torch.zeros_like(v) for k, v in state.items()}

    def save() -> float:
        t0 = time.perf_counter()
        bcp.save(state, sync_uri, overwrite=True)
        return time.perf_counter() - t0

    def async_blocking() -> float:
        handle = bcp.async_save(state, async_uri, overwrite=True)
        handle.wait()
        return handle.blocking_seconds

    def load() -> float:
        t0 = time.perf_counter()
        bcp.load(dst, sync_uri)
        return time.perf_counter() - t0

    st_file, pt_file = os.path.join(root, "state.safetensors"), os.path.join(root, "state.pt")

    def safetensors_load() -> float:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        for k, v in load_file(st_file).items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    def torch_load() -> float:
        t0 = time.perf_counter()
        for k, v in torch.load(pt_file, weights_only=True).items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    raw_requests: list = []

    def raw() -> float:
        """The tensors' page-aligned interiors written with O_DIRECT in 64 MiB ``pwritev``
        requests into a new file, then fsync (``peers.py``'s raw limit), per state byte."""
        from peers import raw_write_seconds, state_requests

        if not raw_requests:
            raw_requests.append(state_requests(state))
        requests, written = raw_requests[0]
        return raw_write_seconds(os.path.join(root, "raw.bin"), state, requests, written) if written else float("nan")

    verified_reads: list = []

    def verified() -> float:
        """Each tensor's bytes in bcp's own files, read on their own (``preadv`` and a
        CRC32C call a piece of at most 2 MiB, 2 threads, into touched memory;
        ``memcpy_limit.VerifiedReads``): a verified load's cost a tensor, without a
        catalog, a plan or the destinations' checks."""
        from memcpy_limit import VerifiedReads

        if not verified_reads:
            ranges = []
            with bcp.open(sync_uri) as reader:
                for fqn in state:
                    entry = reader.meta(fqn).entry
                    for file, at, size in zip(entry.files, entry.byte_offsets, entry.sizes, strict=True):
                        ranges.append((os.path.join(sync_uri, entry.file_names[int(file)]), int(at), int(size)))
            verified_reads.append(VerifiedReads(ranges=ranges))
        return verified_reads[0]()

    own_reads: list = []

    def verified_own() -> float:
        """:func:`verified` into the load's destination tensors (``dst``), each tensor's
        bytes where a load puts them: the load's limit with the state's own memory."""
        from memcpy_limit import verified_reads_into

        if not own_reads:
            own_reads.append(verified_reads_into(sync_uri, dst))
        return own_reads[0]()

    def copy() -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    out: dict[str, float] = {}
    cases = args.cases.split(",")
    try:
        if "save" not in cases:
            save()  # the checkpoint the load reads
        if "safetensors" in cases:
            from safetensors.torch import save_file

            save_file(state, st_file)
        if "torch" in cases:
            torch.save(state, pt_file)
        warm = lambda _uri: [warm_cache(f) for f in (sync_uri, st_file, pt_file) if os.path.exists(f)]  # noqa: E731
        steps = (
            ("save", save, None),
            ("raw", raw, None),
            ("async", async_blocking, None),
            ("load", load, warm),
            ("safetensors", safetensors_load, warm),
            ("torch", torch_load, warm),
            ("copy", copy, None),
            ("verified", verified, warm),
            ("verified_own", verified_own, warm),
        )
        for name, fn, prepare in steps:
            if name not in cases:
                continue
            fn()  # warm-up: imports, plan caches, the staging pool
            samples = []
            for _ in range(args.calls):
                if prepare is not None:
                    prepare(sync_uri)
                samples.append(fn())
            out[name] = statistics.median(samples)
        if "load" in cases and not all(torch.equal(dst[k], v) for k, v in state.items()):
            raise SystemExit(f"tensor_count_scale: the load of {n} tensors differs from what was saved")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="total bytes of every state, GiB")
    p.add_argument("--counts", default="100,1000,10000", help="tensor counts, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per count, interleaved")
    p.add_argument("--calls", type=int, default=3, help="timed calls per case in each process")
    p.add_argument("--dir", default=None, help="where a scratch directory is made (default: the temp dir)")
    p.add_argument(
        "--cases",
        default=",".join(k for k, _l in CASES),
        help="which of " + ", ".join(k for k, _l in CASES) + " to time, comma-separated (the last 6: peers, limits)",
    )
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.count is not None:
        print("RESULT " + json.dumps(run_count(args.count, args)), flush=True)
        return
    counts = [int(c) for c in args.counts.split(",")]
    print(
        f"{args.gib:g} GiB as {', '.join(f'{c:,}' for c in counts)} float32 tensors of mixed sizes; medians of "
        f"{args.repeats} processes x {args.calls} calls; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    runs: dict[int, dict[str, list[float]]] = {c: {k: [] for k, _l in CASES} for c in counts}
    work = tempfile.mkdtemp(prefix="bcp-count-scale-", dir=args.dir)
    try:
        measure(counts, args, work, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(counts, args, runs)


def measure(counts: list[int], args, work: str, runs: dict[int, dict[str, list[float]]]) -> None:
    """Every (repeat, count) in its own process, counts interleaved."""
    for _rep in range(args.repeats):
        for n in counts:
            cmd = [sys.executable, __file__, "--count", str(n), "--gib", str(args.gib), "--calls", str(args.calls)]
            cmd += ["--cases", args.cases]
            proc = subprocess.run([*cmd, "--dir", work], capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                raise SystemExit(f"tensor_count_scale: the run of {n} tensors failed: {tail}")
            for k, v in json.loads(lines[-1][7:]).items():
                runs[n][k].append(v)


def report(counts: list[int], args, runs: dict[int, dict[str, list[float]]]) -> None:
    cases = [(k, label) for k, label in CASES if k in args.cases.split(",")]
    med = {n: {k: statistics.median(runs[n][k]) for k, _l in cases} for n in counts}
    size = int(args.gib * 2**30) // 4 * 4
    print()
    print("| tensors | " + " | ".join(f"{label} s" for _k, label in cases) + " |")
    print("|---:|" + "---:|" * len(cases))
    for n in counts:
        cells = " | ".join(f"{med[n][k]:.3f} ({size / med[n][k] / 1e9:.2f} GB/s)" for k, _l in cases)
        print(f"| {n:,} | {cells} |")
    lo, hi = min(counts), max(counts)
    ratio = {k: med[hi][k] / med[lo][k] for k, _l in cases}
    print(f"| {hi:,} / {lo:,} | " + " | ".join(f"{ratio[k]:.2f}x" for k, _l in cases) + " |")
    ours = [k for k in ("save", "async", "load") if k in ratio]
    print("tensor_count_scale: " + ", ".join(f"{k} {ratio[k]:.2f}x" for k in ours) + " (target 1.3x)")
    if peers := [k for k in ("safetensors", "torch", "copy", "raw", "verified", "verified_own") if k in ratio]:
        print("peers beside: " + ", ".join(f"{k} {ratio[k]:.2f}x" for k in peers))


if __name__ == "__main__":
    main()
