"""The commit's per-tensor steps by C loops (issue 37, per-tensor costs of a save of
10,000 tensors): each gives exactly what the loop it replaced gave."""

from __future__ import annotations

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.metadata.catalog import TensorTable
from bcp.metadata.catalog.tensors import codes_of_first_use
from bcp.planning.local_layout import LayoutMeta
from bcp.planning.writer_rows import _tensor_info, report_rows


@given(st.lists(st.sampled_from(["a", "b", "[1]", "", "é", "a.b"]), max_size=40))
def test_codes_of_first_use_are_the_setdefault_loops(values):
    index: dict[str, int] = {}
    want = [index.setdefault(v, len(index)) for v in values]
    codes, got = codes_of_first_use(values)
    assert codes.tolist() == want and got == index and list(got) == list(index)


@given(
    st.lists(
        st.tuples(st.sampled_from(["k1", "k2"]), st.sampled_from(["float32", "bfloat16"]), st.tuples()), max_size=20
    )
)
def test_a_table_of_distinct_names_is_what_adding_each_gives(rows):
    infos = [(f"t{i}", kp, dt, shape) for i, (kp, dt, shape) in enumerate(rows)]
    one = TensorTable()
    for info in infos:
        one.add(*info)
    other = TensorTable.of_distinct(infos)
    for field in ("names", "index", "key_paths", "dtypes", "shapes"):
        assert getattr(other, field) == getattr(one, field), field
    assert other.arrays.kp.tolist() == one.arrays.kp.tolist()


def _report_rows_reference(checksums, unique, offsets, source):
    """The loop report_rows ran before: every item's pieces sorted by start, joined."""
    pieces: dict[int, list] = {item: [] for item in unique}
    for (item, start), sums in checksums.items():
        pieces[item].append((start, sums))
    sums_of = {item: [c for _s, part in sorted(parts) for c in part] for item, parts in pieces.items()}
    file_sums = [c for item in sorted(unique, key=lambda i: offsets[i]) for c in sums_of[item]]
    return [sums_of[s] for s in source], file_sums


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_report_rows_join_pieces_as_the_old_loop_did(data):
    """Items of one piece, of several (a batch boundary inside them, pieces in any
    order) and of none (no bytes), items sharing another's bytes: the same checksum
    lists per row and in file order."""
    n = data.draw(st.integers(1, 12))
    cuts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # pieces per item
    offsets = data.draw(st.permutations(range(0, 100 * n, 100)))
    checksums: dict[tuple[int, int], list[int]] = {}
    for item, k in enumerate(cuts):
        for j in range(k):
            checksums[(item, j * 10)] = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3))
    keys = data.draw(st.permutations(list(checksums)))
    checksums = {k: checksums[k] for k in keys}  # any insertion order
    unique = list(range(n))
    source = data.draw(st.lists(st.sampled_from(unique), min_size=1, max_size=2 * n))
    items = [types.SimpleNamespace(tensor=i, piece=types.SimpleNamespace(box=((0,), (1,)))) for i in range(len(source))]
    want_rows, want_file = _report_rows_reference(checksums, unique, offsets, source)
    rows, file_sums = report_rows(checksums, unique, offsets, source, items, [4] * len(source))
    assert file_sums == want_file
    assert rows.column("checksums").to_pylist() == want_rows


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.randoms(use_true_random=False), st.booleans())
def test_tensor_info_in_save_order_or_not_is_the_loops(n, rnd, shuffled):
    """One rank's layout in save order (taken as it is) or permuted, alone or beside a
    second rank's: each position's (fqn, key path, dtype, shape) as the loop made it."""
    order = [f"t{i}" for i in range(n)]
    mine = order[:]
    if shuffled:
        rnd.shuffle(mine)

    def meta(fqns):
        return LayoutMeta(
            tuple(fqns),
            tuple(f"[{f}]" for f in fqns),
            ("float32",) * len(fqns),
            tuple([i] for i, _f in enumerate(fqns)),
            (None,) * len(fqns),
        )

    metas = [meta(mine), meta(order[::-1])]
    for given_metas in (metas[:1], metas):
        known, to_global = _tensor_info(given_metas, order)
        want: list = [None] * n
        for m in given_metas:
            for i, f in enumerate(m.fqns):
                g = order.index(f)
                if want[g] is None:
                    want[g] = (m.fqns[i], m.key_paths[i], m.dtypes[i], tuple(m.shapes[i]))
        assert known == want
        assert all(np.array_equal(to_global[id(m)], [order.index(f) for f in m.fqns]) for m in given_metas)
