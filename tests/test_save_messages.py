"""What the save sends between ranks: status rounds, writer reports as columns, the
coordinator's merge of fragment rows (checked against the Fragment-object path it
replaced, on random rows: aliases, replicas, empty boxes, 0-d to 3-d tensors)."""

from __future__ import annotations

import itertools
import pickle

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcp.coordination.collectives import Coordinator, portable
from bcp.errors import RankFailedError
from bcp.metadata import CATALOG_SCHEMA, Catalog, FileEntry, FormatError, Fragment
from bcp.planning import LayoutMeta, TensorPlan
from bcp.planning.writer_rows import REPORT_SCHEMA, Merged, WriterReport, fragment_table, merge_reports, row_stats
from helpers import examples

# -- status rounds ------------------------------------------------------------------------


class TwoRanks(Coordinator):
    """Rank 0 of a simulated two-rank group whose other rank's status is given."""

    world_size = 2

    def __init__(self, other: BaseException | None) -> None:
        self.other = other
        self.rounds: list[str] = []

    def any_failed(self, failed: bool) -> bool:
        self.rounds.append("flag")
        return failed or self.other is not None

    def all_gather(self, obj):
        self.rounds.append("gather")
        return [obj, None if self.other is None else portable(self.other)]


def test_a_phase_that_succeeded_everywhere_costs_one_flag_round():
    coord = TwoRanks(None)
    coord.check(None, "writing data")
    assert coord.rounds == ["flag"]


def test_errors_are_gathered_only_when_some_rank_failed():
    coord = TwoRanks(KeyError("lost"))
    with pytest.raises(RankFailedError) as info:
        coord.check(None, "writing data")
    assert coord.rounds == ["flag", "gather"]
    assert set(info.value.errors) == {1} and isinstance(info.value.errors[1], KeyError)
    assert "writing data failed on 1 of 2 ranks" in str(info.value)


def test_the_failed_rank_raises_its_own_error_naming_the_others():
    coord = TwoRanks(ValueError("theirs"))
    mine = OSError("mine")
    with pytest.raises(OSError, match="mine") as info:
        coord.check(mine, "committing")
    assert info.value is mine
    assert any("rank 1: ValueError: theirs" in note for note in info.value.__notes__)


def test_generic_any_failed_gathers_flags():
    class Gathering(Coordinator):
        world_size = 3

        def all_gather(self, obj):
            return [False, obj, False]

    assert Gathering().any_failed(True) and not Gathering().any_failed(False)


# -- fragment rows ------------------------------------------------------------------------


@st.composite
def fragment_sets(draw) -> list[list[Fragment]]:
    """Per-writer lists of fragments of a few tensors: boxes on a grid, some replicated
    on several writers, some tied (same file bytes, another FQN), some empty."""
    writers = draw(st.integers(1, 4))
    out: list[list[Fragment]] = [[] for _ in range(writers)]
    offsets = [0] * writers
    for t in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        size = 4 if dtype == "float32" else 2
        cut = draw(st.integers(0, ndim)) if ndim else 0
        boxes = []
        if ndim == 0 or cut == ndim or shape[cut] == 0:
            boxes.append(((0,) * ndim, shape))
        else:
            edges = sorted({0, shape[cut], *draw(st.lists(st.integers(0, shape[cut]), max_size=3))})
            for a, b in itertools.pairwise(edges):
                off = tuple(a if d == cut else 0 for d in range(ndim))
                lens = tuple(b - a if d == cut else shape[d] for d in range(ndim))
                boxes.append((off, lens))
            if draw(st.booleans()):
                boxes.append((tuple(shape[cut] if d == cut else 0 for d in range(ndim)), (0,) * ndim))
        draw(st.randoms()).shuffle(boxes)
        tie = draw(st.booleans())
        for off, lens in boxes:
            holders = draw(st.lists(st.integers(0, writers - 1), min_size=1, max_size=2, unique=True))
            n = size
            for x in lens:
                n *= x
            for w in holders:
                frag = Fragment(f"t{t}", f'[["d","t{t}"]]', dtype, shape, off, lens, f"f{w}", offsets[w], n, (n,), w)
                out[w].append(frag)
                if tie:
                    out[w].append(
                        Fragment(
                            f"tie{t}", f'[["d","tie{t}"]]', dtype, shape, off, lens, f"f{w}", offsets[w], n, (n,), w
                        )
                    )
                offsets[w] += n
    return out


