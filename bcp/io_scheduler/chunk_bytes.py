"""What a chunk handed to a data file's writers holds (:class:`StagedChunk`), how host
bytes are copied into a slab (:func:`copy_bytes`), and the hook an incremental save's
digests take from the bytes written (:class:`DigestSink`): the write pipeline's parts
that need none of its state."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from bcp.io_scheduler.chunk_plan import Chunk
from bcp.io_scheduler.staging import Slab


@dataclasses.dataclass(slots=True)
class StagedChunk:
    """A chunk handed to the writers: its bytes, where they live, and what completes them."""

    chunk: Chunk
    #: the pool slab holding the bytes (None: the bytes are the source tensor's own memory)
    slab: Slab | None
    data: torch.Tensor
    #: device-to-host copy events the bytes wait for (empty for host sources)
    events: list
    #: a batch's segments in the source's memory, and the parts written from its offset
    views: list | None = None
    parts: list | None = None


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` as one single-threaded numpy memmove (GIL released), not
    ``Tensor.copy_``: torch makes each copy of 32,768+ elements an OpenMP region whose
    threads wait for each other, which on a busy 2-core machine cost 10-100x."""
    dst[:] = src


class DigestSink(Protocol):
    """An incremental save's digests of the bytes written (``bcp.pieces.StreamDigests``)."""

    #: items left to a digest of their stored bytes (``bcp.pieces.digest_stored``)
    spilled: set[int]

    def feed(self, item: int, start: int, view: memoryview) -> None: ...
    def result(self, item: int) -> bytes: ...
