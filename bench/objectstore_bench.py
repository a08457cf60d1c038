"""bcp through object stores, beside the ways people do it today, on the same servers.

Servers (real, on 127.0.0.1): rclone serve s3 (file-backed), moto_server (in
memory), gcp-storage-emulator (in memory). Cases, each saving and then loading the
same state (``--gib``, default 1), repeated ``--repeats`` times, medians reported.
Each repetition saves with every case, flushes the server's disk (``os.sync``) and
waits ``--settle`` seconds, then loads with every case twice: the first load is
what a resuming job sees (on rclone, a cold read from its disk), the second shows
the client and protocol with the server's cache warm. Cases:

* bcp:         ``bcp.save`` / ``bcp.load`` (parallel multipart or composite uploads,
               parallel ranged reads)
* torch+fsspec: ``torch.save`` into an s3fs/gcsfs file object, ``torch.load`` from one
* DCP fsspec:  ``torch.distributed.checkpoint`` with FsspecWriter/FsspecReader
               (``thread_count=4``). torch 2.13 exposes these only from the private
               module ``torch.distributed.checkpoint._fsspec_filesystem``: imported
               here, in a benchmark, never in the library.

    python bench/objectstore_bench.py [--gib 1] [--repeats 3] [--servers rclone,moto,gcs]

Prints one table per server and the ratios the targets are about (bcp save vs the
naive save, vs DCP's save).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch

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


def bcp_uri(kind: str, endpoint: str, bucket: str, path: str) -> str:
    if kind == "gcs":
        return f"gs://{bucket}/{path}?endpoint_url={endpoint}&anon=true&conditional_writes=false"
    extra = "&conditional_writes=false" if kind == "rclone" else ""
    return f"s3://{bucket}/{path}?endpoint_url={endpoint}{extra}"


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _path(case: str, rep: int) -> str:
    return f"{case.replace(' ', '-').replace('+', '-')}-{rep}"


def save_case(case, kind, server, bucket, fs, proto, state, rep) -> float:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    path = _path(case, rep)
    if case == "bcp":
        return timed(lambda: bcp.save(state, bcp_uri(kind, server.endpoint, bucket, path)))
    if case == "torch+fsspec":

        def naive_save():
            with fs.open(f"{bucket}/{path}.pt", "wb") as f:
                torch.save(state, f)

        return timed(naive_save)
    writer = FsspecWriter(f"{proto}://{bucket}/{path}", thread_count=4, **fs_options(kind, server.endpoint))
    return timed(lambda: dcp_save(state, storage_writer=writer))


def load_case(case, kind, server, bucket, fs, proto, template, rep) -> tuple[float, dict]:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    path = _path(case, rep)
    if case == "bcp":
        return timed(lambda: bcp.load(template, bcp_uri(kind, server.endpoint, bucket, path))), template
    if case == "torch+fsspec":
        box = {}

        def naive_load():
            with fs.open(f"{bucket}/{path}.pt", "rb") as f:
                box["out"] = torch.load(f, weights_only=True)

        seconds = timed(naive_load)
        return seconds, box["out"]
    out = {k: torch.empty_like(v) for k, v in template.items()}
    reader = FsspecReader(f"{proto}://{bucket}/{path}", **fs_options(kind, server.endpoint))
    return timed(lambda: dcp_load(out, storage_reader=reader)), out


def run_server(kind: str, state: dict, repeats: int, settle: float) -> dict[str, tuple[float, ...]]:
    template = {k: torch.empty_like(v) for k, v in state.items()}
    results: dict[str, list[tuple[float, float, float]]] = {"bcp": [], "torch+fsspec": [], "DCP fsspec": []}
    with running(kind) as server:
        bucket = f"bench{uuid.uuid4().hex[:8]}"
        make_bucket(server, bucket)
        fs, proto = fs_for(kind, server.endpoint)
        for rep in range(repeats):
            saves: dict[str, float] = {}
            for case in results:  # all saves first, then let the server's disk settle, then all loads
                saves[case] = save_case(case, kind, server, bucket, fs, proto, state, rep)
            os.sync()
            time.sleep(settle)
            for case in list(results):
                load, out = load_case(case, kind, server, bucket, fs, proto, template, rep)
                bad = [k for k in state if not torch.equal(out[k], state[k])]
                if bad:
                    raise AssertionError(f"{case} on {kind}: {bad[:3]} differ after the round trip")
                del out
                warm, out = load_case(case, kind, server, bucket, fs, proto, template, rep)
                del out
                results[case].append((saves[case], load, warm))
                print(
                    f"  {kind:6} {case:13} rep {rep}: save {saves[case]:6.2f} s  load {load:6.2f} s  "
                    f"warm load {warm:6.2f} s",
                    flush=True,
                )
            for case in results:
                for target in (f"{bucket}/{_path(case, rep)}", f"{bucket}/{_path(case, rep)}.pt"):
                    try:
                        fs.rm(target, recursive=True)
                    except FileNotFoundError:
                        pass
    return {case: tuple(statistics.median(r[i] for r in rs) for i in range(3)) for case, rs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="rclone,moto,gcs")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between the saves and the loads")
    args = parser.parse_args()
    state = make_state(args.gib)
    size = nbytes(state)
    print(f"state: {len(state)} tensors, {size / 2**30:.2f} GiB; medians of {args.repeats}")
    tables = {kind: run_server(kind, state, args.repeats, args.settle) for kind in args.servers.split(",")}
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
        "| server | save: bcp vs torch+fsspec | bcp vs DCP | first load: vs torch+fsspec | vs DCP "
        "| load again: vs torch+fsspec | vs DCP |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, rows in tables.items():
        b, n, d = rows["bcp"], rows["torch+fsspec"], rows["DCP fsspec"]
        cells = " | ".join(f"{n[i] / b[i]:.2f}x | {d[i] / b[i]:.2f}x" for i in range(3))
        print(f"| {kind} | {cells} |")


if __name__ == "__main__":
    main()