def old_order(frags: list[Fragment], order: list[str]) -> list[Fragment]:
    pos = {n: i for i, n in enumerate(order)}
    return sorted(frags, key=lambda f: (pos[f.fqn], f.offsets, f.writer_rank))


def old_stats(frags: list[Fragment]) -> dict[str, int]:
    unique = {(f.file, f.byte_offset, f.offsets, f.lengths) for f in frags}
    logical = {(f.fqn, f.offsets, f.lengths): f.nbytes for f in frags}
    return {"tensors": len({f.fqn for f in frags}), "fragments": len(unique), "tensor_bytes": sum(logical.values())}


def sort_key(f: Fragment):
    return (f.fqn, f.offsets, f.writer_rank, f.lengths, f.byte_offset)


def compact_reports(per_writer: list[list[Fragment]]) -> tuple[list[WriterReport], list[LayoutMeta]]:
    """What each writer sends for these fragments: rows naming tensors by their index
    in the writer's layout metadata."""
    reports, metas = [], []
    for w, frags in enumerate(per_writer):
        first = {f.fqn: f for f in frags}
        names = list(first)
        meta = LayoutMeta(
            tuple(names),
            tuple(first[n].key_path for n in names),
            tuple(first[n].dtype for n in names),
            tuple(first[n].global_shape for n in names),
            (None,) * len(names),
        )
        rows = pa.table(
            [
                pa.array([names.index(f.fqn) for f in frags], pa.int32()),
                pa.array([f.offsets for f in frags], pa.list_(pa.int64())),
                pa.array([f.lengths for f in frags], pa.list_(pa.int64())),
                pa.array([f.byte_offset for f in frags], pa.int64()),
                pa.array([f.nbytes for f in frags], pa.int64()),
                pa.array([f.checksums for f in frags], pa.list_(pa.uint32())),
            ],
            schema=REPORT_SCHEMA,
        )
        size = max((f.byte_offset + f.nbytes for f in frags), default=0)
        plans = {
            i: TensorPlan(n, first[n].key_path, first[n].dtype, first[n].global_shape, ()) for i, n in enumerate(names)
        }
        reports.append(WriterReport(rows, FileEntry(f"f{w}", size, "0" * 8) if frags else None, w, plans))
        metas.append(meta)
    return reports, metas


def as_fragments(table: pa.Table) -> list[Fragment]:
    return WriterReport.fragments_of(table)


def shuffled_merge(per_writer: list[list[Fragment]], rnd) -> tuple[list[Fragment], list[str], Merged]:
    """Writers' rows (half the time out of file and save order: the merge must not rely
    on it) merged in a random save order, the reports pickled as gather_object sends them."""
    if rnd.random() < 0.5:
        for frags in per_writer:
            rnd.shuffle(frags)
    everything = [f for frags in per_writer for f in frags]
    order = list(dict.fromkeys(f.fqn for f in everything))
    rnd.shuffle(order)
    reports, metas = compact_reports(per_writer)
    merged = merge_reports([pickle.loads(pickle.dumps(r)) for r in reports], metas, order)
    return everything, order, merged


@settings(max_examples=examples(200), deadline=None)
@given(fragment_sets(), st.randoms())
def test_merged_rows_match_the_fragment_object_path(per_writer, rnd):
    everything, order, merged = shuffled_merge(per_writer, rnd)
    expected = old_order(everything, order)
    got = as_fragments(merged.table)
    assert [sort_key(f) for f in got] == [sort_key(f) for f in expected]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert merged.stats == old_stats(everything)
    assert row_stats(merged.table) == old_stats(everything)
    assert row_stats(fragment_table(everything)) == old_stats(everything)


