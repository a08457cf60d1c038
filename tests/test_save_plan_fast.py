"""The coordinator's save planner against a brute-force reference on random layouts.

plan_save has two paths: the matrix path (every rank holds every tensor, one box
each, nothing tied: FSDP) and the general path (sorting). Both must give exactly the
plan of a per-box Python reference (below), and both must refuse exactly the layouts
whose distinct boxes do not tile a tensor (checked element by element), naming it.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.errors import ShardingError
from bcp.metadata import itemsize
from bcp.metadata.geometry import Box
from bcp.planning import GlobalPlan, LayoutMeta, LocalLayout, TensorPlan, plan_save
from helpers import examples

DTYPES = ["float32", "bfloat16", "int8", "float64"]


# -- reference -----------------------------------------------------------------------


def brute_force_tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Every element covered by exactly one distinct box, every box inside the shape."""
    for off, lens in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, lens, shape, strict=True)):
            return False
    if math.prod(shape) == 0:
        return True
    grid = np.zeros(shape, dtype=np.int64)
    for off, lens in set(boxes):
        grid[tuple(slice(o, o + n) for o, n in zip(off, lens, strict=True))] += 1
    return bool((grid == 1).all())


def reference_plan(layouts: list[LocalLayout]) -> GlobalPlan | str:
    """Per-box Python: the plan, or the fqn of the first tensor (in order of first
    appearance) whose shards are refused."""
    world = len(layouts)
    info: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    holders: dict[str, dict[Box, list[tuple[int, int]]]] = {}
    alias_seen: dict[str, set[str | None]] = {}
    for rank, layout in enumerate(layouts):
        m = LayoutMeta.decode(layout.meta)
        boxes = layout.boxes()
        per = dict.fromkeys(m.fqns)
        for i, (fqn, box) in enumerate(boxes):
            holders.setdefault(fqn, {}).setdefault(box, []).append((rank, i))
        for fqn, path, dtype, shape, alias in zip(m.fqns, m.key_paths, m.dtypes, m.shapes, m.aliases, strict=True):
            if info.setdefault(fqn, (path, dtype, shape)) != (path, dtype, shape):
                return f"mismatch:{fqn}"
            holders.setdefault(fqn, {})
            alias_seen.setdefault(fqn, set()).add(alias)
        assert set(per) >= {f for f, _b in boxes}
    order = list(info)
    holders = {f: holders[f] for f in order}
    for fqn in order:
        if not brute_force_tiles(info[fqn][2], list(holders[fqn])) or (
            not holders[fqn] and math.prod(info[fqn][2]) > 0
        ):
            return fqn
    aliases: dict[str, str] = {}
    for fqn in order:
        targets = alias_seen[fqn]
        if len(targets) == 1:
            target = next(iter(targets))
            if (
                target is not None
                and target in holders
                and target not in aliases
                and set(holders[fqn]) <= set(holders[target])
            ):
                aliases[fqn] = target
    load = [0] * world
    chosen: list[list[int]] = [[] for _ in range(world)]
    owner: dict[tuple[str, Box], int] = {}
    replicated = []
    for tid, fqn in enumerate(order):
        if fqn in aliases:
            continue
        for box, where in holders[fqn].items():
            nbytes = math.prod(box[1]) * itemsize(info[fqn][1])
            if len(where) == 1:
                load[where[0][0]] += nbytes
                chosen[where[0][0]].append(where[0][1])
                owner[(fqn, box)] = where[0][0]
            else:
                replicated.append((nbytes, tid, box, where))
    replicated.sort(key=lambda it: (-it[0], it[1], it[2]))
    for nbytes, tid, box, where in replicated:
        rank, index = min(where, key=lambda ri: (load[ri[0]], ri[0]))
        load[rank] += nbytes
        chosen[rank].append(index)
        owner[(order[tid], box)] = rank
    for fqn, target in aliases.items():
        for box, where in holders[fqn].items():
            r = owner[(target, box)]
            mine = [i for rr, i in where if rr == r]
            rank, index = (r, mine[0]) if mine else min(where)
            chosen[rank].append(index)
    writes = {r: np.array(sorted(c), dtype=np.int32) for r, c in enumerate(chosen)}
    return GlobalPlan(writes, dict(enumerate(load)), len(order), sum(load))


def assert_same(plan: GlobalPlan, ref: GlobalPlan) -> None:
    assert plan.tensors == ref.tensors
    assert plan.total_bytes == ref.total_bytes
    assert plan.bytes_per_rank == ref.bytes_per_rank
    assert plan.writes.keys() == ref.writes.keys()
    for r in ref.writes:
        assert plan.writes[r].tolist() == ref.writes[r].tolist(), f"rank {r}"


