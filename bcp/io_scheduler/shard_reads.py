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

from bcp.io_scheduler.shared_dest import Span
from bcp.io_scheduler.whole_reads import WholeRead, pick_bulk, split_whole
from bcp.metadata import Catalog, Fragment, TensorEntry
from bcp.metadata.geometry import Box

Request = tuple[str, Box, torch.Tensor]


def split_bulk(
    catalog: Catalog,
    block: int,
    requests: list[Request],
    in_memory: dict[tuple[str, Box], torch.Tensor],
    spans: list[Span],
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
    spans: list[Span],
    sums: np.ndarray,
) -> tuple[list[WholeRead], list[Request]]:
    """The requests whose box is exactly one stored row that no other row meets
    (:meth:`Catalog.whole_rows` with boxes), of a size read in bulk, into a dense CPU
    destination of the row's dtype and the box's shape, none of the tensor at hand
    already: split_whole's checks (``spans`` as it takes them), with the box for the
    whole shape. ``sums``: split_whole's checksum column, which the reads index (none
    are taken if the catalog's is another by now). The rest is planned as before."""
    # a catalog read in part holds these rows already: split_whole required every request's
    info = catalog.whole_rows([fqn for fqn, _box, _dest in requests], [box for _fqn, box, _dest in requests])
    if info.sums is not sums:
        return [], requests
    return pick_bulk(info, block, requests, in_memory, spans, exact=True)


def row_of(entry: TensorEntry, read: WholeRead) -> Fragment:
    """The stored row ``read`` reads (the one of its file and offset), to name an error."""
    names = entry.file_names
    for r, (f, off) in enumerate(zip(entry.files.tolist(), entry.byte_offsets.tolist(), strict=True)):
        if names[f] == read.file and off == read.offset:
            return entry.fragment(r)
    return entry.fragment(0)  # not reached: every read is one of the entry's rows
