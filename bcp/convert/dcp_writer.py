"""Writing a PyTorch DCP checkpoint from bcp with DCP's own planner and writer,
streamed: DCP plans over placeholders, and the tensors are read from bcp batch by
batch just before the writer writes them, so memory holds about one batch.

Imports ``torch.distributed.checkpoint`` at once: :mod:`bcp.convert.dcp_format` imports this
module only when an export runs.
"""

from __future__ import annotations

import dataclasses
import io
import weakref
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from bcp.convert.selection import plan_shards


class StreamingSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` over a state whose tensors are placeholders (meta
    tensors of the stored shape and dtype): DCP plans and flattens it as it would the
    real state, and the tensors are read only when the writer is about to write them,
    so memory holds the batch being written, not the checkpoint.

    ``source`` maps ``id(placeholder)`` to the key ``fill`` takes; ``fill`` fills a
    list of (key, destination) pairs in one call (so reads of neighbouring tensors
    coalesce). :meth:`prefetch` reads a whole batch at once; a tensor not prefetched
    is read alone when DCP resolves it. Each tensor's memory is a numpy buffer, so
    that its release is observable: ``resident`` counts the tensors read and not yet
    freed, ``peak_resident`` and ``peak_resident_bytes`` are the maxima (the bound the
    docs promise, measured)."""

    def __init__(self, source: dict[int, str], fill: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        super().__init__(flatten_state_dict=True)
        self.source = source
        self.fill = fill
        self.ready: dict[MetadataIndex, torch.Tensor] = {}
        self.resident = 0
        self.resident_bytes = 0
        self.peak_resident = 0
        self.peak_resident_bytes = 0

    def prefetch(self, items: list[WriteItem]) -> None:
        """Read the tensors of ``items`` together, for :meth:`resolve_data` to hand out."""
        wanted = [wi for wi in items if self._streamed(wi) and wi.index not in self.ready]
        pairs = [(wi.index, *self._allocate(wi)) for wi in wanted]
        self.fill([(key, tensor) for _index, key, tensor in pairs])
        self.ready.update((index, tensor) for index, _key, tensor in pairs)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if not self._streamed(write_item):  # bytes, or a tensor inside an object (decoded whole, small)
            return super().resolve_data(write_item)
        tensor = self.ready.pop(write_item.index, None)
        if tensor is None:
            key, tensor = self._allocate(write_item)
            self.fill([(key, tensor)])
        return tensor

    def _streamed(self, write_item: WriteItem) -> bool:
        """A tensor item whose value is one of the placeholders: read when written.
        An object holding tensors (an RNG state, a scheduler's) is decoded whole, and
        DCP writes its tensors as tensor items, as it would have saved them."""
        if write_item.type == WriteItemType.BYTE_IO:
            return False
        return id(self.lookup_object(write_item.index)) in self.source

    def _allocate(self, write_item: WriteItem) -> tuple[str, torch.Tensor]:
        placeholder = self.lookup_object(write_item.index)
        nbytes = placeholder.numel() * placeholder.element_size()
        if not nbytes:  # no element: a view of an empty byte buffer as a wider dtype is refused
            return self.source[id(placeholder)], torch.empty(placeholder.shape, dtype=placeholder.dtype)
        buffer = np.empty(nbytes, dtype=np.uint8)
        tensor = torch.from_numpy(buffer).view(placeholder.dtype).reshape(placeholder.shape)
        self.resident += 1
        self.resident_bytes += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        weakref.finalize(buffer, self._freed, nbytes)
        return self.source[id(placeholder)], tensor

    def _freed(self, nbytes: int) -> None:
        self.resident -= 1
        self.resident_bytes -= nbytes


class BatchedFileSystemWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that writes the plan's tensors in batches of at most
    ``batch_bytes`` (a larger tensor alone), one data file per batch, one batch after
    the other. torch's writer keeps every tensor of a data file referenced until the
    file is closed, so this is what bounds the memory of a streamed export: about one
    batch. The batches are written by the stock ``write_data`` with a per-batch file
    prefix; their results together are what DCP records in ``.metadata``. A planner
    with a ``prefetch(items)`` method (:class:`StreamingSavePlanner`) is given each
    batch before it is written, to read it in one go."""

    def __init__(self, path: str, *, batch_bytes: int, sync_files: bool = True, final_path: str | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1)
        self.batch_bytes = batch_bytes
        #: where the files will be once moved from ``path`` (a staging directory), as ``.metadata`` records it
        self.final_path = final_path

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and self.final_path is not None:
            meta.checkpoint_id = self.final_path
        return meta

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        prefetch = getattr(planner, "prefetch", None)  # StreamingSavePlanner's: one read per batch
        for i, batch in enumerate(self._batches(plan.items)):
            if prefetch is not None:
                prefetch(batch)
            prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{i}_")
            part = dataclasses.replace(plan, items=batch, storage_data=prefix)
            results.extend(super().write_data(part, planner).wait())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _batches(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        """Items in order, cut where the next tensor would pass ``batch_bytes`` (as
        safetensors shards are cut); the (small, pickled) non-tensor items go with the
        first batch."""
        objects = [wi for wi in items if wi.type == WriteItemType.BYTE_IO]
        tensors = [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
        batches = plan_shards([(wi, _nbytes(wi)) for wi in tensors], self.batch_bytes)
        if not batches:
            return [objects] if objects else []
        batches[0][:0] = objects
        return batches


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None, "a tensor write item carries its tensor data"
    return torch.Size(item.tensor_data.size).numel() * item.tensor_data.properties.dtype.itemsize
