"""Incremental saves keep what depends on the structure alone (``bcp.kept_plans``,
``bcp.incremental``): the tensors' plans and pieces, the base-row lookups by the base's
URI and save id, and the rows of the checkpoint this process just committed as the
next save's lookup of it as a base. A kept plan is never served to a changed structure,
nor a lookup to another base or to a base replaced on storage."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
import bcp.incremental
import test_save_plan_keep as keep
from bcp.kept_plans import LocalPlans
from bcp.planning.cache import clear_plan_caches, plan_cache_for
from bcp.save_phases import prepare_save
from helpers import examples, tensor_bytes_equal

PIECE = 256  # bytes: a (16, 16) float32 tensor is 4 pieces of 4 rows


def local_plans() -> LocalPlans:
    return plan_cache_for("local").local(LocalPlans)


def count_catalog_reads(monkeypatch) -> list[str]:
    """The base catalogs read (``bcp.incremental.open_base``), by URI."""
    real, calls = bcp.incremental.open_base, []

    def counted(base, *args):
        calls.append(base)
        return real(base, *args)

    monkeypatch.setattr(bcp.incremental, "open_base", counted)
    return calls


def exact(uri: str, state: dict) -> None:
    loaded = bcp.open(uri).state()
    assert list(loaded) == list(state)
    for k, v in state.items():
        v = v.local if isinstance(v, bcp.TensorShard) else v
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and tensor_bytes_equal(loaded[k], v), k


def test_incremental_saves_reuse_their_kept_plan(tmp_path):
    clear_plan_caches()
    state = {"w": torch.randn(16, 16), "b": torch.randn(3), "s": bcp.TensorShard(torch.randn(8, 16), (8, 16), (0, 0))}
    bcp.save(state, str(tmp_path / "a"), incremental=True, piece_bytes=PIECE)
    assert (local_plans().built, local_plans().reused) == (1, 0)
    state["w"][5].add_(1)
    info = bcp.save(state, str(tmp_path / "b"), base=str(tmp_path / "a"), piece_bytes=PIECE)
    assert (local_plans().built, local_plans().reused) == (1, 1)
    assert info.bytes_written == 4 * 16 * 4  # the one piece holding row 5
    exact(str(tmp_path / "b"), state)
    bcp.save(state, str(tmp_path / "c"))  # a full save: pieces are not cut, planned apart
    bcp.save(state, str(tmp_path / "d"), base=str(tmp_path / "b"), piece_bytes=128)  # other pieces: apart
    assert (local_plans().built, local_plans().reused) == (3, 1)
    exact(str(tmp_path / "d"), state)


@pytest.mark.parametrize("piece_bytes", [64, 200, PIECE, 1 << 20])
def test_a_kept_incremental_plan_gives_what_planning_gives(piece_bytes):
    """The pieces of a reused plan are those of a fresh one, over this save's tensors."""
    a = torch.randn(16, 16)
    state = {"a": a, "tied": a, "s": bcp.TensorShard(torch.randn(6, 16), (12, 16), (6, 0)), "f": torch.randn(40)}
    flat = bcp.FlatShard(torch.randn(24), (8, 6), 12)
    state["flat"] = flat
    plans = LocalPlans()
    prepare_save(state, 0, False, plans=plans, piece_bytes=piece_bytes)
    again = {**state, "a": a.detach(), "tied": a.detach()}  # new tensor objects over the same memory
    second = prepare_save(again, 0, False, plans=plans, piece_bytes=piece_bytes)
    fresh = prepare_save(again, 0, False, piece_bytes=piece_bytes)
    assert (plans.built, plans.reused) == (1, 1)
    assert second.layout.digest() == fresh.layout.digest()
    assert [(i.plan, i.piece.box, i.tensor) for i in second.items] == [
        (i.plan, i.piece.box, i.tensor) for i in fresh.items
    ]
    for s, f in zip(second.items, fresh.items, strict=True):
        t, u = s.piece.tensor, f.piece.tensor
        assert (t.data_ptr(), t.shape, t.stride(), t.dtype) == (u.data_ptr(), u.shape, u.stride(), u.dtype)
    if piece_bytes < 1024:
        assert len(second.items) > 6  # pieces were cut


