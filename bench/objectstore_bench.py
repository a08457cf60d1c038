"""bcp through object stores across an emulated network, beside the ways people do it
today, on the same servers in the same minutes.

Servers (real, on 127.0.0.1): rclone serve s3 (file-backed), moto_server (in
memory), gcp-storage-emulator (in memory). Every client reaches them through the
proxy of ``tests/netproxy.py``, which adds ``--latency-ms`` to each round trip and
caps each connection at ``--bandwidth-mbs`` (default 20 ms and 80 MB/s: a store
across a network, where one connection carries tens of MB/s; ``0 0`` for straight
loopback). Cases, each saving and then loading the same state (``--gib``),
``--repeats`` times, medians reported. Each repetition saves with every case, flushes
the server's disk (``os.sync``), waits ``--settle`` seconds, then loads with every
case twice (the first load is what a resuming job sees; the second has the server's
cache warm):

* bcp:          ``bcp.save`` / ``bcp.load`` with its defaults, and with each
                ``--bcp OPTIONS`` given (``part_size=8MiB&concurrency=16``), to tune them
* torch+fsspec: ``torch.save`` into an s3fs/gcsfs file object, ``torch.load`` from one
* DCP fsspec:   ``torch.distributed.checkpoint`` with FsspecWriter/FsspecReader
                (``thread_count=4``). torch 2.13 exposes these only from the private
                module ``torch.distributed.checkpoint._fsspec_filesystem``: imported
                here, in a benchmark, never in the library.

``--faults`` measures bcp saves instead through the proxy's faults (503 SlowDown on 5%
of requests, 5% of uploads reset mid-body, 3% of uploads stalled until bcp's
``timeout``, 10 s by default here), interleaved with clean saves, each checked by a
full load, and reports the slowdown each costs.

    python bench/objectstore_bench.py [--gib 1] [--repeats 3] [--servers rclone,moto,gcs]
    python bench/objectstore_bench.py --faults [--fault-timeout 10]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch

from netproxy import proxied, read_stats
from servers import make_bucket, running, test_environment

os.environ.update(test_environment())

import bcp


def make_state(gib: float, tensors: int = 32) -> dict:
    per = int(gib * 2**30 / tensors / 4)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.rand(per, generator=g) for i in range(tensors)}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fs_for(kind: str, endpoint: str):
    if kind == "gcs":
        import gcsfs

        return gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True), "gs"
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True), "s3"


def fs_options(kind: str, endpoint: str) -> dict:
    if kind == "gcs":
        return {"endpoint_url": endpoint, "token": "anon"}
    return {"client_kwargs": {"endpoint_url": endpoint}}


def bcp_uri(kind: str, endpoint: str, bucket: str, path: str, options: str = "") -> str:
    """The checkpoint's URI; ``options`` (``part_size=8MiB&concurrency=16``) are added to its query."""
    extra = f"&{options.strip('&')}" if options.strip("&") else ""
    if kind == "gcs":
        return f"gs://{bucket}/{path}?endpoint_url={endpoint}&anon=true&conditional_writes=false{extra}"
    if kind == "rclone":
        extra = "&conditional_writes=false" + extra
    return f"s3://{bucket}/{path}?endpoint_url={endpoint}{extra}"


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _path(case: str, rep: int) -> str:
    return f"{case.replace(' ', '-').replace('+', '-')}-{rep}"


def save_case(case, kind, endpoint, bucket, fs, proto, state, rep, variants) -> float:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    path = _path(case, rep)
    if case in variants:
        return timed(lambda: bcp.save(state, bcp_uri(kind, endpoint, bucket, path, variants[case])))
    if case == "torch+fsspec":

        def naive_save():
            with fs.open(f"{bucket}/{path}.pt", "wb") as f:
                torch.save(state, f)

        return timed(naive_save)
    writer = FsspecWriter(f"{proto}://{bucket}/{path}", thread_count=4, **fs_options(kind, endpoint))
    return timed(lambda: dcp_save(state, storage_writer=writer))


