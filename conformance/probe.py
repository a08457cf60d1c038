"""Performance probe: what a backend delivers, reported rather than judged.

Measures large sequential writes (one object, written in parts the way bcp's
pipeline writes, with the backend's own concurrency), large reads of it at 1, 2, 4,
8 and 16 concurrent ranged requests (the best one is reported as the concurrency to
use), and the latency of small (4 KiB) ranged reads at random offsets.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bcp.backends import Backend

MiB = 1 << 20


def _part_size(backend: Backend) -> int:
    return backend.hints.part_size or 8 * MiB


def probe(backend: Backend, *, total_bytes: int = 256 * MiB, small_reads: int = 50) -> dict:
    """Run the probe under a fresh key prefix of ``backend`` (deleted afterwards);
    return figures as a flat dict (GB/s are 1e9 bytes a second)."""
    prefix = f"bcp-probe-{uuid.uuid4().hex[:10]}/"
    part = _part_size(backend)
    total = max(part, total_bytes // part * part)
    payload = memoryview(random.randbytes(part))
    key = prefix + "large"
    figures: dict = {"object_bytes": total, "part_bytes": part}
    try:
        start = time.perf_counter()
        with backend.open_writer(key, size=total) as writer:
            with ThreadPoolExecutor(max(1, backend.hints.concurrency)) as pool:
                list(pool.map(lambda off: writer.write_at(off, payload), range(0, total, part)))
            writer.commit()
        seconds = time.perf_counter() - start
        figures["write_GBps"] = round(total / seconds / 1e9, 4)
        figures["write_concurrency"] = backend.hints.concurrency

        piece = min(part, 8 * MiB)
        best = (0.0, 1)
        for streams in (1, 2, 4, 8, 16):
            buffers = [bytearray(piece) for _ in range(streams)]

            def read(index_offset: tuple[int, int], buffers: list[bytearray] = buffers, streams: int = streams) -> None:
                index, offset = index_offset
                backend.read_exact(key, offset, memoryview(buffers[index % streams])[: min(piece, total - offset)])

            start = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                list(pool.map(read, enumerate(range(0, total, piece))))
            rate = total / (time.perf_counter() - start) / 1e9
            figures[f"read_GBps_x{streams}"] = round(rate, 4)
            best = max(best, (rate, streams))
        figures["read_GBps_best"] = round(best[0], 4)
        figures["best_read_concurrency"] = best[1]

        small = bytearray(4096)
        latencies = []
        rng = random.Random(0)
        for _ in range(small_reads):
            offset = rng.randrange(0, total - 4096)
            start = time.perf_counter()
            backend.read_exact(key, offset, memoryview(small))
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        figures["ranged_read_4KiB_ms_p50"] = round(statistics.median(latencies) * 1e3, 3)
        figures["ranged_read_4KiB_ms_p90"] = round(latencies[int(0.9 * (len(latencies) - 1))] * 1e3, 3)
    finally:
        backend.delete_prefix(prefix)
    return figures
