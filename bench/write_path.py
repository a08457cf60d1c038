"""A sync ``bcp.save`` beside the raw write limit, interleaved in one process.

The raw limit is what bench/peers.py measures: one O_DIRECT sequential stream of the
state's byte count in 64 MiB requests from page-aligned memory, then ``fsync``. Each
repeat runs the raw write, then ``bcp.save`` of the same bytes into an empty directory
(the previous repeat's checkpoint is removed untimed, as the raw file is and as
bench/peers.py does: an overwrite would add the deletion of the old data file, 0.2 s
a GiB here), so both meet the same moment of a disk whose speed swings; the table prints the
medians, the ratio of the medians and the median of the per-repeat ratios, with the
CPU time of each save (``time.process_time``: what the save itself costs, which the
disk's swings do not change).

``--count`` adds one save with ``os.pwrite``/``os.pwritev``/``os.fsync``/``os.fdatasync`` counted
(outside the timed repeats): how many write requests a save issues, of which sizes,
O_DIRECT or through the page cache, and how many flushes.

    python bench/write_path.py [--shape both] [--gib 1] [--repeats 10] [--dir /tmp/bcp-write-path] [--count]
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import mmap
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bcp
import shapes

RAW_REQUEST = 64 << 20


def state_of(shape: str, gib: float) -> dict:
    return shapes.transformer_state(gib) if shape == "transformer" else shapes.equal_state(gib)


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in shapes.tensors(state))


def raw_write(path: str, size: int, buf: mmap.mmap) -> None:
    """bench/peers.py's raw limit: O_DIRECT, 64 MiB requests, one stream, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, size, RAW_REQUEST):
            os.pwrite(fd, memoryview(buf)[: min(RAW_REQUEST, size - off) // 4096 * 4096 or 4096], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def counted_save(state, uri: str) -> dict[str, int]:
    """One save with its write requests and flushes counted by kind."""
    counts: collections.Counter = collections.Counter()
    pwrite, pwritev, fsync, fdatasync = os.pwrite, os.pwritev, os.fsync, os.fdatasync

    def direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def counting_pwrite(fd, data, offset):
        n = len(memoryview(data).cast("B"))
        kind = "O_DIRECT" if direct(fd) else "buffered"
        counts[f"pwrite {kind}"] += 1
        counts[f"pwrite {kind} bytes"] += n
        if n >= 16 << 20:
            counts[f"pwrite {kind} >= 16 MiB"] += 1
        return pwrite(fd, data, offset)

    def counting_pwritev(fd, buffers, offset):
        n = sum(len(memoryview(b).cast("B")) for b in buffers)
        kind = "O_DIRECT" if direct(fd) else "buffered"
        counts[f"pwritev {kind}"] += 1
        counts[f"pwritev {kind} bytes"] += n
        if n >= 16 << 20:
            counts[f"pwritev {kind} >= 16 MiB"] += 1
        return pwritev(fd, buffers, offset)

    def counting(name, fn):
        def call(fd):
            counts[name] += 1
            return fn(fd)

        return call

    os.pwrite = counting_pwrite  # type: ignore[assignment]
    os.pwritev = counting_pwritev  # type: ignore[assignment]
    os.fsync = counting("fsync", fsync)  # type: ignore[assignment]
    os.fdatasync = counting("fdatasync", fdatasync)  # type: ignore[assignment]
    try:
        bcp.save(state, uri, overwrite=True)
    finally:
        os.pwrite, os.pwritev, os.fsync, os.fdatasync = pwrite, pwritev, fsync, fdatasync  # type: ignore[assignment]
    return dict(counts)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


def measure(shape: str, gib: float, repeats: int, directory: str, count: bool) -> None:
    state = state_of(shape, gib)
    size = nbytes(state)
    n = sum(1 for _ in shapes.tensors(state))
    os.makedirs(directory, exist_ok=True)
    raw_path, uri = os.path.join(directory, "raw.bin"), os.path.join(directory, "bcp")
    buf = mmap.mmap(-1, RAW_REQUEST)  # page-aligned
    buf.write(os.urandom(1 << 20) * (RAW_REQUEST >> 20))
    bcp.save(state, uri, overwrite=True)  # warm-up: imports, plan cache, staging pool
    raw_s, save_s, save_cpu, ratios = [], [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        raw_write(raw_path, size, buf)
        raw_s.append(time.perf_counter() - t)
        os.remove(raw_path)
        shutil.rmtree(uri)  # untimed, as the raw file's removal
        t, c = time.perf_counter(), time.process_time()
        bcp.save(state, uri)
        save_s.append(time.perf_counter() - t)
        save_cpu.append(time.process_time() - c)
        ratios.append(raw_s[-1] / save_s[-1])
    raw, save = statistics.median(raw_s), statistics.median(save_s)
    print(
        f"\n{shape}: {n} tensors, {human(size)}, {repeats} repeats interleaved (medians); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print("| case | s | GB/s | CPU-s |")
    print("|---|---:|---:|---:|")
    print(f"| raw O_DIRECT write (64 MiB requests, 1 stream) | {raw:.3f} | {size / raw / 1e9:.2f} | |")
    print(f"| bcp save | {save:.3f} | {size / save / 1e9:.2f} | {statistics.median(save_cpu):.3f} |")
    print(
        f"write_path {shape}: sync save / raw O_DIRECT write = {raw / save:.2f}x "
        f"(median of per-repeat ratios {statistics.median(ratios):.2f}x; target 0.85x)"
    )
    if count:
        for key, value in sorted(counted_save(state, uri).items()):
            print(f"  {key}: {human(value) if key.endswith('bytes') else value}")
    shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("transformer", "equal", "both"), default="both")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dir", default="/tmp/bcp-write-path")
    p.add_argument("--count", action="store_true", help="count one save's write requests and flushes")
    args = p.parse_args()
    for shape in ("transformer", "equal") if args.shape == "both" else (args.shape,):
        measure(shape, args.gib, args.repeats, args.dir, args.count)


if __name__ == "__main__":
    main()