def load_case(case, kind, endpoint, bucket, fs, proto, template, rep, variants) -> tuple[float, dict]:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    path = _path(case, rep)
    if case in variants:
        return timed(lambda: bcp.load(template, bcp_uri(kind, endpoint, bucket, path, variants[case]))), template
    if case == "torch+fsspec":
        box = {}

        def naive_load():
            with fs.open(f"{bucket}/{path}.pt", "rb") as f:
                box["out"] = torch.load(f, weights_only=True)

        seconds = timed(naive_load)
        return seconds, box["out"]
    out = {k: torch.empty_like(v) for k, v in template.items()}
    reader = FsspecReader(f"{proto}://{bucket}/{path}", **fs_options(kind, endpoint))
    return timed(lambda: dcp_load(out, storage_reader=reader)), out


def _remove(fs, bucket: str, case: str, rep: int) -> None:
    for target in (f"{bucket}/{_path(case, rep)}", f"{bucket}/{_path(case, rep)}.pt"):
        try:
            fs.rm(target, recursive=True)
        except FileNotFoundError:
            pass


def run_server(
    kind: str, state: dict, args: argparse.Namespace, variants: dict[str, str]
) -> dict[str, tuple[float, ...]]:
    template = {k: torch.empty_like(v) for k, v in state.items()}
    cases = [*variants, "torch+fsspec", "DCP fsspec"]
    results: dict[str, list[tuple[float, float, float]]] = {case: [] for case in cases}
    with running(kind) as server, network(server.endpoint, args) as endpoint:
        bucket = f"bench{uuid.uuid4().hex[:8]}"
        make_bucket(server, bucket)
        fs, proto = fs_for(kind, endpoint)
        for case, options in variants.items():
            hints = bcp.backends.backend_for(bcp_uri(kind, endpoint, bucket, "x", options)).hints
            print(f"  {kind:6} {case:28} parts of {hints.part_size >> 20} MiB, {hints.concurrency} in flight")
        for rep in range(args.repeats):
            saves: dict[str, float] = {}
            for case in cases:  # all saves first, then let the server's disk settle, then all loads
                saves[case] = save_case(case, kind, endpoint, bucket, fs, proto, state, rep, variants)
            os.sync()
            time.sleep(args.settle)
            for case in cases:
                load, out = load_case(case, kind, endpoint, bucket, fs, proto, template, rep, variants)
                bad = [k for k in state if not torch.equal(out[k], state[k])]
                if bad:
                    raise AssertionError(f"{case} on {kind}: {bad[:3]} differ after the round trip")
                del out
                warm, out = load_case(case, kind, endpoint, bucket, fs, proto, template, rep, variants)
                del out
                results[case].append((saves[case], load, warm))
                print(
                    f"  {kind:6} {case:28} rep {rep}: save {saves[case]:6.2f} s  load {load:6.2f} s  "
                    f"load again {warm:6.2f} s",
                    flush=True,
                )
            for case in cases:
                _remove(fs, bucket, case, rep)
    return {case: tuple(statistics.median(r[i] for r in rs) for i in range(3)) for case, rs in results.items()}


@contextlib.contextmanager
def network(endpoint: str, args: argparse.Namespace, **faults) -> Iterator[str]:
    """``endpoint`` behind the latency/bandwidth proxy (and ``faults``), or as it is
    with ``--latency-ms 0 --bandwidth-mbs 0`` and no faults."""
    if not (args.latency_ms or args.bandwidth_mbs or faults):
        yield endpoint
        return
    with proxied(endpoint, latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbs * 1e6, **faults) as proxy:
        yield proxy


#: Faults injected through the proxy, for ``--faults``: name -> proxy settings.
FAULTS = {
    "none": {},
    "503 SlowDown, 5% of requests": {"slowdown": 0.05},
    "reset mid-body, 5% of uploads": {"reset": 0.05, "methods": {"PUT", "POST"}},
    "stalled upload, 3% of uploads": {"stall": 0.03, "methods": {"PUT", "POST"}},
}


