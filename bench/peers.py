"""bcp against its peers on one state, in one run, with the raw limits beside them.

Every case runs in a fresh subprocess (clean page cache accounting and peak RSS),
repeated; the table shows medians and ratios to the raw limits measured in the same
run. Cold-cache loads drop the checkpoint's pages with posix_fadvise(DONTNEED).

    python bench/peers.py [--shape both] [--gib 2] [--repeats 3] [--dir /tmp/bcp-peers] [--only CASE,...]

``--shape`` (bench/shapes.py): ``equal`` is 48 equal float32 tensors; ``transformer``
a Llama-shaped ``{"model": ..., "optim": ...}`` state of the same ``--gib`` (AdamW
moments and a step per parameter); ``both`` (the default) runs the two shapes' cases
interleaved (repeat by repeat, case by case, shape by shape) and prints one table each.
safetensors saves the tensors of a nested state under dotted keys (it takes one flat dict).

The raw write limit is the state's own memory (each tensor's page-aligned interior)
written with O_DIRECT in 64 MiB ``pwritev`` requests into a new file, then fsync: the
bytes a save writes, from where they lie. On a VM that is not what one reused 64 MiB
buffer gives (printed beside it): that ran 0.7x to 1.45x as fast as the state's memory
in runs minutes apart. The ``bcp`` case makes ``--save-pairs`` sync saves, each beside
such a raw write, in alternating order, and compares their medians.

Its cold loads are measured the same way: ``--load-pairs`` rounds, in an order that
rotates, of a bcp load, a raw read of bcp's own data files into the same touched memory
(O_DIRECT, one thread, 64 MiB requests; and buffered, 4 threads, 16 MiB), and a cold
safetensors load of the same state, each after a sync and a pause. The cold load's ratio
is to the faster raw read beside it (a load compared with a raw read taken minutes apart
gave 0.36x in one run and 0.82x in the next).

The ``bcp`` case times ``async_save`` in one process beside copies of the same tensors:
the first call (it allocates the staging pool) beside a memcpy into freshly allocated
memory, and ``--async-calls`` steady-state calls each beside a memcpy into warm (touched,
reused) memory; the table gives each blocking time's ratio to the memcpy beside it.

The ``memory`` case loads from memory: the page cache (warm) and tmpfs (``--shm``,
default /dev/shm), each beside a memcpy of the same bytes into warm buffers and the bare
verified read of the same files (``preadv`` + CRC32C of each 2 MiB piece in cache, 2
threads: what copy and checksum cost on these cores), interleaved round by round in one
process (``--rounds``); their ratios are to that memcpy and to that verified read.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # bench/ is not a package
from memcpy_limit import VerifiedReads, WarmMemcpy, fresh_memcpy_seconds, verified_reads_into

SHAPES = ("equal", "transformer")

BYTECHECKPOINT_PATH = os.environ.get("BYTECHECKPOINT_PATH", "/tmp/bytecp/site:/tmp/bytecp/deps")


# -- helpers run inside the case subprocess ------------------------------------------------


def make_state(gib: float, shape: str = "equal") -> dict:
    """The state of a case: bench/shapes.py's ``equal`` (48 tensors) or ``transformer``."""
    if shape == "transformer":
        return shapes.transformer_state(gib)
    return shapes.equal_state(gib)


def nbytes(state) -> int:
    return shapes.nbytes(state)


def describe(shape: str, gib: float) -> str:
    if shape == "transformer":
        s = shapes.transformer_spec(gib)
        return (
            f"transformer: {s.tensors()} tensors (model {s.n_params}, AdamW exp_avg/exp_avg_sq/step each; "
            f"{s.layers} layers, d={s.d}, f={s.f}, vocab {s.vocab})"
        )
    return "equal: 48 float32 tensors"


def fsync_tree(path: str) -> None:
    for d, _s, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def warm_cache(path: str) -> None:
    """Read every file through the page cache (a bcp save bypasses it with O_DIRECT)."""
    for d, _s, files in os.walk(path):
        for name in files:
            with open(os.path.join(d, name), "rb") as fh:
                while fh.read(64 << 20):
                    pass