def catalog_table_of(frags: list[Fragment], files: list[str]) -> pa.Table:
    """Rows as the merge used to hand them to Catalog.from_table: plain string columns,
    the file column dictionary-encoded with the writers' files in rank order."""
    table = fragment_table(frags)
    codes = pa.array([files.index(f.file) for f in frags], pa.int32())
    column = pa.DictionaryArray.from_arrays(codes, pa.array(files, pa.string()))
    return table.set_column(table.schema.get_field_index("file"), "file", column)


@settings(max_examples=examples(200), deadline=None)
@given(fragment_sets(), st.randoms())
def test_the_commit_encodes_the_same_catalog_bytes_as_catalog_from_table(per_writer, rnd):
    """merged.catalog_bytes() (rows encoded as merged, no Catalog) is byte for byte the
    catalog the commit wrote before: Catalog.from_table(rows in catalog order).to_arrow()."""
    everything, order, merged = shuffled_merge(per_writer, rnd)
    files = [f"f{w}" for w, frags in enumerate(per_writer) if frags]
    expected = Catalog.from_table(catalog_table_of(old_order(everything, order), files)).to_arrow()
    assert merged.catalog_bytes() == expected
    assert Catalog.from_table(merged.table).to_arrow() == expected


def test_the_commit_encodes_the_same_bytes_over_several_sections():
    """Enough rows for several sections (the random layouts above fit in one): tensors
    of 1 and 2 dimensions cut on dim 0 over 12 writers, some boxes empty, one writer's
    rows out of save order."""
    writers, tensors = 12, 1024
    per_writer: list[list[Fragment]] = [[] for _ in range(writers)]
    for t in range(tensors):
        shape = (t % 30 + 1,) if t % 3 else (t % 30 + 1, 2)
        step = -(-shape[0] // writers)
        for w in range(writers):
            a, b = min(w * step, shape[0]), min((w + 1) * step, shape[0])
            off, lens = (a, *(0 for _ in shape[1:])), (b - a, *shape[1:])
            n = 4 * (b - a) * (shape[1] if len(shape) > 1 else 1)
            at = sum(f.nbytes for f in per_writer[w])
            per_writer[w].append(Fragment(f"t{t}", "[]", "float32", shape, off, lens, f"f{w}", at, n, (n,), w))
    per_writer[5].reverse()
    everything = [f for frags in per_writer for f in frags]
    order = [f"t{t}" for t in range(tensors)]
    reports, metas = compact_reports(per_writer)
    merged = merge_reports(reports, metas, order)
    files = [f"f{w}" for w in range(writers)]
    expected = Catalog.from_table(catalog_table_of(old_order(everything, order), files)).to_arrow()
    assert merged.catalog_bytes() == expected


def test_the_commit_encodes_no_rows_as_before():
    reports, metas = compact_reports([[], []])
    merged = merge_reports(reports, metas, [])
    assert merged.catalog_bytes() == Catalog.from_table(CATALOG_SCHEMA.empty_table()).to_arrow()


def test_the_commit_refuses_a_box_of_another_rank_than_its_tensor():
    frags = [Fragment("w", "[]", "float32", (4, 2), (0, 0), (4, 2), "f0", 0, 32, (7,), 0)]
    (report,), (meta,) = compact_reports([frags])
    bad = LayoutMeta(meta.fqns, meta.key_paths, meta.dtypes, ((4, 2, 1),), meta.aliases)
    with pytest.raises(FormatError, match="box of 2 dimension"):
        merge_reports([report], [bad], ["w"])


def test_reports_travel_compact_and_read_back_as_fragments():
    frags = [
        Fragment("w", "[]", "float32", (4, 2), (0, 0), (2, 2), "f0", 0, 16, (7,), 0),
        Fragment("w", "[]", "float32", (4, 2), (2, 0), (2, 2), "f0", 64, 16, (8,), 0),
        Fragment("s", "[]", "int64", (), (), (), "f0", 128, 8, (9,), 0),
    ]
    (report,), (meta,) = compact_reports([frags])
    assert report.fragments == frags, "the writer reads its own rows back"
    sent = pickle.loads(pickle.dumps(report))
    assert sent.tensors == {} and "fqn" not in sent.rows.column_names, "tensor names are not sent"
    merged = merge_reports([sent], [meta], ["s", "w"])
    assert [f.fqn for f in as_fragments(merged.table)] == ["s", "w", "w"]
    assert merged.stats == {"tensors": 2, "fragments": 3, "tensor_bytes": 40}


# -- plan cache ---------------------------------------------------------------------------


def test_plan_cache_keeps_the_last_two_plans_and_their_metadata():
    import numpy as np

    from bcp.planning import LayoutMeta
    from bcp.planning.cache import PlanCache, PlanSummary, plan_key

    cache = PlanCache(keep=2)
    meta = {bytes([i]) * 16: LayoutMeta((f"t{i}",), ("[]",), ("float32",), ((2,),), (None,)) for i in range(3)}
    keys = [plan_key([bytes([i]) * 16]) for i in range(3)]
    assert len(set(keys)) == 3 and plan_key([b"a" * 16, b"b" * 16]) != plan_key([b"b" * 16, b"a" * 16])
    for i, key in enumerate(keys):
        digest = bytes([i]) * 16
        cache.remember_plan(key, PlanSummary({0: 8}, 1, 8, (f"t{i}",), {digest: meta[digest]}))
        cache.remember_writes(key, np.array([i], np.int32))
    assert cache.plan(keys[0]) is None and cache.plan(keys[2]).order == ("t2",)
    assert set(cache.metas()) == {bytes([1]) * 16, bytes([2]) * 16}, "metadata of forgotten plans is dropped"
    assert set(cache.held()) == {keys[1], keys[2]}


def test_a_second_save_of_the_same_layout_plans_nothing(tmp_path, monkeypatch):
    import torch

    import bcp
    import bcp.saver
    from bcp.planning.cache import clear_plan_caches

    clear_plan_caches()
    calls = []
    real = bcp.saver.plan_save
    monkeypatch.setattr(bcp.saver, "plan_save", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(6, 4)
    bcp.save({"w": w, "tied": w, "n": 1}, tmp_path / "a")
    w2 = w + 1
    bcp.save({"w": w2, "tied": w2, "n": 2}, tmp_path / "b")  # new memory, same layout: tie kept
    assert len(calls) == 1
    bcp.save({"w": w, "x": torch.zeros(3)}, tmp_path / "c")  # another layout
    assert len(calls) == 2
    got = bcp.load({"w": torch.empty(6, 4), "tied": torch.empty(6, 4), "n": 0}, tmp_path / "b")
    assert torch.equal(got["w"], w + 1) and torch.equal(got["tied"], w + 1) and got["n"] == 2
    stats = bcp.open(tmp_path / "b").manifest.stats
    assert stats["tensors"] == 2 and stats["fragments"] == 1 and stats["tensor_bytes"] == 2 * 6 * 4 * 4


def test_a_cached_plan_still_refuses_an_existing_checkpoint(tmp_path):
    import torch

    import bcp
    from bcp.errors import CheckpointExistsError

    bcp.save({"w": torch.ones(3)}, tmp_path / "a")
    with pytest.raises(CheckpointExistsError):
        bcp.save({"w": torch.ones(3)}, tmp_path / "a")
    info = bcp.save({"w": torch.zeros(3)}, tmp_path / "a", overwrite=True)
    assert torch.equal(bcp.load({"w": torch.empty(3)}, tmp_path / "a")["w"], torch.zeros(3))
    assert info.tensors == 1


@pytest.mark.slow
def test_distributed_plan_cache_and_status_rounds(tmp_path):
    import dist_jobs
    import save_message_jobs

    dist_jobs.spawn(save_message_jobs.plan_cache_job, 3, str(tmp_path))


@pytest.mark.slow
def test_a_rank_without_its_cached_writes_makes_the_job_plan_again(tmp_path):
    import dist_jobs
    import save_message_jobs

    dist_jobs.spawn(save_message_jobs.cache_lost_on_one_rank_job, 2, str(tmp_path))
