"""Load destinations that share memory (tied weights), checked before any read.

Two keys loaded into overlapping memory with different stored data would leave
whichever read landed last, and one reader thread's checksum could see another's
bytes (a false corruption error). Such requests are refused with a ValueError naming
both keys. The exception is tied weights: requests whose destination is the very same
memory (same start, size, dtype and box) and whose stored bytes the catalog records as
the same (equal fragments and checksums: bcp stores tied tensors once) are read once.
Only dense destinations are compared (a strided one lands through a copy); one sort
over all requests.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

from bcp.metadata import Catalog, TensorEntry
from bcp.metadata.geometry import Box

Request = tuple[str, Box, torch.Tensor]
#: a destination's (address, bytes, dtype if the bulk read may take it): see destination_overlaps
Span = tuple[int, int, torch.dtype | None]
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def without_shared_destinations(
    requests: list[Request],
    catalog: Catalog,
    entry: Callable[[str], TensorEntry],
    spans: list[Span] | None = None,
) -> list[Request]:
    """``requests`` less the repeats of a tied destination; a ValueError naming both
    keys for any other overlap. ``entry(fqn)`` is the stored tensor's catalog entry.
    ``spans``, if given, gets each kept request's destination (address, bytes, dtype) as
    :func:`destination_overlaps` gives them (the bulk read's views start there)."""
    found: list[Span] = []
    overlaps = destination_overlaps([dest for _f, _b, dest in requests], found if spans is not None else None)
    drop: set[int] = set()
    for later, earlier in overlaps:
        (fqn, box, dest), (other, other_box, other_dest) = requests[later], requests[earlier]
        if _same_destination_and_bytes(requests[later], requests[earlier], catalog, entry):
            drop.add(later)
            continue
        raise ValueError(
            f"{other!r} and {fqn!r}: their destination tensors share memory "
            f"(bytes {_span(other_dest)} and {_span(dest)} of one storage) but the checkpoint "
            f"holds different data for them (boxes {list(other_box[0])}+{list(other_box[1])} and "
            f"{list(box[0])}+{list(box[1])}); load them into separate tensors"
        )
    if spans is not None:
        spans += [s for i, s in enumerate(found) if i not in drop] if drop else found
    return [r for i, r in enumerate(requests) if i not in drop] if drop else requests


def destination_overlaps(dests: list[torch.Tensor], spans: list[Span] | None = None) -> list[tuple[int, int]]:
    """(later, earlier) index pairs of dense destinations whose bytes overlap on one
    device: sorted by start, a tensor overlaps the one holding the running maximum end
    if it starts before that end. Meta, empty and strided tensors are left out.
    ``spans``, if given, gets each destination's (address, bytes, dtype) as compared,
    (0, 0, None) for those left out; the dtype is None unless the tensor is in CPU
    memory without a lazy negation or conjugation (what the bulk read takes it for)."""
    # one pass reading each tensor's attributes once, while they are in the CPU cache
    # (a load of 10,000 small tensors): the bulk read asks none of them again. A CPU
    # tensor (the usual destination) is asked 6 things (7 if complex), its device never (a new object)
    none: Span = (0, 0, None)
    found: list[Span] = []
    add = found.append
    others: dict[torch.device, tuple[list[int], list[int], list[int]]] = {}  # not CPU memory, by device
    for i, dest in enumerate(dests):
        if dest.is_cpu:
            if dest.is_contiguous() and (size := dest.nbytes):
                dtype = dest.dtype  # a conjugation is lazy only in a complex tensor: a real one is not asked
                add((dest.data_ptr(), size, None if dest.is_neg() or (dtype.is_complex and dest.is_conj()) else dtype))
            else:
                add(none)
        elif dest.is_meta or not dest.is_contiguous() or not (size := dest.nbytes):
            add(none)
        else:
            ptr = dest.data_ptr()
            add((ptr, size, None))
            rows_, ptrs, sizes_ = others.setdefault(dest.device, ([], [], []))
            rows_.append(i)
            ptrs.append(ptr)
            sizes_.append(size)
    if spans is not None:
        spans += found
    n = len(found)
    starts_all = np.fromiter(map(_FIRST, found), np.uint64, n)
    sizes_all = np.fromiter(map(_SECOND, found), np.uint64, n)
    cpu = sizes_all > 0
    groups = []
    for rows_, ptrs, sizes_ in others.values():
        cpu[rows_] = False
        groups.append((np.asarray(rows_, np.int64), np.asarray(ptrs, np.uint64), np.asarray(sizes_, np.uint64)))
    rows = np.flatnonzero(cpu)
    groups.append((rows, starts_all[rows], sizes_all[rows]))
    pairs: list[tuple[int, int]] = []
    for index, starts, sizes in groups:
        if len(index) < 2:
            continue
        order = np.argsort(starts, kind="stable")
        starts, ends, index = starts[order], starts[order] + sizes[order], index[order]
        reach = np.maximum.accumulate(ends)
        position = np.arange(len(index))
        holder = np.maximum.accumulate(np.where(ends == reach, position, 0))  # who holds the running max
        hits = np.flatnonzero(starts[1:] < reach[:-1]) + 1
        pairs += [(int(index[h]), int(index[holder[h - 1]])) for h in hits]
    return pairs


def check_destination(fqn: str, dest: torch.Tensor) -> None:
    """ValueError naming ``fqn`` for a destination no load can fill: a meta tensor, or one
    whose elements share memory (a stride of 0 on a dimension of more than one: what
    ``expand`` makes), which the copy into it would refuse only after the other keys
    were filled."""
    if dest.is_meta:
        raise ValueError(f"{fqn!r}: cannot load into a meta tensor; allocate it first (module.to_empty(device=...))")
    if not dest.is_contiguous() and any(n > 1 and st == 0 for n, st in zip(dest.shape, dest.stride(), strict=True)):
        raise ValueError(
            f"{fqn!r}: its destination's elements share memory (shape {list(dest.shape)}, strides "
            f"{list(dest.stride())}: an expand()ed tensor); load into a tensor of its own (clone() it)"
        )


def _same_destination_and_bytes(
    one: Request, two: Request, catalog: Catalog, entry: Callable[[str], TensorEntry]
) -> bool:
    """Whether two requests fill the same memory in the same way with stored bytes
    the catalog records as the same (equal fragments and checksums)."""
    (f1, b1, d1), (f2, b2, d2) = one, two
    same_memory = d1.data_ptr() == d2.data_ptr() and d1.nbytes == d2.nbytes and d1.dtype == d2.dtype
    if not same_memory or tuple(b1[0]) != tuple(b2[0]) or tuple(b1[1]) != tuple(b2[1]):
        return False
    if f1 == f2:
        return True
    catalog.require([(f1, b1), (f2, b2)])  # a catalog read in part: the rows of these boxes

    def stored(e: TensorEntry) -> list[tuple]:
        return [(f.dtype, f.global_shape, f.offsets, f.lengths, f.nbytes, f.checksums) for f in e.fragments]

    return stored(entry(f1)) == stored(entry(f2))


def _span(dest: torch.Tensor) -> str:
    """A destination's byte range within its storage, for an error."""
    first = dest.storage_offset() * dest.element_size()
    return f"{first}..{first + dest.nbytes}"