def drop_cache(path: str) -> None:
    """Evict the files' clean pages from the page cache (no root needed)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _s, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def empty_like(state, touch=True):
    """The nested state with each tensor replaced by an empty one of its shape (zeroed:
    touched, as a model's existing tensors are)."""
    import torch

    return shapes.map_tensors(state, lambda v: torch.zeros_like(v) if touch else torch.empty_like(v))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- cases: each returns a dict of measurements --------------------------------------------


def state_requests(state, chunk: int = 64 << 20) -> tuple[list[list[memoryview]], int]:
    """The state's own memory as O_DIRECT ``pwritev`` requests of ``chunk`` bytes: each
    tensor's page-aligned interior (the few KiB at its unaligned edges, and tensors under
    a page, left out), laid end to end; and the bytes they hold."""
    import torch

    page = mmap.PAGESIZE
    views = []
    for t in shapes.tensors(state):
        u = t.detach().reshape(-1).view(torch.uint8)  # the tensor's own memory (shapes' are dense)
        mv = memoryview(u.numpy()).cast("B")
        head = (-u.data_ptr()) % page
        n = (len(mv) - head) // page * page if len(mv) > head else 0
        if n:
            views.append(mv[head : head + n])
    requests: list[list[memoryview]] = [[]]
    room = chunk
    for v in views:
        while len(v):
            if not room or len(requests[-1]) == 1024:  # IOV_MAX parts a call
                requests.append([])
                room = chunk
            part = v[:room]
            requests[-1].append(part)
            room -= len(part)
            v = v[len(part) :]
    return requests, sum(map(len, views))


def raw_write(f: str, requests: list[list[memoryview]]) -> None:
    """Write ``requests`` into a new file ``f`` with O_DIRECT, one after another, then fsync."""
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    off = 0
    for r in requests:
        total = sum(map(len, r))
        if os.pwritev(fd, r, off) != total:  # a regular file writes all or fails (a full disk)
            raise OSError(f"short O_DIRECT write at offset {off} of {f}")
        off += total
    os.fsync(fd)
    os.close(fd)


def raw_write_seconds(f: str, state, requests, written: int) -> float:
    """One raw write of the state's memory, per state byte (the skipped edges scaled in)."""
    seconds = timed(lambda: raw_write(f, requests)) * nbytes(state) / written
    os.remove(f)
    return seconds


def case_raw(path, state, _args):
    """O_DIRECT sequential write (from the state's memory, and from one reused 64 MiB
    buffer) and read (into touched tensors of the state's shapes, and into that buffer) of
    the state's byte count, and a warm memcpy."""
    import torch

    size = nbytes(state)
    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    f = os.path.join(path, "raw.bin")
    os.makedirs(path, exist_ok=True)

    def write_buffer():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, size, chunk):
            os.pwrite(fd, memoryview(buf)[: min(chunk, size - off) // 4096 * 4096 or 4096], off)
        os.fsync(fd)
        os.close(fd)

    def read_buffer():
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        for off in range(0, size, chunk):
            os.preadv(fd, [memoryview(buf)], off)
        os.close(fd)

    # the read limit: into touched tensors of the state's shapes, as bcp's loads fill them
    into, got = state_requests(empty_like(state), chunk)

    def read_state():
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        off = 0
        for r in into:
            off += os.preadv(fd, r, off)
        os.close(fd)

    w = raw_write_seconds(f, state, *state_requests(state, chunk))
    os.sync()
    wb = timed(write_buffer)
    r = timed(read_state) * size / got
    rb = timed(read_buffer)
    m = WarmMemcpy(list(shapes.tensors(state)))()
    os.remove(f)
    del torch
    return {
        RAW_WRITE: w,
        RAW_WRITE_BUFFER: wb,
        RAW_READ: r,
        RAW_READ_BUFFER: rb,
        "memcpy into warm buffers": m,
    }


#: the raw write limit: the state's own memory written to a new file (what a save must do)
RAW_WRITE = "raw O_DIRECT write"
#: the same from one 64 MiB buffer written over and over (the limit before issue 37's end:
#: faster or slower than the state's memory on a VM, by up to 1.4x either way)
RAW_WRITE_BUFFER = "raw O_DIRECT write, one 64 MiB buffer reused"
#: the raw read limit: into touched tensors of the state's shapes (what a load fills)
RAW_READ = "raw O_DIRECT read"
#: the same into one 64 MiB buffer read over and over (the read limit before issue 37's end)
RAW_READ_BUFFER = "raw O_DIRECT read, one 64 MiB buffer reused"
#: bcp's sync saves and raw writes of the same memory, interleaved in the bcp case
SAVE_BESIDE = "raw O_DIRECT write (beside the bcp saves)"


def case_bcp(path, state, args):
    import torch

    import bcp

    uri = os.path.join(path, "bcp")
    out = {}
    base = rss()
    # the sync saves, each beside a raw write of the same memory (a new file, fsync), in
    # alternating order: medians (the disk's speed swings from minute to minute)
    requests = state_requests(state)
    saves: list[float] = []
    raws: list[float] = []
    for i in range(args.save_pairs):
        for step in ("save", "raw") if i % 2 == 0 else ("raw", "save"):
            os.sync()
            time.sleep(min(args.settle, 1.0))
            if step == "raw":
                raws.append(raw_write_seconds(os.path.join(path, "raw.bin"), state, *requests))
                continue
            dest = uri if i == 0 else f"{uri}-save{i}"  # the loads below read the first
            saves.append(timed(lambda dest=dest: bcp.save(state, dest, overwrite=True)))
            if i:
                shutil.rmtree(dest)
    out["bcp save"] = statistics.median(saves)
    out[SAVE_BESIDE] = statistics.median(raws)
    out["bcp save: peak extra memory"] = peak_rss() - base
    dst = empty_like(state)
    out.update(cold_loads_beside(path, uri, state, dst, args))
    warm_cache(uri)
    out["bcp load (warm cache)"] = timed(lambda: bcp.load(dst, uri))

    # reshard: what rank 1 of 3 reads when this checkpoint is loaded row-sharded over 3 ranks
    # (tensors of fewer than 3 rows, the 0-dim steps among them, are read whole)
    def row_shard(t):
        if t.dim() == 0 or t.shape[0] < 3:
            return torch.zeros_like(t)
        rows = t.shape[0]
        lo, hi = rows // 3, 2 * rows // 3
        local = torch.zeros((hi - lo, *t.shape[1:]), dtype=t.dtype)
        return bcp.TensorShard(local, tuple(t.shape), (lo,) + (0,) * (t.dim() - 1))

    part = shapes.map_tensors(state, row_shard)
    leaves = [p.local if isinstance(p, bcp.TensorShard) else p for p in _leaves(part)]
    part_bytes = sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
    drop_cache(uri)
    seconds = timed(lambda: bcp.load(part, uri))
    out["bcp reshard load, 1 of 3 row shards (cold cache)"] = seconds * nbytes(state) / part_bytes  # per state byte
    # async: the first call in a process allocates the staging pool; later calls reuse it.
    # Each beside a copy of the same tensors: into fresh memory (first), into warm memory (steady)
    out[ASYNC_FRESH] = fresh_memcpy_seconds(list(shapes.tensors(state)))
    h = bcp.async_save(state, uri + "-async", overwrite=True)
    out[ASYNC_FIRST] = h.blocking_seconds
    out["bcp async_save total (first call)"] = h.wait().seconds
    warm = WarmMemcpy(list(shapes.tensors(state)))
    samples: dict[str, list[float]] = {ASYNC_WARM: [], ASYNC_STEADY: [], "bcp async_save total (steady state)": []}
    for _ in range(args.async_calls):
        samples[ASYNC_WARM].append(warm())
        h = bcp.async_save(state, uri + "-async", overwrite=True)
        samples[ASYNC_STEADY].append(h.blocking_seconds)
        samples["bcp async_save total (steady state)"].append(h.wait().seconds)
    out.update({k: statistics.median(v) for k, v in samples.items()})
    return out


#: cold loads measured in the same minutes: each bcp load beside raw reads of bcp's own
#: files and a safetensors load of the same state, in rotating order (the disk's speed
#: swings 5-10x from minute to minute; one load compared with a raw read taken a minute
#: apart gave 0.36x in one run and 0.82x in the next)
COLD_LOAD = "bcp load (cold cache)"
COLD_DIRECT = "raw read of bcp's files, O_DIRECT, 1 thread (beside)"
COLD_THREADS = "raw read of bcp's files, buffered, 4 threads (beside)"
COLD_SAFETENSORS = "safetensors load_file+copy (cold, beside bcp's)"


def file_requests(files: list[str], into: list[memoryview], chunk: int) -> list[tuple[str, int, list[memoryview]]]:
    """Reads of every byte of ``files`` (whole pages) into the views ``into`` laid end to
    end (a load's touched destinations): (file, offset, views) of up to ``chunk`` bytes."""
    page = mmap.PAGESIZE
    views = iter(into)
    left = memoryview(b"")
    jobs = []
    for f in files:
        size = -(-os.path.getsize(f) // page) * page
        off = 0
        while off < size:
            want, parts = min(chunk, size - off), []
            while want:
                if not len(left):
                    left = next(views)
                part = left[:want]
                parts.append(part)
                left, want = left[len(part) :], want - len(part)
            jobs.append((f, off, parts))
            off += sum(map(len, parts))
    return jobs


def raw_reads(jobs: list[tuple[str, int, list[memoryview]]], *, direct: bool, threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        f, off, parts = job
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            os.preadv(fd, parts, off)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))


def cold_loads_beside(path, uri, state, dst, args) -> dict[str, float]:
    """``--load-pairs`` rounds of: a cold bcp load, the two raw reads of bcp's files into
    the same touched memory, and a cold safetensors load of the same state, in an order
    that rotates each round, each after a sync and a pause; their medians."""
    import bcp

    files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(uri) for f in fs)
    data = [f for f in files if os.path.getsize(f) >= 1 << 20]  # the tensor bytes, not the metadata
    views, _n = state_requests(dst, 64 << 20)
    flat = [v for r in views for v in r]
    need = sum(-(-os.path.getsize(f) // mmap.PAGESIZE) * mmap.PAGESIZE for f in data)
    if sum(map(len, flat)) < need:  # the interiors of small tensors are left out: top up from spare memory
        spare = mmap.mmap(-1, need - sum(map(len, flat)) + mmap.PAGESIZE)
        spare.write(b"\1" * len(spare))
        flat.append(memoryview(spare))
    direct, threaded = file_requests(data, flat, 64 << 20), file_requests(data, flat, 16 << 20)
    steps = {
        COLD_LOAD: (files, lambda: bcp.load(dst, uri)),
        COLD_DIRECT: (data, lambda: raw_reads(direct, direct=True, threads=1)),
        COLD_THREADS: (data, lambda: raw_reads(threaded, direct=False, threads=4)),
    }
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        load_file = None
    if load_file is not None:
        flat_state, flat_dst = shapes.flatten(state), shapes.flatten(dst)
        f = os.path.join(path, "beside.safetensors")
        save_file(flat_state, f)

        def safetensors_load():
            for k, v in load_file(f).items():
                flat_dst[k].copy_(v)

        steps[COLD_SAFETENSORS] = ([f], safetensors_load)
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for i in range(args.load_pairs):
        for k in names[i % len(names) :] + names[: i % len(names)]:
            for f in steps[k][0]:
                drop_cache(f)
            os.sync()
            time.sleep(min(args.settle, 1.0))
            times[k].append(timed(steps[k][1]))
    return {k: statistics.median(v) for k, v in times.items()}


#: the async_save rows and the memcpy each is compared with (measured beside it in the bcp case)
ASYNC_FIRST = "bcp async_save blocking (first call)"
ASYNC_STEADY = "bcp async_save blocking (steady state)"
ASYNC_FRESH = "memcpy into fresh memory (beside async first call)"
ASYNC_WARM = "memcpy into warm memory (beside async steady state)"
ASYNC_BESIDE = {ASYNC_FIRST: ASYNC_FRESH, ASYNC_STEADY: ASYNC_WARM}


def _leaves(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _leaves(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _leaves(v)
    else:
        yield state


#: rows of the memory case: a load, and the memcpy of the same bytes measured beside it
MEMORY_MEMCPY = "memcpy into warm buffers (beside the in-memory loads)"
MEMORY_LOADS = ("bcp load (warm page cache)", "bcp load (/dev/shm)")
#: each in-memory load's own limit: the bare verified read of its files (memcpy_limit.VerifiedReads)
MEMORY_LIMITS = {
    MEMORY_LOADS[0]: "verified preadv, 2 threads, no planning (page cache)",
    MEMORY_LOADS[1]: "verified preadv, 2 threads, no planning (/dev/shm)",
}
#: the same into the load's own destination tensors, each tensor's bytes where the load puts them
MEMORY_OWN_LIMITS = {
    MEMORY_LOADS[0]: "the same into the state's tensors (page cache)",
    MEMORY_LOADS[1]: "the same into the state's tensors (/dev/shm)",
}


def case_memory(path, state, args):
    """bcp loads of bytes already in memory, each round: the page cache (a warm file on
    disk), tmpfs, a memcpy of the same bytes into warm buffers, and the bare verified read
    of each load's files (``preadv`` + CRC32C per 2 MiB piece on 2 threads), in rotating
    order; medians of the rounds."""
    import bcp

    shm = os.path.join(args.shm, f"bcp-peers-{os.getpid()}")
    uris = {MEMORY_LOADS[0]: os.path.join(path, "bcp"), MEMORY_LOADS[1]: shm}
    try:
        for uri in uris.values():
            bcp.save(state, uri, overwrite=True)
            warm_cache(uri)
        dst = empty_like(state)
        memcpy = WarmMemcpy(list(shapes.tensors(state)))
        steps = {MEMORY_MEMCPY: memcpy}
        for label, uri in uris.items():
            steps[MEMORY_LIMITS[label]] = VerifiedReads(uri)
            steps[MEMORY_OWN_LIMITS[label]] = verified_reads_into(uri, shapes.flatten(dst))
        for label, uri in uris.items():
            bcp.load(dst, uri)  # first call: imports, plan caches
            steps[label] = lambda uri=uri: timed(lambda: bcp.load(dst, uri))
        samples: dict[str, list[float]] = {k: [] for k in steps}
        names = list(steps)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(steps[name]())
        return {k: statistics.median(v) for k, v in samples.items()}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def case_torch(path, state, _args):
    import torch

    f = os.path.join(path, "state.pt")

    def save():
        with open(f, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    out = {"torch.save+fsync": timed(save)}
    warm_cache(f)
    out["torch.load (warm cache)"] = timed(lambda: torch.load(f, weights_only=True))
    drop_cache(f)
    out["torch.load (cold cache)"] = timed(lambda: torch.load(f, weights_only=True))
    return out


def case_dcp(path, state, _args):
    import torch.distributed.checkpoint as dcp

    out = {}
    for threads in (1, 2):
        d = os.path.join(path, f"dcp{threads}")
        shutil.rmtree(d, ignore_errors=True)

        def save(d=d, threads=threads):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(d, thread_count=threads, sync_files=True))

        out[f"DCP save thread_count={threads}"] = timed(save)
    d = os.path.join(path, "dcp2")
    dst = empty_like(state)
    warm_cache(d)
    out["DCP load (warm cache)"] = timed(lambda: dcp.load(dst, storage_reader=dcp.FileSystemReader(d)))
    drop_cache(d)
    out["DCP load (cold cache)"] = timed(lambda: dcp.load(dst, storage_reader=dcp.FileSystemReader(d)))
    d = os.path.join(path, "dcp-async")
    for label in ("first call", "second call"):
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(d, thread_count=2, sync_files=True))
        except Exception as e:  # noqa: BLE001 - reported as a note
            out["DCP async_save: note"] = f"{type(e).__name__}: {e}"[:160]
            break
        out[f"DCP async_save blocking ({label}, default stager)"] = time.perf_counter() - t0
        fut.result()
        out[f"DCP async_save total ({label}, default stager)"] = time.perf_counter() - t0
    return out


def case_safetensors(path, state, _args):
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "state.safetensors")
    state = shapes.flatten(state)  # one flat dict of tensors: dotted keys for a nested state

    def save():
        save_file(state, f)
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out = {"safetensors save_file+fsync": timed(save)}
    dst = empty_like(state)

    def load():  # load_file maps lazily: copy into the model's tensors, as a load would
        for k, v in load_file(f).items():
            dst[k].copy_(v)

    warm_cache(f)
    out["safetensors load_file+copy (warm cache)"] = timed(load)
    drop_cache(f)
    out["safetensors load_file+copy (cold cache)"] = timed(load)
    return out


def case_bytecheckpoint(path, state, _args):
    for p in BYTECHECKPOINT_PATH.split(":"):
        sys.path.insert(0, p)
    import torch
    import torch.distributed as dist

    try:
        import bytecheckpoint
    except Exception as e:  # noqa: BLE001 - an optional peer: reported as a note
        return {"ByteCheckpoint: note": f"not importable: {type(e).__name__}: {e}"[:160]}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Module()
    for k, v in shapes.flatten(state).items():
        model.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v, requires_grad=False))
    d = os.path.join(path, "bytecp")
    out = {}
    try:
        out["ByteCheckpoint save (ddp)"] = timed(lambda: bytecheckpoint.save(d, {"model": model}, framework="ddp"))
        warm_cache(d)
        out["ByteCheckpoint load (ddp, warm cache)"] = timed(
            lambda: bytecheckpoint.load(d, {"model": model}, framework="ddp")
        )
        drop_cache(d)
        out["ByteCheckpoint load (ddp, cold cache)"] = timed(
            lambda: bytecheckpoint.load(d, {"model": model}, framework="ddp")
        )
    except Exception as e:  # noqa: BLE001 - reported as a note
        out["ByteCheckpoint: note"] = f"failed: {type(e).__name__}: {e}"[:160]
    dist.destroy_process_group()
    return out


CASES = {
    "raw": case_raw,
    "bcp": case_bcp,
    "memory": case_memory,
    "torch": case_torch,
    "dcp": case_dcp,
    "safetensors": case_safetensors,
    "bytecheckpoint": case_bytecheckpoint,
}


def run_case(name: str, args) -> None:
    path = os.path.join(args.dir, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    state = make_state(args.gib, args.shape)
    result = CASES[name](path, state, args)
    result["_bytes"] = nbytes(state)
    print("RESULT " + json.dumps(result))
    shutil.rmtree(path, ignore_errors=True)


# -- orchestration ------------------------------------------------------------------------------


def ratio_of(k: str, med: dict[str, float]) -> str:
    """The ratio printed beside row ``k``: to the limit or the memcpy it is compared with."""
    raw_w, raw_r = med.get(RAW_WRITE), med.get("raw O_DIRECT read")
    memcpy, sync = med.get("memcpy into warm buffers"), med.get("bcp save")
    v = med[k]
    if k in ASYNC_BESIDE and med.get(ASYNC_BESIDE[k]):
        return f"{v / med[ASYNC_BESIDE[k]]:.2f}x the {ASYNC_BESIDE[k].split(' (')[0]} time"
    if k in (COLD_LOAD, COLD_SAFETENSORS) and med.get(COLD_DIRECT):
        fastest = min(med[COLD_DIRECT], med.get(COLD_THREADS, med[COLD_DIRECT]))
        of_case = f" ({raw_r / v:.2f}x the raw case's)" if raw_r else ""
        return f"{fastest / v:.2f}x the faster raw read beside it{of_case}"
    if k == "bcp save" and med.get(SAVE_BESIDE):
        of_case = f" ({raw_w / v:.2f}x the raw case's)" if raw_w else ""
        return f"{med[SAVE_BESIDE] / v:.2f}x the raw write speed beside it{of_case}"
    if k.startswith(("raw", "memcpy")):
        return "(limit)"
    if (k in MEMORY_LIMITS.values() or k in MEMORY_OWN_LIMITS.values()) and med.get(MEMORY_MEMCPY):
        return f"(limit) {med[MEMORY_MEMCPY] / v:.2f}x the memcpy beside it"
    if k in MEMORY_LOADS and med.get(MEMORY_MEMCPY):
        limit, own = med.get(MEMORY_LIMITS[k]), med.get(MEMORY_OWN_LIMITS[k])
        of_limit = f", {limit / v:.2f}x its verified preadv" if limit else ""
        of_limit += f", {own / v:.2f}x into its tensors" if own else ""
        return f"{med[MEMORY_MEMCPY] / v:.2f}x the memcpy beside it{of_limit}"
    if "blocking" in k and memcpy:
        return f"{v / memcpy:.2f}x the memcpy time"
    if "total" in k and sync:
        return f"{v / sync:.2f}x the bcp sync save time"
    if ("save" in k or "write" in k) and raw_w:
        return f"{raw_w / v:.2f}x raw write speed"
    if raw_r:
        return f"{raw_r / v:.2f}x raw read speed"
    return ""


def print_table(shape: str, gib: float, repeats: int, size: int, runs: dict[str, list[float]], notes: dict) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"\nshape {describe(shape, gib)}; {size / 2**30:.2f} GiB; medians of {repeats} runs; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; ratios are throughput relative to the raw "
        f"limit measured in this run, or time relative to the memcpy named\n"
    )
    print(f"| {'case':<56} | {'seconds':>8} | {'GB/s':>6} | ratio |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 8}|-------|")
    for k, v in med.items():
        if k.endswith("peak extra memory"):
            print(f"| {k:<56} | {'':>8} | {'':>6} | {v / 2**20:.0f} MiB = {v / size:.2f}x state |")
            continue
        print(f"| {k:<56} | {v:>8.3f} | {size / v / 1e9:>6.2f} | {ratio_of(k, med)} |")
    for k, v in notes.items():
        print(f"| {k:<56} | | | {v} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--shape", choices=(*SHAPES, "both"), default="both", help="bench/shapes.py's state")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp-peers")
    p.add_argument("--only", default="")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of quiet between cases")
    p.add_argument("--shm", default="/dev/shm", help="a tmpfs directory for the memory case")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds inside the memory case")
    p.add_argument("--async-calls", type=int, default=3, help="steady-state async_save calls in the bcp case")
    p.add_argument("--save-pairs", type=int, default=3, help="sync saves, each beside a raw write, in the bcp case")
    p.add_argument("--load-pairs", type=int, default=3, help="cold bcp loads, each beside raw reads, in the bcp case")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        run_case(args.case, args)
        return
    names = [n for n in CASES if not args.only or n in args.only.split(",")]
    chosen = SHAPES if args.shape == "both" else (args.shape,)
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in chosen}
    notes: dict[str, dict[str, str]] = {s: {} for s in chosen}
    sizes: dict[str, int] = {}
    for rep in range(args.repeats):
        for name in names:
            for shape in chosen:
                os.sync()
                time.sleep(args.settle)  # the disk keeps working after a big write or delete: let it settle
                cmd = [sys.executable, __file__, "--case", name, "--shape", shape, "--gib", str(args.gib)]
                cmd += ["--dir", args.dir, "--shm", args.shm, "--rounds", str(args.rounds)]
                cmd += ["--async-calls", str(args.async_calls), "--save-pairs", str(args.save_pairs)]
                cmd += ["--load-pairs", str(args.load_pairs)]
                cmd += ["--settle", str(args.settle)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    notes[shape][name] = f"case failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
                    continue
                result = json.loads(lines[-1][7:])
                sizes[shape] = result.pop("_bytes")
                for k, v in result.items():
                    if isinstance(v, str):
                        notes[shape][k] = v
                    else:
                        runs[shape].setdefault(k, []).append(v)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    for shape in chosen:
        if shape not in sizes:
            print(f"\nshape {shape}: every case failed")
            for k, v in notes[shape].items():
                print(f"| {k:<56} | | | {v} |")
            continue
        print_table(shape, args.gib, args.repeats, sizes[shape], runs[shape], notes[shape])


if __name__ == "__main__":
    main()
