"""Which bytes of which files fill which destination boxes (pure; no I/O).

For every destination box and every stored fragment it overlaps, the overlap is cut
into runs contiguous both in the fragment (so one ranged read fetches it) and in the
destination (so it lands in place). Bytes planned equal bytes needed exactly; reads
for checksum verification are planned separately (read_exec).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bcp.metadata import Fragment, TensorEntry, itemsize

from ..boxes import Box, common_runs, intersect
from ..errors import CorruptCheckpointError


@dataclasses.dataclass(frozen=True, slots=True)
class RunSet:
    """Equal-length runs from one fragment into one destination box."""

    fragment: Fragment
    #: index of the destination (in the caller's list of boxes)
    dest: int
    #: run starts in bytes, relative to the fragment's first byte
    src: np.ndarray
    #: run starts in bytes, relative to the destination box's first byte (row-major)
    dst: np.ndarray
    #: bytes per run
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.run_bytes


def choose_replicas(entry: TensorEntry, prefer_rank: int = 0) -> list[Fragment]:
    """One fragment per distinct stored box; replicas are spread by ``prefer_rank``."""
    by_box: dict[Box, list[Fragment]] = {}
    for f in entry.fragments:
        by_box.setdefault((f.offsets, f.lengths), []).append(f)
    return [frags[prefer_rank % len(frags)] for frags in by_box.values()]


def plan_tensor_reads(
    entry: TensorEntry, dest_boxes: list[Box], *, prefer_rank: int = 0, in_memory: frozenset[Box] = frozenset()
) -> list[RunSet]:
    """Runs filling each of ``dest_boxes`` (boxes of ``entry``'s global tensor).
    Stored boxes listed in ``in_memory`` are already at hand and get no runs."""
    size = itemsize(entry.dtype)
    fragments = choose_replicas(entry, prefer_rank)
    plans: list[RunSet] = []
    for index, (d_off, d_len) in enumerate(dest_boxes):
        need = math.prod(d_len)
        covered = 0
        for frag in fragments:
            region = intersect(d_off, d_len, frag.offsets, frag.lengths)
            if region is None:
                continue
            r_off, r_len = region
            covered += math.prod(r_len)
            if (frag.offsets, frag.lengths) in in_memory:
                continue
            src, dst, run = common_runs(r_off, r_len, frag.offsets, frag.lengths, d_off, d_len)
            if run:
                plans.append(RunSet(frag, index, src * size, dst * size, run * size))
        if covered != need:
            raise CorruptCheckpointError(
                f"tensor {entry.fqn!r}: the stored fragments cover {covered} of the {need} elements of box "
                f"offsets={list(d_off)} lengths={list(d_len)}",
                fqn=entry.fqn,
            )
    return plans
