"""bcp.LowestRankCopy: a replicated tensor whose copies may differ (BatchNorm's running
statistics) is stored from its lowest-ranked holder and not compared; TrainingState
wraps the model's buffers so (the jobs: tests/lowest_rank_jobs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
import lowest_rank_jobs
from bcp.errors import ShardingError
from bcp.planning import LayoutMeta
from bcp.planning.local_layout import LocalLayout, TensorPlan
from bcp.planning.plan import plan_save

distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@distributed
def test_batchnorm_under_ddp_and_fsdp2_saves_rank_0s_statistics(tmp_path):
    dist_jobs.spawn(lowest_rank_jobs.batchnorm_job, 2, str(tmp_path))


@distributed
def test_lowest_rank_leaves_in_sync_async_and_pipeline_groups(tmp_path):
    dist_jobs.spawn(lowest_rank_jobs.leaves_job, 3, str(tmp_path))


def _plan(fqn: str, n: int, lowest: bool) -> TensorPlan:
    return TensorPlan(fqn, f"[{fqn!r}]", "float32", (n,), (((0,), (n,)),), None, lowest)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 6),
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    data=st.data(),
)
def test_lowest_rank_boxes_go_to_their_lowest_holder_on_both_paths(world, sizes, data):
    """Whatever the other tensors weigh and whichever ranks hold a tensor, a flagged one
    is written by its lowest holder, once; the rest are still written once each."""
    flagged = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    holders = [data.draw(st.sets(st.integers(0, world - 1), min_size=1)) for _ in sizes]
    for r in range(world):  # every rank holds something (a rank with no tensor is another test's)
        if not any(r in h for h in holders):
            holders[0].add(r)
    layouts = [
        LocalLayout.build(
            r, [_plan(f"t{i}", n, f) for i, (n, f, h) in enumerate(zip(sizes, flagged, holders, strict=True)) if r in h]
        )
        for r in range(world)
    ]
    everywhere = all(len(h) == world for h in holders)
    for matrix in (True, False) if everywhere else (False,):
        writes = plan_save(layouts, matrix=matrix).writes
        writer: dict[str, list[int]] = {}
        for r, w in writes.items():
            fqns = layouts[r].decoded.fqns
            for i in w.tolist():
                writer.setdefault(fqns[i], []).append(r)
        for i, h in enumerate(holders):
            assert len(writer[f"t{i}"]) == 1, (i, writer)
            if flagged[i] and sizes[i]:
                assert writer[f"t{i}"] == [min(h)], (i, h, writer)


def test_layout_meta_carries_the_flag_and_refuses_a_malformed_one():
    meta = LayoutMeta.of([_plan("a", 2, True), _plan("b", 2, False)])
    assert meta.lowest == frozenset({"a"})
    assert LayoutMeta.decode(meta.encode()) == meta
    assert b'"b","[\'b\']","float32",[2],null]' in meta.encode(), "an unflagged row keeps five fields"
    for bad in (b'[["a","x","float32",[2],null,0]]', b'[["a","x","float32",[2],null,"1"]]'):
        with pytest.raises(ShardingError, match="malformed"):
            LayoutMeta.decode(bad)


def test_wrapper_takes_plain_tensors_only_and_one_process_round_trips(tmp_path):
    with pytest.raises(TypeError, match=r"plain torch\.Tensor"):
        bcp.LowestRankCopy(np.zeros(3))  # type: ignore[arg-type]
    t = torch.arange(5.0)
    bcp.save({"t": bcp.LowestRankCopy(t)}, str(tmp_path / "c"))
    assert torch.equal(bcp.load({"t": torch.zeros(5)}, str(tmp_path / "c"))["t"], t)