def check_incremental_second_save(root: str, first: list[str], second: list[str]) -> None:
    """``test_save_plan_keep``'s structure changes, saved incrementally (each save's base
    the one before, pieces small enough to be cut): each checkpoint holds exactly the
    state saved."""
    state, mem = keep.base_state()
    for how in first:
        state = keep.mutate(state, mem, how)
    later = state
    for how in second:
        later = keep.mutate(later, mem, how)
    base = None
    for n, s in enumerate((state, state, later, state)):
        uri = keep._no_fsync(os.path.join(root, f"s{n}"))
        bcp.save(s, uri, base=base, incremental=True, piece_bytes=32)
        keep.assert_exactly(keep.read_back(uri), s)
        base = uri


@pytest.mark.parametrize("how", keep.MUTATIONS)
def test_each_change_is_planned_again_incrementally(tmp_path, how):
    check_incremental_second_save(str(tmp_path), [], [how])


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.lists(st.sampled_from(keep.MUTATIONS), max_size=2),
    second=st.lists(st.sampled_from(keep.MUTATIONS), max_size=3),
)
def test_changes_in_any_combination_are_planned_again_incrementally(tmp_path_factory, first, second):
    check_incremental_second_save(str(tmp_path_factory.mktemp("keep")), first, second)


def test_the_base_just_committed_is_matched_without_reading_its_catalog(tmp_path, monkeypatch):
    clear_plan_caches()
    reads = count_catalog_reads(monkeypatch)
    state = {"w": torch.randn(16, 16), "v": torch.randn(64)}
    names = [str(tmp_path / n) for n in ("a", "b", "c")]
    bcp.save(state, names[0], incremental=True, piece_bytes=PIECE)
    for prev, uri in itertools.pairwise(names):
        state["w"][0].add_(1)
        info = bcp.save(state, uri, base=prev, piece_bytes=PIECE)
        assert info.bytes_written == 4 * 16 * 4  # the changed piece only
        exact(uri, state)
    assert reads == []  # each base was the save this process had just committed
    clear_plan_caches()  # nothing kept: the catalog is read as always
    state["w"][0].add_(1)
    assert bcp.save(state, str(tmp_path / "d"), base=names[2], piece_bytes=PIECE).bytes_written == 4 * 16 * 4
    assert reads == [names[2]]
    exact(str(tmp_path / "d"), state)


def test_a_base_replaced_by_another_writer_is_read_again(tmp_path, monkeypatch):
    """The rows kept for ``a`` are of the save that committed it: once another save
    replaced it (another structure here: its rows are kept elsewhere, as another
    process's would be), they are never served; the catalog on storage is read."""
    clear_plan_caches()
    reads = count_catalog_reads(monkeypatch)
    state = {"w": torch.randn(16, 16)}
    a = str(tmp_path / "a")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    other = {"w": state["w"].clone()}
    other["w"][:4].add_(1)  # the first piece differs from ``state``'s, the rest equal
    bcp.save(other, a, incremental=True, piece_bytes=PIECE, overwrite=True)  # the old generation is discarded
    info = bcp.save(state, str(tmp_path / "b"), base=a, piece_bytes=PIECE)
    assert reads == [a]
    assert info.bytes_written == 4 * 16 * 4  # the rows kept for the old ``a`` would have reused every piece
    exact(str(tmp_path / "b"), state)


def test_kept_lookups_are_keyed_by_the_base(tmp_path, monkeypatch):
    """Two bases saved apart (by other structures), used in turn by one structure: each
    save reuses exactly what its own base holds."""
    clear_plan_caches()
    reads = count_catalog_reads(monkeypatch)
    w = torch.randn(16, 16)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    bcp.save({"w": w.clone()}, x, incremental=True, piece_bytes=PIECE)
    changed = w.clone()
    changed[8:].add_(1)
    bcp.save({"w": changed}, y, incremental=True, piece_bytes=PIECE)
    for n in range(4):
        base, want = (x, 0) if n % 2 == 0 else (y, 2 * 4 * 16 * 4)
        info = bcp.save({"w": w}, str(tmp_path / f"s{n}"), base=base, piece_bytes=PIECE)
        assert info.bytes_written == want, (n, base)
        exact(str(tmp_path / f"s{n}"), {"w": w})
    assert reads == [x, y]  # each base's catalog read once, then its lookup kept
