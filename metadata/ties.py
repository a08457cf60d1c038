"""Tied tensors among catalog entries: which FQNs are one stored tensor.

A save writes tied weights (two FQNs, one storage) once, and the tied FQN's rows point at
the same bytes as its target's. A read without a template allocates what the catalog
declares, so the FQNs it reads must be checked first: rows of different FQNs may share
bytes only as a whole tie (same dtype, global shape and rows), which is read once and
given back as one tensor, as it was saved. Anything else (10,000 FQNs over the bytes of
one, shifted by a byte each) declares more memory than the files hold, and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from bcp.metadata.format_errors import FormatError
from bcp.metadata.rows import TensorEntry


def tied_entries(entries: Sequence[TensorEntry]) -> dict[int, int]:
    """Index -> the first index of ``entries`` it is tied to (absent: stored on its own).
    FormatError naming two FQNs whose rows share bytes without being a whole tie."""
    if len(entries) < 2:
        return {}
    counts = np.array([len(e.byte_offsets) for e in entries], dtype=np.int64)
    tensor = np.repeat(np.arange(len(entries)), counts)
    file = np.concatenate([e.files for e in entries]).astype(np.int64, copy=False)
    offset = np.concatenate([e.byte_offsets for e in entries])
    size = np.concatenate([e.sizes for e in entries])
    held = np.flatnonzero(size > 0)
    order = held[np.lexsort((size[held], offset[held], file[held]))]
    f, o, n, t = file[order], offset[order], size[order], tensor[order]
    same_file = f[1:] == f[:-1]
    same = same_file & (o[1:] == o[:-1]) & (n[1:] == n[:-1])
    # ranges sorted by start: distinct ones are disjoint iff each ends before the next starts
    crossing = np.flatnonzero(same_file & (o[1:] < o[:-1] + n[:-1]) & ~same)
    if len(crossing):
        k = int(crossing[0])
        _refuse(entries, int(t[k]), int(t[k + 1]), int(f[k]), int(o[k + 1]))
    shared = np.flatnonzero(same & (t[1:] != t[:-1]))
    if not len(shared):
        return {}
    involved = sorted(set(t[shared].tolist()) | set(t[shared + 1].tolist()))
    first_of: dict[tuple, int] = {}
    tied: dict[int, int] = {}
    for i in involved:
        first = first_of.setdefault(_signature(entries[i]), i)
        if first != i:
            tied[i] = first
    for k in shared.tolist():  # every sharing pair must have landed in one group
        a, b = int(t[k]), int(t[k + 1])
        if tied.get(a, a) != tied.get(b, b):
            _refuse(entries, a, b, int(f[k]), int(o[k]))
    return tied


def reusable(entries: Mapping[str, TensorEntry], alias: Mapping[str, str | None]) -> dict[str, TensorEntry]:
    """``entries`` (a base's, by FQN in a new save's order) less the keys that may not
    reuse their rows there: of a tie in the base, a key other than its first unless the
    new save ties it to that first key again (``alias``: each FQN's ``alias_of``).
    Untied, two keys reusing one tie's bytes would share them. FormatError as
    :func:`tied_entries`."""
    order = list(entries)
    ties = tied_entries(list(entries.values())).items()
    drop = {order[i] for i, first in ties if alias.get(order[i]) != order[first]}
    return {k: e for k, e in entries.items() if k not in drop}


_V = TypeVar("_V")


def first_of_each(values: Mapping[str, _V]) -> dict[str, _V]:
    """``values`` without a key whose value (the same object) an earlier key has: a
    tied tensor is read into once."""
    first: dict[int, str] = {}
    for k, v in values.items():
        first.setdefault(id(v), k)
    return {k: values[k] for k in first.values()}


def _signature(e: TensorEntry) -> tuple:
    """What two FQNs that are one stored tensor agree on: dtype, shape and the set of
    their rows (file, byte offset, size, box); replicas of a row count once."""
    boxes = zip(map(tuple, e.offsets.tolist()), map(tuple, e.lengths.tolist()), strict=True)
    rows = zip(e.files.tolist(), e.byte_offsets.tolist(), e.sizes.tolist(), boxes, strict=True)
    return e.dtype, tuple(e.global_shape), frozenset(r for r in rows if r[2] > 0)


def _refuse(entries: Sequence[TensorEntry], a: int, b: int, file: int, at: int) -> None:
    ea, eb = entries[min(a, b)], entries[max(a, b)]
    raise FormatError(
        f"{ea.fqn!r} and {eb.fqn!r} share bytes of {ea.file_names[file]!r} (from byte {at}) without being one "
        "tied tensor (the same dtype, shape and rows): a read of both would allocate more than the files hold"
    )
