"""``bcp verify``: re-read every byte of a checkpoint and check it.

Checks, per checkpoint: the manifest and catalog parse and the catalog's CRC32C
matches; every data file the manifest lists exists with its recorded size; every
tensor's fragments tile its global shape exactly (no gap, no overlap: the catalog
checks it for every reader, and verify reports each tensor that fails); every
fragment's bytes match their per-block CRC32C (read in slices of at most 256 MiB,
so a tensor larger than memory verifies; small tensors are read together in batches
of that size, so runs that follow each other in a data file share requests); every
object decodes (pickled ones are
not unpickled, only counted).
"""

from __future__ import annotations

import math
import time

import torch

from .boxes import Box
from .errors import CheckpointError, PickleNotAllowedError
from .reader import open_checkpoint

SLICE_BYTES = 256 << 20


def _slices(shape: tuple[int, ...], itemsize: int):
    """Boxes along the first dimension of at most SLICE_BYTES each (the whole tensor if 0-d)."""
    if not shape or shape[0] == 0:
        yield (tuple(0 for _ in shape), tuple(shape))
        return
    row = max(1, math.prod(shape[1:]) * itemsize)
    step = max(1, SLICE_BYTES // row)
    for start in range(0, shape[0], step):
        n = min(step, shape[0] - start)
        yield ((start,) + (0,) * (len(shape) - 1), (n, *shape[1:]))


def verify_checkpoint(uri: str, *, progress=None) -> dict:
    start = time.perf_counter()
    problems: list[str] = []
    reader = open_checkpoint(uri, verify=True)  # parses manifest and catalog, checks the catalog CRC
    backend = reader.backend
    for entry in reader.manifest.data_files:
        try:
            size = backend.size(entry.path)
        except FileNotFoundError:
            problems.append(f"data file {entry.path!r} is missing")
            continue
        if size != entry.nbytes:
            problems.append(f"data file {entry.path!r} has {size} bytes; the manifest says {entry.nbytes}")
    metas = {}
    for fqn in reader.tensor_keys():
        try:  # the catalog refuses a tensor whose fragments do not tile it (FormatError)
            metas[fqn] = reader.meta(fqn)
        except CheckpointError as e:
            problems.append(f"{type(e).__name__}: {e}")
    total = sum(m.nbytes for m in metas.values())
    bar = progress(total, "verifying") if progress else None
    read = 0
    failed: set[str] = set()
    batch: list[tuple[str, Box, int]] = []

    def check(batch: list[tuple[str, Box, int]]) -> None:
        """Read a batch of slices together (runs that follow each other in a data file are
        fetched in few requests); on an error, slice by slice, so that each problem names
        its tensor and a tensor's later slices are skipped, as before."""
        nonlocal read
        try:
            reader.fill([(fqn, box, reader.empty(fqn, box)) for fqn, box, _n in batch])
            done = batch
        except (CheckpointError, OSError):
            done = []
            for fqn, box, n in batch:
                if fqn in failed:
                    continue
                try:
                    reader.read(fqn, box=box)
                    done.append((fqn, box, n))
                except (CheckpointError, OSError) as e:
                    problems.append(f"{type(e).__name__}: {e}")
                    failed.add(fqn)
        for _fqn, _box, n in done:
            read += n
            if bar is not None:
                bar.update(n)

    try:
        held = 0
        for fqn, meta in metas.items():
            itemsize = torch.empty((), dtype=meta.dtype).element_size()
            for box in _slices(tuple(meta.shape), itemsize):
                if fqn in failed:
                    break
                n = math.prod(box[1]) * itemsize
                if held + n > SLICE_BYTES and batch:
                    check(batch)
                    batch, held = [], 0
                batch.append((fqn, box, n))
                held += n
        if batch:
            check(batch)
        for fqn in reader.object_keys():
            try:
                reader.read_object(fqn) if not reader.is_per_rank(fqn) else reader.per_rank_objects(fqn)
            except PickleNotAllowedError:
                pass  # stored as a pickle: its bytes were checked, running it is not verify's to decide
            except CheckpointError as e:
                problems.append(f"object {fqn!r}: {e}")
    finally:
        if bar is not None:
            bar.close()
    return {
        "uri": reader.uri,
        "ok": not problems,
        "problems": problems,
        "tensors": len(reader.tensor_keys()),
        "objects": len(reader.object_keys()),
        "bytes_read": read,
        "seconds": round(time.perf_counter() - start, 3),
    }