def run_faults(kind: str, state: dict, args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """bcp saves through each fault (interleaved, ``--repeats`` rounds), each checked by a
    full load; median seconds and faults injected per save."""
    template = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {name: [] for name in FAULTS}
    counts: dict[str, list[int]] = {name: [] for name in FAULTS}
    extra = f"timeout={args.fault_timeout:g}&" + args.fault_options
    with running(kind) as server:
        bucket = f"faults{uuid.uuid4().hex[:8]}"
        make_bucket(server, bucket)
        for rep in range(args.repeats):
            for i, (name, faults) in enumerate(FAULTS.items()):
                stats_path = Path(tempfile.mkdtemp()) / "stats.json"
                with network(server.endpoint, args, seed=rep * 100 + i, stats=stats_path, **faults) as endpoint:
                    uri = bcp_uri(kind, endpoint, bucket, f"fault{i}-{rep}", extra)
                    seconds = timed(lambda uri=uri: bcp.save(state, uri))
                    bcp.load(template, uri)
                bad = [k for k in state if not torch.equal(template[k], state[k])]
                if bad:
                    raise AssertionError(f"{name}: {bad[:3]} differ after the round trip")
                injected = read_stats(stats_path)
                n = injected.slowdown + injected.reset + injected.stall + injected.lost
                times[name].append(seconds)
                counts[name].append(n)
                print(f"  {kind:6} {name:34} rep {rep}: save {seconds:6.2f} s, {n} fault(s)", flush=True)
    return {name: (statistics.median(times[name]), int(statistics.median(counts[name]))) for name in FAULTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="rclone,moto,gcs")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between the saves and the loads")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="round trip added by the proxy (0: none)")
    parser.add_argument(
        "--bandwidth-mbs", type=float, default=80.0, help="MB/s per connection and direction (0: no cap)"
    )
    parser.add_argument(
        "--bcp",
        action="append",
        default=None,
        metavar="OPTIONS",
        help="bcp URI options to compare, e.g. 'part_size=8MiB&concurrency=16' (repeatable; '' = the defaults)",
    )
    parser.add_argument("--faults", action="store_true", help="measure bcp saves through injected faults instead")
    parser.add_argument("--fault-timeout", type=float, default=10.0, help="bcp's timeout= option in --faults runs")
    parser.add_argument("--fault-options", default="", help="more bcp URI options in --faults runs")
    args = parser.parse_args()
    state = make_state(args.gib)
    size = nbytes(state)
    link = (
        f"through a proxy adding {args.latency_ms:g} ms per round trip, {args.bandwidth_mbs:g} MB/s per connection"
        if args.latency_ms or args.bandwidth_mbs
        else "straight to the server (loopback)"
    )
    print(f"state: {len(state)} tensors, {size / 2**30:.2f} GiB; {link}; medians of {args.repeats}")
    if args.faults:
        fault_tables = {kind: run_faults(kind, state, args) for kind in args.servers.split(",")}
        print()
        print(f"| server | fault | save s | slowdown | faults per save |  (timeout={args.fault_timeout:g} s)")
        print("|---|---|---|---|---|")
        for kind, fault_rows in fault_tables.items():
            clean = fault_rows["none"][0]
            for name, (seconds, count) in fault_rows.items():
                print(f"| {kind} | {name} | {seconds:.2f} | {seconds / clean:.2f}x | {count} |")
        return
    variants = {("bcp " + o if o else "bcp"): o for o in (args.bcp or [""])}
    tables = {kind: run_server(kind, state, args, variants) for kind in args.servers.split(",")}
    print()
    print("| server | case | save s | save GB/s | load s (first) | load GB/s | load s (again) | load GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, rows in tables.items():
        for case, (save, load, warm) in rows.items():
            print(
                f"| {kind} | {case} | {save:.2f} | {size / save / 1e9:.3f} | {load:.2f} | {size / load / 1e9:.3f} "
                f"| {warm:.2f} | {size / warm / 1e9:.3f} |"
            )
    print()
    print(
        "| server | bcp case | save: vs torch+fsspec | vs DCP | first load: vs torch+fsspec | vs DCP "
        "| load again: vs torch+fsspec | vs DCP |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, rows in tables.items():
        n, d = rows["torch+fsspec"], rows["DCP fsspec"]
        for case in variants:
            b = rows[case]
            cells = " | ".join(f"{n[i] / b[i]:.2f}x | {d[i] / b[i]:.2f}x" for i in range(3))
            print(f"| {kind} | {case} | {cells} |")


if __name__ == "__main__":
    main()
