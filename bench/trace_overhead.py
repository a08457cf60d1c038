"""What tracing costs a save (and a load): bcp before tracing existed, tracing off, tracing on.

Each variant runs in its own long-lived worker process (the baseline imports bcp from
an export of ``--baseline-rev``); the driver interleaves single saves across the
workers, round after round, so drifts in the machine's load hit every variant alike,
and reports each variant's median and its difference from the baseline's median.

    .venv/bin/python bench/trace_overhead.py [--mib 256] [--tensors 300] [--rounds 15] [--baseline-rev 168f8f6]

A worker saves the same state (``--tensors`` tensors, ``--mib`` MiB in all, a mix of
sizes like a model's) to a directory under ``--dir`` (default: a temporary directory
in /dev/shm when there is one, so the disk's noise stays out), with ``overwrite=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the repository's folders and the names they are installed under (pyproject's package-dir)
LAYERS = {"bcp": "bcp", "backends": "bcp/backends", "metadata": "bcp/metadata", "conformance": "bcp/conformance"}


def make_state(mib: int, tensors: int):
    import torch

    g = torch.Generator().manual_seed(0)
    total = mib << 20
    # a few large tensors (embeddings, MLPs) hold most bytes; many small ones (norms, biases)
    large = max(1, tensors // 10)
    per_large = (total * 9 // 10) // large // 4
    small = max(1, tensors - large)
    per_small = max(1, (total // 10) // small // 4)
    state = {f"large{i}": torch.randn(per_large, generator=g) for i in range(large)}
    state.update({f"small{i}": torch.randn(per_small, generator=g) for i in range(small)})
    state["step"] = 1
    return state


def worker(args: argparse.Namespace) -> None:
    """Serve "save off" / "save on" / "load off" / "load on" lines with the seconds taken."""
    import torch

    import bcp

    torch.set_num_threads(1)
    state = make_state(args.mib, args.tensors)
    uri = Path(args.dir) / f"ck-{os.getpid()}"
    trace_dir = Path(args.dir) / f"trace-{os.getpid()}"
    template = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    print(json.dumps({"ready": bcp.__file__}), flush=True)
    for line in sys.stdin:
        what, mode = line.split()
        extra = {"trace": trace_dir} if mode == "on" else {}
        start = time.perf_counter()
        if what == "save":
            bcp.save(state, uri, overwrite=True, **extra)
        else:
            bcp.load(template, uri, **extra)
        seconds = time.perf_counter() - start
        if mode == "on":
            shutil.rmtree(trace_dir, ignore_errors=True)
        print(json.dumps({"seconds": seconds}), flush=True)


def direct_cost(args: argparse.Namespace) -> None:
    """What tracing adds, measured directly (immune to the machine's noise): the cost of
    one span off and on, times the spans one traced save records, plus writing its file."""
    import torch

    from bcp import trace

    torch.set_num_threads(1)
    n = 200_000

    def per_span() -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            with trace.span("write", 4096):
                pass
        return (time.perf_counter_ns() - start) / n

    def empty_loop() -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            pass
        return (time.perf_counter_ns() - start) / n

    loop = min(empty_loop() for _ in range(3))
    off = min(per_span() for _ in range(3)) - loop
    session = trace.begin(True, 0, "save")
    assert session is not None
    on = min(per_span() for _ in range(3)) - loop
    session.end()

    import bcp

    state = make_state(args.mib, args.tensors)
    out = Path(args.dir) / "direct"
    info = bcp.save(state, out / "ck", trace=out / "trace")
    (path,) = (out / "trace").glob("*.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = sum(e["ph"] == "X" for e in events)
    session = trace.begin(out / "trace2", 0, "save")
    assert session is not None
    session.events = [dict(e) for e in events if e["ph"] == "X"]
    start = time.perf_counter()
    session.end()
    write_s = time.perf_counter() - start
    added_on = spans * on * 1e-9 + write_s
    print(f"\ndirect cost ({args.mib} MiB in {args.tensors} tensors, a {info.seconds:.3f} s save):")
    print(f"  a span off: {off:.0f} ns (a None check); on: {on:.0f} ns; spans in one save: {spans}")
    print(f"  off: {spans * off * 1e-3:.1f} us per save ({spans * off * 1e-9 / info.seconds * 100:.4f}% of it)")
    print(
        f"  on: {spans * on * 1e-3:.1f} us of spans + {write_s * 1e3:.2f} ms writing the file = "
        f"{added_on / info.seconds * 100:.2f}% of the save"
    )


def export_baseline(rev: str, into: Path) -> Path:
    """``rev``'s bcp, laid out as installed (bcp/, bcp/backends, ...), importable from ``into``."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    tar_path = into / "rev.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(tree, filter="data")
    site = into / "site"
    for folder, name in LAYERS.items():
        shutil.copytree(tree / folder, site / name, dirs_exist_ok=True)
    return site


class Worker:
    def __init__(self, name: str, args: argparse.Namespace, pythonpath: Path | None) -> None:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        cmd = [sys.executable, __file__, "--worker", "--mib", str(args.mib), "--tensors", str(args.tensors)]
        self.name = name
        self.proc = subprocess.Popen(
            [*cmd, "--dir", args.dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.module = json.loads(self.ask_line())["ready"]

    def ask_line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died")
        return line

    def run(self, what: str, mode: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{what} {mode}\n")
        self.proc.stdin.flush()
        return json.loads(self.ask_line())["seconds"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--baseline-rev", default=None, help="git revision of bcp before tracing (omit: no baseline)")
    p.add_argument("--dir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    scratch = Path(tempfile.mkdtemp(prefix="bcp-trace-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    args.dir = args.dir or str(scratch)
    try:
        variants: list[tuple[str, Worker, str]] = []
        if args.baseline_rev:
            base = Worker("before", args, export_baseline(args.baseline_rev, scratch / "baseline"))
            variants.append(("before", base, "off"))
        now = Worker("now", args, None)
        variants += [("off", now, "off"), ("on", now, "on")]
        for name, w, _mode in variants:
            print(f"{name}: bcp from {w.module}")
        for what in ("save", "load"):
            times: dict[str, list[float]] = {name: [] for name, _w, _m in variants}
            for _name, w, mode in variants:  # warm-up: page cache, staging pool, plan cache
                w.run(what, mode)
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                for name, w, mode in order:
                    times[name].append(w.run(what, mode))
            ref_name = "before" if args.baseline_rev else "off"
            ref = statistics.median(times[ref_name])
            print(f"\n{what}: {args.mib} MiB in {args.tensors} tensors, {args.rounds} interleaved rounds")
            for name, values in times.items():
                med = statistics.median(values)
                spread = f"[{min(values):.4f} .. {max(values):.4f}]"
                diff = f"{(med / ref - 1) * 100:+.2f}% vs {ref_name}" if name != ref_name else "(reference)"
                print(f"  {name:<7} median {med:.4f} s {spread}  {diff}")
            if "on" in times and "off" in times:
                off, on = statistics.median(times["off"]), statistics.median(times["on"])
                print(f"  tracing on vs off: {(on / off - 1) * 100:+.2f}%")
        for _name, w, _mode in variants:
            if w.proc.poll() is None:
                w.close()
        direct_cost(args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
