"""Replicas must agree: a tensor stored once (a plain tensor on several ranks, a
DTensor replicated over a mesh dimension) is refused when the ranks' copies differ
(bcp.replicas; the multi-rank jobs are in tests/replica_jobs.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
import replica_jobs
from bcp.metadata.checksum import crc32c
from bcp.planning import LayoutMeta
from bcp.replicas import SMALL_REPLICA_BYTES, ReplicaSummer, ReplicaSums, box_key, check_replicas
from bcp.save_phases import prepare_save
from helpers import examples

distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@distributed
def test_two_ranks_refuse_differing_replicas_and_commit_nothing(tmp_path):
    dist_jobs.spawn(replica_jobs.two_ranks_job, 2, str(tmp_path))


@distributed
def test_ranks_whose_keys_clash_are_refused_before_anything_is_written(tmp_path):
    dist_jobs.spawn(replica_jobs.clashing_keys_job, 2, str(tmp_path))


def test_four_ranks_name_keys_and_ranks_bounded_and_check_replicated_dtensors_only(tmp_path):
    dist_jobs.spawn(replica_jobs.four_ranks_job, 4, str(tmp_path))


def _meta(fqns: list[str]) -> LayoutMeta:
    n = len(fqns)
    return LayoutMeta(tuple(fqns), tuple(f"[{f!r}]" for f in fqns), ("float32",) * n, ((4,),) * n, (None,) * n)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.integers(2, 5).flatmap(
        lambda world: st.lists(
            st.tuples(
                st.integers(0, 3), st.integers(0, 2), st.lists(st.integers(0, 2), min_size=world, max_size=world)
            ),
            min_size=1,
            max_size=6,
            unique_by=lambda e: (e[0], e[1]),
        ).map(lambda entries: (world, entries))
    ),
    st.randoms(use_true_random=False),
)
def test_check_replicas_refuses_exactly_the_boxes_whose_copies_differ(case, rnd):
    """Every rank holds the listed (tensor, box) entries with its own CRC; ranks list
    them in their own order and under their own metadata order. A box is reported
    iff two holders' sums differ, with the ranks that differ from its lowest rank."""
    world, entries = case
    fqns = [f"t{i}" for i in range(4)]
    metas, digests, sums = {}, [], []
    for r in range(world):
        order = fqns[:]
        rnd.shuffle(order)
        d = bytes([r]) * 16
        metas[d] = _meta(order)
        digests.append(d)
        mine = entries[:]
        rnd.shuffle(mine)
        sums.append(
            ReplicaSums(
                np.array([order.index(f"t{t}") for t, _b, _v in mine], dtype=np.int32),
                np.array([b for _t, b, _v in mine], dtype=np.int64),
                np.array([v[r] for _t, _b, v in mine], dtype=np.uint32),
            )
        )
    want: dict[str, dict[int, list[int]]] = {}
    for t, _b, values in entries:
        bad = [r for r in range(world) if values[r] != values[0]]
        if bad:
            want.setdefault(f"t{t}", {}).setdefault(0, []).extend(bad)
    if not want:
        check_replicas(sums, digests, metas)
        return
    with pytest.raises(bcp.ReplicaMismatchError) as info:
        check_replicas(sums, digests, metas)
    got = {k: {ref: sorted(rs) for ref, rs in v.items()} for k, v in info.value.differing.items()}
    assert got == {k: {ref: sorted(rs) for ref, rs in v.items()} for k, v in want.items()}


def test_check_replicas_ignores_ranks_that_checked_nothing_and_boxes_held_once():
    meta = {b"a" * 16: _meta(["w", "v"])}
    one = ReplicaSums(np.array([0, 1], np.int32), np.array([0, 5], np.int64), np.array([1, 2], np.uint32))
    other = ReplicaSums(np.array([0, 1], np.int32), np.array([0, 6], np.int64), np.array([1, 3], np.uint32))
    check_replicas([one, None, other], [b"a" * 16] * 3, meta)  # box 5 and box 6 are each held once


