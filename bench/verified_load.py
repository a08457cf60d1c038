"""Warm loads, every block verified, beside a memcpy of the same bytes: one process,
interleaved round by round, medians.

    python bench/verified_load.py [--shape transformer|equal|both] [--layers 6] [--rounds 7]

Rows, for each shape (a Llama-shaped state with AdamW moments and step scalars, and 48
equal float32 tensors of the same bytes):

* ``memcpy into warm buffers``: ``Tensor.copy_`` tensor by tensor into buffers copied
  into once before (bench/memcpy_limit.py), the limit a load from memory is held to;
  and the same on one thread: its CPU seconds per GB are the reference when the machine
  is busy (a 2-thread copy waits for its second thread, a load's readers do not);
* ``preadv of the data files, no checksum``: the bare copy out of the page cache or
  tmpfs that any load from there pays (2 MiB pieces into one warm buffer);
* ``crc32c (<impl>), 1 thread / 2 threads``: the checksum alone over the state's bytes,
  one call per tensor, for each CRC32C implementation importable here (the ``crc32c``
  package, ``crc32c_rs``; what ``bcp.metadata.checksum`` uses is marked), and XXH3 from
  ``xxhash`` where installed, for comparison only (the format's checksum is CRC32C);
* ``bcp load (warm page cache)`` and ``bcp load (/dev/shm)``: ``bcp.load`` into the
  same destination tensors, every block verified.

Each row prints its median seconds, GB/s, its ratio to the memcpy of the same round set,
CPU seconds (all threads) per GB, and the 1-thread memcpy's CPU seconds over the row's;
the load average before and after is printed, since
the machine this was written on is shared (compare ratios from one run, never numbers
across runs).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memcpy_limit import WarmMemcpy  # bench/ is not a package
from peers import warm_cache


def transformer_state(layers: int, d: int, vocab: int, ffn: int) -> dict:
    """Embedding, per layer q/k/v/o (with biases), gate/up/down, two norms; for each
    parameter AdamW ``exp_avg``, ``exp_avg_sq`` and a 0-dim float32 ``step``."""
    import torch

    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            shapes[p + f"attn.{m}.weight"] = (d, d)
            shapes[p + f"attn.{m}.bias"] = (d,)
        shapes[p + "mlp.gate.weight"] = (ffn, d)
        shapes[p + "mlp.up.weight"] = (ffn, d)
        shapes[p + "mlp.down.weight"] = (d, ffn)
        shapes[p + "norm1.weight"] = (d,)
        shapes[p + "norm2.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    state = {}
    for name, shape in shapes.items():
        for kind in ("", ".exp_avg", ".exp_avg_sq"):
            state[f"model.{name}" if not kind else f"optim.{name}{kind}"] = torch.empty(shape).uniform_(-1, 1)
        state[f"optim.{name}.step"] = torch.tensor(10.0)
    return state


def equal_state(nbytes: int, tensors: int = 48) -> dict:
    import torch

    cols = 2736
    rows = max(1, nbytes // tensors // cols // 4)
    return {f"layer{i:02d}.weight": torch.empty(rows, cols).uniform_(-1, 1) for i in range(tensors)}


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def one_thread(fn: Callable[[], object]) -> None:
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fn()
    finally:
        torch.set_num_threads(n)


_scratch: dict[int, memoryview] = {}


def read_files(path: str, piece: int = 2 << 20) -> None:
    """Every file under ``path`` read with preadv into one warm buffer, in 2 MiB pieces
    (the bare copy out of memory that a load cannot beat)."""
    for d, _s, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                buf = _scratch.get(size)
                if buf is None:
                    buf = _scratch[size] = memoryview(bytearray(size))
                for at in range(0, size, piece):
                    os.preadv(fd, [buf[at : at + piece]], at)
            finally:
                os.close(fd)


def checksum_step(fn: Callable, views: list, threads: int) -> Callable[[], None]:
    """The checksum alone over ``views`` (one call each), on ``threads`` threads."""
    if threads == 1:
        return lambda: [fn(v) for v in views]
    share = [views[i::threads] for i in range(threads)]

    def run() -> None:
        ts = [threading.Thread(target=lambda s=s: [fn(v) for v in s]) for s in share]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return run


def checksums() -> dict[str, Callable]:
    """CRC32C implementations importable here (and XXH3, for comparison)."""
    from bcp.metadata import checksum

    out: dict[str, Callable] = {}
    for module, attr in (("crc32c", "crc32c"), ("crc32c_rs", "crc32c")):
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError:
            continue
        used = " (bcp's)" if getattr(checksum, "IMPLEMENTATION", "crc32c") == module else ""
        out[f"crc32c ({module}){used}"] = fn
    try:
        import xxhash

        out["xxh3-64 (xxhash, comparison only)"] = xxhash.xxh3_64_intdigest
        out["xxh3-128 (xxhash, comparison only)"] = xxhash.xxh3_128_intdigest
    except ImportError:
        pass
    return out


def measure(label: str, state: dict, rounds: int, root: str, shm: str) -> None:
    import bcp

    nbytes = state_bytes(state)
    uris = {"bcp load (warm page cache)": os.path.join(root, label), "bcp load (/dev/shm)": os.path.join(shm, label)}
    for uri in uris.values():
        bcp.save(state, uri, overwrite=True)
        warm_cache(uri)
    dst = {k: v.clone() for k, v in state.items()}
    memcpy = WarmMemcpy(state)
    views = [memoryview(t.numpy()).cast("B") for t in state.values() if t.numel()]
    steps: dict[str, Callable[[], object]] = {"memcpy into warm buffers": memcpy._copy}
    steps["memcpy into warm buffers, 1 thread"] = lambda: one_thread(memcpy._copy)
    for name, uri in uris.items():
        steps[f"preadv of the data files, no checksum ({name[10:-1]})"] = lambda uri=uri: read_files(uri)
    for name, fn in checksums().items():
        for threads in (1, 2):
            steps[f"{name}, {threads} thread{'s' if threads > 1 else ''}"] = checksum_step(fn, views, threads)
    for name, uri in uris.items():
        bcp.load(dst, uri)  # first call: imports, plan caches
        steps[name] = lambda uri=uri: bcp.load(dst, uri)
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    load_before = os.getloadavg()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            c0, t0 = time.process_time(), time.perf_counter()
            steps[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    base = statistics.median(wall["memcpy into warm buffers"])
    print(f"\n{label}: {len(state)} tensors, {nbytes / 2**30:.2f} GiB; {rounds} rounds")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    ref = statistics.median(cpu["memcpy into warm buffers, 1 thread"])
    print("| case | median s | GB/s | x memcpy speed | CPU s per GB | x 1-thread memcpy CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        med, c = statistics.median(wall[name]), statistics.median(cpu[name])
        gb = nbytes / 1e9
        print(f"| {name} | {med:.3f} | {gb / med:.2f} | {base / med:.2f}x | {c / gb:.3f} | {ref / c:.2f}x |")
    for uri in uris.values():
        shutil.rmtree(uri, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("transformer", "equal", "both"), default="both")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=2752)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="a directory on a disk (the page-cache case)")
    ap.add_argument("--shm", default="/dev/shm")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="bcp-verified-load-", dir=args.dir or "/var/tmp")
    shm = tempfile.mkdtemp(prefix="bcp-verified-load-", dir=args.shm)
    try:
        tf = transformer_state(args.layers, args.d, args.vocab, args.ffn)
        if args.shape in ("transformer", "both"):
            measure("transformer", tf, args.rounds, root, shm)
        if args.shape in ("equal", "both"):
            eq = equal_state(state_bytes(tf))
            del tf
            measure("48 equal tensors", eq, args.rounds, root, shm)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
