"""The bulk read of shards wanted at the layout they were saved with (issue 37).

A resume at the same world size (FSDP2/DTensor shards, explicit shards) wants on each
rank boxes that are each exactly one stored fragment row. The planner spent about
30 us a shard on them (a Fragment, a RunSet, numpy calls per box) for what is one
read of one row into a dense destination: here such a request becomes a
:class:`~.whole_reads.WholeRead`, found for every request at once
(:meth:`Catalog.whole_rows` with boxes), and is read and verified with the tensors
stored whole by :func:`~.whole_reads.execute_whole_reads`. Every other request keeps the
planner; the guarantees are the bulk path's.
"""

from __future__ import annotations

import numpy as np
import torch

from bcp.io_scheduler import device_copy, read_exec
from bcp.io_scheduler.whole_reads import WholeRead, destination_views, split_whole
from bcp.metadata import Catalog, Fragment, TensorEntry
from bcp.metadata.geometry import Box
from bcp.torch_dtypes import torch_dtype_or_none

Request = tuple[str, Box, torch.Tensor]


def split_bulk(
    catalog: Catalog,
    block: int,
    requests: list[Request],
    in_memory: dict[tuple[str, Box], torch.Tensor],
    spans: list[tuple[int, int]],
) -> tuple[list[WholeRead], np.ndarray, list[Request]]:
    """:func:`~.whole_reads.split_whole`, then of the rest those whose box is exactly one
    stored row (:func:`split_exact`): the reads of both, their checksum column, and the
    requests left to the planner."""
    whole, sums, rest = split_whole(catalog, block, requests, in_memory, spans)
    if not rest:
        return whole, sums, rest
    if len(rest) < len(requests):  # the spans of the requests left, by identity
        span_of = {id(r): s for r, s in zip(requests, spans, strict=True)}
        spans = [span_of[id(r)] for r in rest]
    exact, rest = split_exact(catalog, block, rest, in_memory, spans, sums)
    return whole + exact, sums, rest


def split_exact(
    catalog: Catalog,
    block: int,
    requests: list[Request],
    in_memory: dict[tuple[str, Box], torch.Tensor],
    spans: list[tuple[int, int]],
    sums: np.ndarray,
) -> tuple[list[WholeRead], list[Request]]:
    """The requests whose box is exactly one stored row that no other row meets
    (:meth:`Catalog.whole_rows` with boxes), of a size read in bulk, into a dense CPU
    destination of the row's dtype and the box's shape, none of the tensor at hand
    already: split_whole's checks (``spans`` as it takes them), with the box for the
    whole shape. ``sums``: split_whole's checksum column, which the reads index (none
    are taken if the catalog's is another by now). The rest is planned as before."""
    if not catalog.is_whole:
        catalog.require([(fqn, box) for fqn, box, _dest in requests])  # held already: split_whole required them
    info = catalog.whole_rows([fqn for fqn, _box, _dest in requests], [box for _fqn, box, _dest in requests])
    if info.sums is not sums:
        return [], requests
    largest = read_exec.COALESCE_BELOW - 1  # read at run time (tests change it)
    nbytes_all = info.nbytes_array
    fits = (info.row_array >= 0) & (nbytes_all > 0) & (nbytes_all <= largest)
    fits &= info.blocks_array == -(-nbytes_all // block)
    if in_memory:
        held = {fqn for fqn, _box in in_memory}
        fits &= np.fromiter((fqn not in held for fqn, _box, _dest in requests), bool, len(requests))
    wanted = {name: torch_dtype_or_none(name) for name in set(info.dtypes)}
    on_device = None if getattr(device_copy.api, "by_device", False) else device_copy.api.is_device
    rest: list[Request] = []
    picked: list[int] = []
    ptrs: list[int] = []
    dtypes, all_nbytes = info.dtypes, info.nbytes
    for i, (request, ok, (ptr, size)) in enumerate(zip(requests, fits.tolist(), spans, strict=True)):
        if not ok:
            rest.append(request)
            continue
        _fqn, (_d_off, d_len), dest = request
        dtype = wanted[dtypes[i]]
        if (
            not ptr  # not dense (strided, empty, meta) or no memory of its own
            or size != all_nbytes[i]
            or dtype is None
            or dest.dtype != dtype
            or not dest.is_cpu
            or (on_device is not None and on_device(dest))
            or dest.shape != tuple(d_len)
            or (dtype.is_complex and dest.is_conj())
            or dest.is_neg()
        ):
            rest.append(request)
            continue
        picked.append(i)
        ptrs.append(ptr)
    targets = destination_views(ptrs, [all_nbytes[i] for i in picked])
    names, files, offsets, starts = info.file_names, info.files, info.byte_offsets, info.sum_starts
    new = tuple.__new__
    exact = [
        new(WholeRead, (requests[i][0], names[files[i]], offsets[i], all_nbytes[i], starts[i], target, requests[i][2]))
        for i, target in zip(picked, targets, strict=True)
    ]
    return exact, rest


def row_of(entry: TensorEntry, read: WholeRead) -> Fragment:
    """The stored row ``read`` reads (the one of its file and offset), to name an error."""
    names = entry.file_names
    for r, (f, off) in enumerate(zip(entry.files.tolist(), entry.byte_offsets.tolist(), strict=True)):
        if names[f] == read.file and off == read.offset:
            return entry.fragment(r)
    return entry.fragment(0)  # not reached: every read is one of the entry's rows