def test_error_pickles_with_its_fields_and_is_a_sharding_error():
    e = bcp.ReplicaMismatchError("differ", differing={"x": {0: [1, 3]}})
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is bcp.ReplicaMismatchError and copy.differing == {"x": {0: [1, 3]}} and str(copy) == "differ"
    assert isinstance(copy, bcp.ShardingError)


def _bytes_crc(t: torch.Tensor) -> int:
    return crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _whole(t: torch.Tensor) -> tuple:
    return ((0,) * t.dim(), tuple(t.shape))


def test_summer_checksums_logical_row_major_bytes_of_any_view():
    base = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    views = [base, base.transpose(0, 2), base[:, 1], base[..., ::2], torch.tensor(5.0), base[0].to(torch.bfloat16).t()]
    summer = ReplicaSummer("all")
    for i, v in enumerate(views):
        summer.add(i, _whole(v), tuple(v.shape), v)
    got = summer.finish()
    assert got.tensors.tolist() == list(range(len(views)))
    assert got.sums.tolist() == [_bytes_crc(v.contiguous()) for v in views]
    lazy = torch.tensor([1 + 2j, 3 - 1j]).conj()  # conj and neg bits: the values, not the memory
    assert lazy.is_conj() and lazy.imag.is_neg()
    summer = ReplicaSummer("all")
    summer.add(0, _whole(lazy), (2,), lazy)
    summer.add(1, _whole(lazy.imag), (2,), lazy.imag)
    want = [_bytes_crc(torch.tensor([1 - 2j, 3 + 1j])), _bytes_crc(torch.tensor([-2.0, 1.0]))]
    assert summer.finish().sums.tolist() == want


def test_summer_batches_device_tensors_into_one_host_copy_per_device():
    """The batched path (cat on the device, one copy, a CRC per slice), fed CPU tensors."""
    summer = ReplicaSummer("all")
    tensors = [torch.arange(5.0), torch.ones(2, 3, dtype=torch.int16).t(), torch.tensor(True)]
    summer.tensors, summer.boxes, summer.sums = [0, 1, 2], [0, 0, 0], [0, 0, 0]
    summer.pending[torch.device("cpu")] = list(enumerate(tensors))
    assert summer.finish().sums.tolist() == [_bytes_crc(t) for t in tensors]


def test_summer_limits_by_mode():
    small, big, empty = torch.zeros(SMALL_REPLICA_BYTES // 4), torch.zeros(SMALL_REPLICA_BYTES // 4 + 1), torch.zeros(0)
    for mode, want in (("small", [0]), ("all", [0, 1]), ("off", [])):
        summer = ReplicaSummer(mode)
        for i, t in enumerate((small, big, empty)):
            summer.add(i, _whole(t), tuple(t.shape), t)
        assert summer.finish().tensors.tolist() == want, mode


def test_box_key_is_zero_for_the_whole_tensor_and_tells_boxes_apart():
    assert box_key(((0, 0), (4, 2)), (4, 2)) == 0 and box_key(((), ()), ()) == 0
    keys = {box_key(((o, 0), (2, 2)), (4, 2)) for o in (0, 2)} | {box_key(((0, 0), (4, 1)), (4, 2))}
    assert len(keys) == 3 and 0 not in keys


def test_one_process_checks_nothing_and_the_option_is_validated():
    state = {"w": torch.ones(3), "rng": torch.get_rng_state()}
    assert prepare_save(state, 0, False, check_replicas="all", world_size=1).replicas is None
    assert prepare_save(state, 0, False, check_replicas="all", world_size=2).replicas.tensors.tolist() == [0, 1]
    assert prepare_save(state, 0, False, check_replicas="off", world_size=2).replicas is None
    with pytest.raises(ValueError, match="check_replicas must be one of 'small', 'all', 'off'"):
        bcp.SaveOptions(check_replicas="some")