def check_against_reference(layouts: list[LocalLayout]) -> None:
    ref = reference_plan(layouts)
    for matrix in (True, False):
        if isinstance(ref, str):
            with pytest.raises(ShardingError) as err:
                plan_save(layouts, matrix=matrix)
            name = ref.split(":")[-1]
            assert f"tensor {name!r}" in str(err.value)
        else:
            assert_same(plan_save(layouts, matrix=matrix), ref)


# -- random layouts --------------------------------------------------------------------


@st.composite
def splits(draw, n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive (start, length) intervals covering range(n), some empty."""
    inner = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    cuts = [0, *inner, n]
    return [(a, b - a) for a, b in itertools.pairwise(cuts)]


@st.composite
def tensor_boxes(draw, shape: tuple[int, ...], world: int, one_each: bool) -> list[list[Box]]:
    """Per rank, the boxes it holds of one tensor."""
    nd = len(shape)
    kind = draw(st.sampled_from(["whole", "dim", "dim", "grid"] if nd else ["whole"]))
    if kind == "whole":
        parts: list[Box] = [((0,) * nd, shape)]
    elif kind == "dim" or nd == 1:
        k = draw(st.integers(0, nd - 1))
        cut = draw(splits(shape[k], draw(st.integers(1, world))))
        parts = [
            (tuple(a if d == k else 0 for d in range(nd)), tuple(n if d == k else shape[d] for d in range(nd)))
            for a, n in cut
        ]
    else:
        k1, k2 = sorted(draw(st.lists(st.integers(0, nd - 1), min_size=2, max_size=2, unique=True)))
        c1 = draw(splits(shape[k1], draw(st.integers(1, 3))))
        c2 = draw(splits(shape[k2], draw(st.integers(1, 3))))
        parts = []
        for a1, n1 in c1:
            for a2, n2 in c2:
                off = [0] * nd
                lens = list(shape)
                off[k1], lens[k1], off[k2], lens[k2] = a1, n1, a2, n2
                parts.append((tuple(off), tuple(lens)))
    if one_each:
        how = draw(st.sampled_from(["blocks", "strided", "random"]))
        if how == "blocks":
            pick = [r * len(parts) // world for r in range(world)]
        elif how == "strided":
            pick = [r % len(parts) for r in range(world)]
        else:
            pick = draw(st.lists(st.integers(0, len(parts) - 1), min_size=world, max_size=world))
        out = [[parts[p]] for p in pick]
    else:
        out = [[] for _ in range(world)]
        for p in parts:
            for r in draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)):
                out[r].append(p)
    if draw(st.integers(0, 9)) == 0 and nd:  # break it: drop a box, or add one that overlaps
        r = draw(st.integers(0, world - 1))
        if draw(st.booleans()) and out[r]:
            out[r][0] = ((0,) * nd, tuple(max(1, s) for s in shape))
        else:
            out[r] = out[r][1:] if not one_each else out[r]
    return out


@st.composite
def layouts(draw, one_each: bool | None = None) -> list[LocalLayout]:
    world = draw(st.integers(1, 6))
    one_each = draw(st.booleans()) if one_each is None else one_each
    count = draw(st.integers(1, 4))
    per_rank: list[list[TensorPlan]] = [[] for _ in range(world)]
    plans = []
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        boxes = draw(tensor_boxes(shape, world, one_each))
        plans.append((f"t{i}", dtype, shape, boxes))
    tied = draw(st.integers(0, 3)) == 0 and not one_each
    for fqn, dtype, shape, boxes in plans:
        for r in range(world):
            if boxes[r] or one_each or draw(st.booleans()):
                per_rank[r].append(TensorPlan(fqn, f'["{fqn}"]', dtype, shape, tuple(boxes[r])))
            if tied and fqn == "t0" and (boxes[r] or draw(st.booleans())):
                alias = "t0" if draw(st.integers(0, 5)) else None
                per_rank[r].append(TensorPlan("tied", '["tied"]', dtype, shape, tuple(boxes[r]), alias))
    return [LocalLayout.build(r, ts) for r, ts in enumerate(per_rank)]


@settings(max_examples=examples(300))
@given(layouts())
def test_both_paths_match_the_reference(ls):
    check_against_reference(ls)


@settings(max_examples=examples(200))
@given(layouts(one_each=True))
def test_one_box_each_layouts_match_the_reference(ls):
    check_against_reference(ls)


# -- fixed cases -----------------------------------------------------------------------


def test_a_tied_box_follows_its_targets_writer_whatever_the_indices():
    """Found by hypothesis: rank 0 holds five boxes of t0 (and of its alias), the other
    ranks one empty box each. The empty box at offset 1 is written by rank 1 (index 0);
    its tied copy must follow it to rank 1, not stay on rank 0 because the key of
    rank 0's index 4 collided with rank 1's index 0 under a radix taken from the
    written indices alone."""
    boxes0 = (((0,), (0,)), ((0,), (0,)), ((0,), (0,)), ((0,), (1,)), ((1,), (0,)))
    layouts = []
    for r in range(6):
        boxes = boxes0 if r == 0 else (((1,), (0,)),)
        ts = [
            TensorPlan("t0", '["t0"]', "float32", (1,), boxes),
            TensorPlan("tied", '["tied"]', "float32", (1,), boxes, "t0"),
        ]
        layouts.append(LocalLayout.build(r, ts))
    check_against_reference(layouts)
    assert plan_save(layouts).writes[1].tolist() == [0, 1]


def fsdp(world: int, shapes: list[tuple[int, ...]], dim: int = 0, empty_at: int | None = None) -> list[LocalLayout]:
    """Each tensor cut along ``dim`` as torch.chunk cuts it (trailing ranks may hold
    the same empty box, at the end or at ``empty_at``)."""
    out = []
    for r in range(world):
        ts = []
        for i, shape in enumerate(shapes):
            if not shape:
                ts.append(TensorPlan(f"w{i}", f'["w{i}"]', "bfloat16", shape, (((), ()),)))
                continue
            size = -(-shape[dim] // world)
            a, n = min(r * size, shape[dim]), max(0, min(size, shape[dim] - r * size))
            a = a if n or empty_at is None or empty_at > shape[dim] else empty_at
            off = tuple(a if d == dim else 0 for d in range(len(shape)))
            lens = tuple(n if d == dim else s for d, s in enumerate(shape))
            ts.append(TensorPlan(f"w{i}", f'["w{i}"]', "bfloat16", shape, ((off, lens),)))
        out.append(LocalLayout.build(r, ts))
    return out


@pytest.mark.parametrize("empty_at", [None, 0, 1])
def test_fsdp_with_empty_shards_takes_the_matrix_path(monkeypatch, empty_at):
    import bcp.planning.plan as sp

    ls = fsdp(8, [(3, 4), (16, 2), (0, 5), (), (5,)], empty_at=empty_at)
    monkeypatch.setattr(sp, "plan_general", lambda *a: pytest.fail("general path used"))
    plan = plan_save(ls)
    monkeypatch.undo()
    ref = reference_plan(ls)
    assert isinstance(ref, GlobalPlan)
    assert_same(plan, ref)
    # every distinct box exactly once: the 3 rows of w0 and 16 of w1, one empty w0 box,
    # one each of the empty tensor, the 0-d one and the whole 1-d one
    written = [b for r, idx in plan.writes.items() for b in (ls[r].boxes()[i] for i in idx.tolist())]
    assert len(written) == len(set(written))
    assert sum(1 for f, _b in written if f == "w0") == 4


def test_layout_round_trip_and_digest():
    ts = [
        TensorPlan("a", '["a"]', "float32", (4, 6), (((0, 0), (2, 6)), ((2, 0), (2, 6)))),
        TensorPlan("s", "[]", "int8", (), (((), ()),)),
    ]
    lay = LocalLayout.build(0, ts)
    assert lay.offsets.dtype == np.int32 and lay.counts.tolist() == [2, 1]
    assert lay.boxes() == [("a", ((0, 0), (2, 6))), ("a", ((2, 0), (2, 6))), ("s", ((), ()))]
    same = LocalLayout.build(1, ts)
    assert same.digest() == lay.digest() and same.meta_digest == lay.meta_digest
    moved = LocalLayout.build(0, [ts[0], TensorPlan("s", "[]", "int8", (), ())])
    assert moved.meta_digest == lay.meta_digest and moved.digest() != lay.digest()
    big = LocalLayout.build(0, [TensorPlan("b", "[]", "int8", (1 << 33,), (((1 << 32,), (1 << 32,)),))])
    assert big.offsets.dtype == np.int64 and big.boxes()[0][1] == ((1 << 32,), (1 << 32,))
    # the coordinator may get the meta apart (by digest)
    plan = plan_save([lay.without_meta(), same], meta={lay.meta_digest: lay.meta})
    assert plan.total_bytes == 4 * 6 * 4 + 1
    with pytest.raises(ShardingError, match="no layout metadata"):
        plan_save([lay.without_meta()])
    with pytest.raises(ShardingError, match="does not match its digest"):
        plan_save([LocalLayout(0, b"[]", lay.meta_digest, np.zeros(0, np.int32), lay.offsets[:0], lay.lengths[:0])])


def test_malformed_layouts_are_refused():
    lay = LocalLayout.build(0, [TensorPlan("a", "[]", "float32", (4,), (((0,), (4,)),))])
    with pytest.raises(ShardingError, match="wrong size"):
        plan_save([LocalLayout(0, lay.meta, lay.meta_digest, lay.counts, lay.offsets[:0], lay.lengths)])
    with pytest.raises(ShardingError, match="counts"):
        plan_save([LocalLayout(0, lay.meta, lay.meta_digest, np.array([-1], np.int32), lay.offsets, lay.lengths)])
    for meta in [b"{", b'[["a","[]","float32",[-1],null]]', b'[["a","[]","nonsense",[1],null]]', b'[["a"]]']:
        from bcp.planning.local_layout import meta_digest

        bad = LocalLayout(0, meta, meta_digest(meta), lay.counts, lay.offsets, lay.lengths)
        with pytest.raises(ShardingError):
            plan_save([bad])


@pytest.mark.parametrize("where", ["outside", "overlap", "gap"])
@pytest.mark.parametrize("matrix", [True, False])
def test_errors_name_the_tensor_and_the_problem(where, matrix):
    good = fsdp(4, [(8, 4), (6, 6)], dim=1)  # w1: ranks 0-2 hold columns [0, 2), [2, 4), [4, 6)
    rank, boxes = {"outside": (3, ((0, 5), (6, 2))), "overlap": (3, ((0, 1), (6, 2))), "gap": (2, ((0, 4), (6, 1)))}[
        where
    ]
    w0 = good[rank].boxes()[0][1]
    ts = [
        TensorPlan("w0", '["w0"]', "bfloat16", (8, 4), (w0,)),
        TensorPlan("w1", '["w1"]', "bfloat16", (6, 6), (boxes,)),
    ]
    ls = list(good)
    ls[rank] = LocalLayout.build(rank, ts)
    want = {
        "outside": r"tensor 'w1': shard offsets=\[0, 5\] lengths=\[6, 2\] lies outside the global shape \[6, 6\]",
        "overlap": r"tensor 'w1': shards .* overlap but are not identical",
        "gap": r"tensor 'w1': shards cover 30 of its 36 elements",
    }[where]
    with pytest.raises(ShardingError, match=want):
        plan_save(ls, matrix=matrix)


def test_ranks_disagreeing_name_both_ranks():
    a, b = (TensorPlan("w", "[]", "float32", (n,), (((0,), (n,)),)) for n in (4, 5))
    ls = [LocalLayout.build(r, [t]) for r, t in enumerate([a, a, b, b])]
    for matrix in (True, False):
        with pytest.raises(ShardingError, match=r"tensor 'w': rank 0 has float32\[4\] but rank 2 has float32\[5\]"):
            plan_save(ls, matrix=matrix)
    with pytest.raises(ShardingError, match="rank 1's layout says it is rank 0"):
        plan_save([ls[0], ls[0]])


def test_ddp_replicas_are_balanced_largest_first():
    ts = [TensorPlan(f"w{i}", "[]", "float32", (1000 + 37 * i,), (((0,), (1000 + 37 * i,)),)) for i in range(40)]
    ls = [LocalLayout.build(r, ts) for r in range(4)]
    plan = plan_save(ls)
    ref = reference_plan(ls)
    assert isinstance(ref, GlobalPlan)
    assert_same(plan, ref)
    loads = list(plan.bytes_per_rank.values())
    assert max(loads) - min(loads) <= (1000 + 37 * 39) * 4


@pytest.mark.parametrize("kind", ["dim0", "dim1", "2d"])
def test_one_tensor_in_4096_boxes_is_fast(kind):
    """Never quadratic: the old sweep on dim 0 took 14 s for 4,096 boxes cut on dim 1."""
    world, n = 4096, 8192
    if kind == "2d":
        side = 64
        ls = [
            LocalLayout.build(
                r,
                [TensorPlan("w", "[]", "bfloat16", (n, n), ((((r // side) * 128, (r % side) * 128), (128, 128)),))],
            )
            for r in range(world)
        ]
    else:
        ls = fsdp(world, [(n, n)], dim=0 if kind == "dim0" else 1)
    best = math.inf
    for _ in range(3):
        t0 = time.process_time()
        plan = plan_save(ls)
        best = min(best, time.process_time() - t0)
    assert plan.total_bytes == n * n * 2
    assert all(len(w) == 1 for w in plan.writes.values())
    assert best < 0.5, f"{best:.3f} s"
