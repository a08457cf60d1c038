"""Is the server the bottleneck? CPU seconds each local server spends while bcp and the
naive path (``torch.save``/``torch.load`` on an s3fs/gcsfs file object) save and load
0.5 GiB through the same network proxy as ``objectstore_bench.py`` (20 ms, 80 MB/s
per connection), beside the wall time.

    python bench/objectstore_server_cpu.py [--servers rclone,moto,gcs] [--repeats 2]

A server near 1.0 cores is saturated (moto under its GIL while serving ranged
reads); one far below 1.0 while the client waits is serial or idle.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import torch

from netproxy import proxied
from objectstore_bench import bcp_uri, fs_for, make_state
from servers import make_bucket, running, test_environment

os.environ.update(test_environment())

import bcp


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU of ``process`` and its children."""
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def measure(kind: str, process: psutil.Process, name: str, fn: Callable[[], object]) -> None:
    cpu0, wall0 = cpu_seconds(process), time.perf_counter()
    fn()
    cpu, wall = cpu_seconds(process) - cpu0, time.perf_counter() - wall0
    print(f"{kind:6} {name:10} wall {wall:6.2f} s  server CPU {cpu:6.2f} s  ({cpu / wall:.2f} cores)", flush=True)


def run_server(kind: str, state: dict, repeats: int) -> None:
    template = {k: torch.empty_like(v) for k, v in state.items()}
    with running(kind) as server, proxied(server.endpoint, latency=0.02, bandwidth=80e6) as endpoint:
        make_bucket(server, "cpu-bench")
        process = psutil.Process(server.process.pid)
        fs, _ = fs_for(kind, endpoint)
        uri = bcp_uri(kind, endpoint, "cpu-bench", "bcp")

        def naive_save() -> None:
            with fs.open("cpu-bench/naive.pt", "wb") as f:
                torch.save(state, f)

        def naive_load() -> None:
            with fs.open("cpu-bench/naive.pt", "rb") as f:
                torch.load(f, weights_only=True)

        for _ in range(repeats):
            measure(kind, process, "bcp save", lambda: bcp.save(state, uri, overwrite=True))
            measure(kind, process, "naive save", naive_save)
            measure(kind, process, "bcp load", lambda: bcp.load(template, uri))
            measure(kind, process, "naive load", naive_load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="rclone,moto,gcs")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    state = make_state(0.5)
    for kind in args.servers.split(","):
        run_server(kind, state, args.repeats)


if __name__ == "__main__":
    main()
