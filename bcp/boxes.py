"""Box geometry: the only shapes the planner sees.

A box is (offsets, lengths) per dimension of a global tensor. Fragments are boxes
stored row-major; local shards are boxes of destination memory. Everything here is
pure integer arithmetic, vectorised with numpy where counts can be large.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]


def intersect(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]) -> Box | None:
    """The overlap of two boxes, or None when it is empty (a 0-d box overlaps itself)."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len, strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def row_major_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(lengths):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def flat_range_to_boxes(shape: Sequence[int], start: int, count: int) -> list[tuple[Box, int]]:
    """Cut the flat (row-major) range [start, start+count) of ``shape`` into boxes.

    Returns (box, position of the box's first element within the range) pairs in
    range order; at most 2*ndim-1 boxes, each one contiguous in the range.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if start < 0 or count < 0 or start + count > total:
        raise ValueError(f"flat range [{start}, {start + count}) is outside a tensor of {total} elements {list(shape)}")
    if count == 0:
        return []
    strides = row_major_strides(shape)
    boxes: list[Box] = []

    def cut(prefix: tuple[int, ...], rest: tuple[int, ...], lo: int, hi: int) -> None:
        # [lo, hi) counts elements of the sub-tensor shape[len(prefix):] at index prefix
        if lo >= hi:
            return
        if not rest:
            boxes.append((prefix, (1,) * len(prefix)))
            return
        inner = math.prod(rest[1:])
        first, last = lo // inner, (hi - 1) // inner
        ones = (1,) * len(prefix)
        if lo % inner == 0 and hi % inner == 0:
            boxes.append(((*prefix, first, *(0,) * (len(rest) - 1)), (*ones, last - first + 1, *rest[1:])))
        elif first == last:
            cut((*prefix, first), rest[1:], lo - first * inner, hi - first * inner)
        else:
            cut((*prefix, first), rest[1:], lo - first * inner, inner)
            if last - first > 1:
                boxes.append(((*prefix, first + 1, *(0,) * (len(rest) - 1)), (*ones, last - first - 1, *rest[1:])))
            cut((*prefix, last), rest[1:], 0, hi - last * inner)

    cut((), shape, start, start + count)
    return [(box, sum(o * st for o, st in zip(box[0], strides, strict=True)) - start) for box in boxes]


def common_runs(
    region_off: Sequence[int],
    region_len: Sequence[int],
    src_off: Sequence[int],
    src_len: Sequence[int],
    dst_off: Sequence[int],
    dst_len: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, int]:
    """Pieces of ``region`` (inside both boxes) contiguous in both row-major layouts.

    Returns (src_starts, dst_starts, run_length), element offsets relative to each
    box's first element; every run has the same length. Trailing dimensions that the
    region spans fully in both boxes merge into one run.
    """
    ndim = len(region_len)
    if math.prod(region_len) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    if ndim == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), 1
    j = ndim - 1
    while j > 0 and region_len[j] == src_len[j] == dst_len[j]:
        j -= 1
    run = math.prod(region_len[j:])
    s_str, d_str = row_major_strides(src_len), row_major_strides(dst_len)
    s_base = sum((r - s) * st for r, s, st in zip(region_off, src_off, s_str, strict=True))
    d_base = sum((r - d) * st for r, d, st in zip(region_off, dst_off, d_str, strict=True))
    if j == 0:
        return np.array([s_base], np.int64), np.array([d_base], np.int64), run
    grids = np.indices(tuple(region_len[:j]), dtype=np.int64).reshape(j, -1)
    src = s_base + (grids * np.array(s_str[:j], np.int64)[:, None]).sum(axis=0)
    dst = d_base + (grids * np.array(d_str[:j], np.int64)[:, None]).sum(axis=0)
    return src, dst, run


def row_products(a: np.ndarray) -> np.ndarray:
    """Product of each row of an (N, D) int array (a box's element count), column by
    column: numpy's reductions along a short last axis are about 10x slower."""
    if a.shape[1] == 0:
        return np.ones(len(a), a.dtype)
    out = a[:, 0].copy()
    for d in range(1, a.shape[1]):
        out *= a[:, d]
    return out


def rows_positive(a: np.ndarray) -> np.ndarray:
    """Whether every value of each row of an (N, D) array is positive (column by
    column, as :func:`row_products`)."""
    out = np.ones(len(a), bool)
    for d in range(a.shape[1]):
        out &= a[:, d] > 0
    return out
