"""bcp against its peers on one state, in one run, with the raw limits beside them.

Every case runs in a fresh subprocess (clean page cache accounting and peak RSS),
repeated; the table shows medians and ratios to the raw limits measured in the same
run. Cold-cache loads drop the checkpoint's pages with posix_fadvise(DONTNEED).

    python bench/peers.py [--gib 2] [--repeats 3] [--dir /tmp/bcp-peers] [--only CASE,...]

The ``memory`` case loads from memory: the page cache (warm) and tmpfs (``--shm``,
default /dev/shm), each beside a memcpy of the same bytes into warm buffers,
interleaved round by round in one process (``--rounds``); their ratio is to that memcpy.
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
from memcpy_limit import WarmMemcpy  # bench/ is not a package

BYTECHECKPOINT_PATH = os.environ.get("BYTECHECKPOINT_PATH", "/tmp/bytecp/site:/tmp/bytecp/deps")


# -- helpers run inside the case subprocess ------------------------------------------------


def make_state(gib: float, tensors: int = 48) -> dict:
    import torch

    cols = 2736
    rows = max(1, int(gib * 2**30 / tensors / cols / 4))
    state = {}
    for i in range(tensors):
        t = torch.empty(rows, cols)
        t.uniform_(-1, 1)
        state[f"layer{i:02d}.weight"] = t
    return state


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


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
    import torch

    out = {k: torch.empty_like(v) for k, v in state.items()}
    if touch:
        for t in out.values():
            t.zero_()
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- cases: each returns a dict of measurements --------------------------------------------


def case_raw(path, state, _args):
    """O_DIRECT sequential write and read of the state's byte count, and a warm memcpy."""
    import torch

    size = nbytes(state)
    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    f = os.path.join(path, "raw.bin")
    os.makedirs(path, exist_ok=True)

    def write():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, size, chunk):
            os.pwrite(fd, memoryview(buf)[: min(chunk, size - off) // 4096 * 4096 or 4096], off)
        os.fsync(fd)
        os.close(fd)

    def read():
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        for off in range(0, size, chunk):
            os.preadv(fd, [memoryview(buf)], off)
        os.close(fd)

    w = timed(write)
    r = timed(read)
    m = WarmMemcpy(state)()
    os.remove(f)
    del torch
    return {"raw O_DIRECT write": w, "raw O_DIRECT read": r, "memcpy into warm buffers": m}


def case_bcp(path, state, args):
    import torch

    import bcp

    uri = os.path.join(path, "bcp")
    out = {}
    base = rss()
    out["bcp save"] = timed(lambda: bcp.save(state, uri, overwrite=True))
    out["bcp save: peak extra memory"] = peak_rss() - base
    dst = empty_like(state)
    drop_cache(uri)
    out["bcp load (cold cache)"] = timed(lambda: bcp.load(dst, uri))
    warm_cache(uri)
    out["bcp load (warm cache)"] = timed(lambda: bcp.load(dst, uri))
    # reshard: what rank 1 of 3 reads when this checkpoint is loaded row-sharded over 3 ranks
    part = {}
    for k, t in state.items():
        rows = t.shape[0]
        lo, hi = rows // 3, 2 * rows // 3
        part[k] = bcp.TensorShard(torch.zeros(hi - lo, t.shape[1]), tuple(t.shape), (lo, 0))
    part_bytes = sum(p.local.numel() * 4 for p in part.values())
    drop_cache(uri)
    seconds = timed(lambda: bcp.load(part, uri))
    out["bcp reshard load, 1 of 3 row shards (cold cache)"] = seconds * nbytes(state) / part_bytes  # per state byte
    # async: the first call in a process allocates the staging pool; later calls reuse it
    for label in ("first call", "steady state"):
        h = bcp.async_save(state, uri + "-async", overwrite=True)
        blocking = h.blocking_seconds
        h.wait()
        out[f"bcp async_save blocking ({label})"] = blocking
        out[f"bcp async_save total ({label})"] = h.wait().seconds
    return out


#: rows of the memory case: a load, and the memcpy of the same bytes measured beside it
MEMORY_MEMCPY = "memcpy into warm buffers (beside the in-memory loads)"
MEMORY_LOADS = ("bcp load (warm page cache)", "bcp load (/dev/shm)")


def case_memory(path, state, args):
    """bcp loads of bytes already in memory, each round: the page cache (a warm file on
    disk), tmpfs, and a memcpy of the same bytes into warm buffers, in rotating order;
    medians of the rounds."""
    import bcp

    shm = os.path.join(args.shm, f"bcp-peers-{os.getpid()}")
    uris = {MEMORY_LOADS[0]: os.path.join(path, "bcp"), MEMORY_LOADS[1]: shm}
    try:
        for uri in uris.values():
            bcp.save(state, uri, overwrite=True)
            warm_cache(uri)
        dst = empty_like(state)
        memcpy = WarmMemcpy(state)
        steps = {MEMORY_MEMCPY: memcpy}
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
    for k, v in state.items():
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
    state = make_state(args.gib)
    result = CASES[name](path, state, args)
    result["_bytes"] = nbytes(state)
    print("RESULT " + json.dumps(result))
    shutil.rmtree(path, ignore_errors=True)


# -- orchestration ------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp-peers")
    p.add_argument("--only", default="")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of quiet between cases")
    p.add_argument("--shm", default="/dev/shm", help="a tmpfs directory for the memory case")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds inside the memory case")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        run_case(args.case, args)
        return
    names = [n for n in CASES if not args.only or n in args.only.split(",")]
    runs: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    size = None
    for rep in range(args.repeats):
        for name in names:
            os.sync()
            time.sleep(args.settle)  # the disk keeps working after a big write or delete: let it settle
            cmd = [sys.executable, __file__, "--case", name, "--gib", str(args.gib), "--dir", args.dir]
            cmd += ["--shm", args.shm, "--rounds", str(args.rounds)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                notes[name] = f"case failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
                continue
            result = json.loads(lines[-1][7:])
            size = result.pop("_bytes")
            for k, v in result.items():
                if isinstance(v, str):
                    notes[k] = v
                else:
                    runs.setdefault(k, []).append(v)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    raw_w, raw_r, memcpy = (
        med.get("raw O_DIRECT write"),
        med.get("raw O_DIRECT read"),
        med.get("memcpy into warm buffers"),
    )
    sync = med.get("bcp save")
    print(
        f"\nstate: {size / 2**30:.2f} GiB in 48 float32 tensors; medians of {args.repeats} runs; "
        f"ratios are throughput relative to the raw limit measured in this run\n"
    )
    print(f"| {'case':<56} | {'seconds':>8} | {'GB/s':>6} | ratio |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 8}|-------|")
    for k, v in med.items():
        if k.endswith("peak extra memory"):
            print(f"| {k:<56} | {'':>8} | {'':>6} | {v / 2**20:.0f} MiB = {v / size:.2f}x state |")
            continue
        gbps = size / v / 1e9
        if k.startswith(("raw", "memcpy")):
            ratio = "(limit)"
        elif k in MEMORY_LOADS and med.get(MEMORY_MEMCPY):
            ratio = f"{med[MEMORY_MEMCPY] / v:.2f}x the memcpy beside it"
        elif "blocking" in k and memcpy:
            ratio = f"{v / memcpy:.2f}x the memcpy time"
        elif "total" in k and sync:
            ratio = f"{v / sync:.2f}x the bcp sync save time"
        elif ("save" in k or "write" in k) and raw_w:
            ratio = f"{raw_w / v:.2f}x raw write speed"
        elif raw_r:
            ratio = f"{raw_r / v:.2f}x raw read speed"
        else:
            ratio = ""
        print(f"| {k:<56} | {v:>8.3f} | {gbps:>6.2f} | {ratio} |")
    for k, v in notes.items():
        print(f"| {k:<52} | | | | {v} |")


if __name__ == "__main__":
    main()
