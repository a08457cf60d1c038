"""The ordering rules of device copies, checked on CPU with a fake that defers every
copy until its completion is waited on (tests/cuda_fakes.py).

Each rule has a control: the same scenario with the wait removed must produce a
wrong checkpoint, which shows the fake would catch the mistake.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import bcp.io_scheduler.device_copy
import bcp.io_scheduler.staging
from bcp.io_scheduler.device_load import contiguous_pieces
from bcp.io_scheduler.staging import Slab, StagingPool
from cuda_fakes import CheckedPool, FakeCudaApi, fake_cuda  # noqa: F401 - the fixture 'fake'
from helpers import examples, tensor_bytes_equal

SLAB = 128 << 10


def device_state(fake: FakeCudaApi, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(96, 80, generator=g)
    state = {
        "big": torch.randn(300, 257, generator=g),  # several chunks of a small slab
        "bf16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "int8": torch.randint(-100, 100, (1000,), generator=g, dtype=torch.int8),
        "strided": base.t(),  # non-contiguous: made contiguous on the side stream
        "small": torch.randn(7, generator=g),
        "conj": torch.randn(
            50, 40, dtype=torch.complex64, generator=g
        ).conj(),  # lazy conjugate: resolved on the side stream
        "bool_t": torch.randint(0, 256, (30, 20), dtype=torch.uint8, generator=g)
        .view(torch.bool)
        .t(),  # raw bytes kept
        "uint4_step": torch.randint(0, 256, (40, 10), dtype=torch.uint8, generator=g).view(torch.uint4)[::2],
    }
    fake.as_device(base)
    for t in state.values():
        fake.as_device(t)
    return state | {"step": 3}


def snapshot(state: dict) -> dict:
    from bcp.tensor_io import host_contiguous, raw

    return {
        k: raw(host_contiguous(v)).clone().view(v.dtype) if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }


def assert_checkpoint_holds(uri: str, expected: dict) -> None:
    reader = bcp.open(uri)
    for key, value in expected.items():
        got = reader.read(key)
        if isinstance(value, torch.Tensor):
            assert tensor_bytes_equal(got, value), f"{key} differs from the values at the call"
        else:
            assert got == value


def mutate(state: dict) -> None:
    from bcp.tensor_io import raw

    for v in state.values():
        if isinstance(v, torch.Tensor):
            raw(v.resolve_conj()).fill_(7) if not v.is_conj() else v.fill_(7)


def test_async_save_returns_only_after_its_device_copies_completed(fake, tmp_path):
    state = device_state(fake)
    expected = snapshot(state)
    pool = CheckedPool(StagingPool(64 * SLAB, SLAB), fake)
    fake.gate.clear()  # background writers cannot complete copies before the caller changes the state
    handle = bcp.async_save(state, str(tmp_path / "ck"), pool=pool)
    assert fake.copies_queued > 0
    assert fake.pending() == 0, "async_save returned while device copies were still queued"
    mutate(state)  # in-place kernels right after the call
    fake.gate.set()
    handle.wait()
    assert_checkpoint_holds(str(tmp_path / "ck"), expected)
    assert fake.violations == []
    assert ("record_stream", "side0") in fake.log


def test_control_without_the_host_wait_the_checkpoint_takes_later_changes(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(bcp.io_scheduler.device_copy.DeviceCopies, "wait", lambda self: None)
    state = device_state(fake)
    expected = snapshot(state)
    fake.gate.clear()
    handle = bcp.async_save(state, str(tmp_path / "ck"), pool=StagingPool(64 * SLAB, SLAB))
    mutate(state)
    fake.gate.set()
    handle.wait()
    with pytest.raises(AssertionError, match="differs"):
        assert_checkpoint_holds(str(tmp_path / "ck"), expected)


def test_slabs_are_reused_only_after_their_copies_completed(fake, tmp_path):
    """A state 10x the pool: slabs cycle many times; none goes back early."""
    state = device_state(fake, seed=1)
    expected = snapshot(state)
    pool = CheckedPool(StagingPool(2 * SLAB, SLAB), fake)
    bcp.async_save(state, str(tmp_path / "a"), pool=pool).wait()
    bcp.save(state, str(tmp_path / "s"), pool=pool)
    assert_checkpoint_holds(str(tmp_path / "a"), expected)
    assert_checkpoint_holds(str(tmp_path / "s"), expected)
    assert fake.violations == [] and fake.pending() == 0


def test_sources_are_marked_for_the_side_stream_before_it_reads_them(fake, tmp_path):
    state = device_state(fake, seed=2)
    bcp.async_save(state, str(tmp_path / "ck"), pool=StagingPool(64 * SLAB, SLAB)).wait()
    assert fake.violations == []
    record = [e for e in fake.log if e[0] == "record_stream"]
    assert len(record) >= len([v for v in state.values() if isinstance(v, torch.Tensor)])
    assert fake.log.index(("wait_stream", "side0", "caller")) < fake.log.index(record[0])


def training_state(fake: FakeCudaApi):
    torch.manual_seed(0)
    # 256 KiB weights: chunks of their own, staged in the background (small tensors are
    # packed with buffers into chunks staged before the call returns)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        loss = model(torch.randn(16, 256)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # optimizer state exists
    for t in list(model.state_dict().values()):
        fake.as_device(t)
    for s in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            fake.as_device(s[k])
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return model, opt, state, step


def flat_expected(state: dict) -> dict:
    from bcp.state import flatten_state

    return {leaf.fqn: leaf.value.clone() for leaf in flatten_state(state).values() if leaf.is_tensor}


def test_overlap_step_runs_only_after_the_background_copies(fake, tmp_path):
    _model, opt, state, step = training_state(fake)
    expected = flat_expected(state)
    fake.gate.clear()
    handle = bcp.async_save(state, str(tmp_path / "ck"), overlap=opt, pool=StagingPool(64 * SLAB, SLAB))
    handle.staged.wait()
    assert fake.pending() > 0  # the optimizer's tensors are still being copied during forward/backward
    step()  # forward changes BatchNorm buffers; step() changes parameters and moments
    step()
    fake.gate.set()
    handle.wait()
    assert_checkpoint_holds(str(tmp_path / "ck"), expected)
    assert ("wait_event", "caller", "side0") in fake.log, "step() was not ordered after the copies on the device"
    assert fake.violations == []


def test_control_overlap_without_the_device_wait_saves_post_step_values(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(bcp.io_scheduler.device_copy.DeviceCopies, "order_after", lambda self: None)
    _model, opt, state, step = training_state(fake)
    expected = flat_expected(state)
    fake.gate.clear()
    handle = bcp.async_save(state, str(tmp_path / "ck"), overlap=opt, pool=StagingPool(64 * SLAB, SLAB))
    step()
    fake.gate.set()
    handle.wait()
    with pytest.raises(AssertionError, match="differs"):
        assert_checkpoint_holds(str(tmp_path / "ck"), expected)


# -- loads ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(300, 257, generator=g),
        "v": torch.randn(4096, generator=g),
        "b": torch.randn(5, generator=g),
        "m": torch.randn(40, 60, generator=g),
        "h": torch.randn(33, 17, generator=g).to(torch.bfloat16),
    }
    uri = str(tmp_path / "ck")
    bcp.save(state, uri)
    return uri, state


def test_load_into_device_templates_lands_every_byte_before_returning(fake, saved, monkeypatch):
    uri, ref = saved
    pool = CheckedPool(StagingPool(4 * SLAB, SLAB), fake)
    monkeypatch.setattr(bcp.io_scheduler.staging, "_default", pool)
    template = {
        "w": fake.as_device(torch.zeros(300, 257)),
        "v": fake.as_device(torch.zeros(4096)),
        "b": fake.as_device(torch.zeros(5)),
        "m": fake.as_device(torch.zeros(60, 40)).t(),  # non-contiguous destination
        "h": fake.as_device(torch.zeros(33, 17)),  # another dtype: cast on the device
    }
    out = bcp.load(template, uri, strict=False)
    assert fake.pending() == 0, "load returned while copies to the device were still queued"
    for k in ref:
        assert torch.equal(out[k], ref[k].to(out[k].dtype)), k
    assert out["m"].data_ptr() == template["m"].data_ptr()  # filled in place
    assert fake.violations == []
    assert fake.copies_queued >= 5


def test_control_load_without_the_final_wait_misses_the_values_in_memory(fake, saved, monkeypatch):
    """Values another rank shared (in host memory) are copied after every piece; only
    the final wait completes them."""
    monkeypatch.setattr(bcp.io_scheduler.device_copy.DeviceCopies, "wait", lambda self: None)
    uri, ref = saved
    dest = fake.as_device(torch.zeros(33, 17))
    whole = ((0, 0), (33, 17))
    bcp.open(uri).fill([("h", whole, dest)], in_memory={("h", whole): ref["h"]})
    assert not torch.equal(dest, ref["h"].float())


def test_load_into_conjugate_destinations_on_device_and_host(fake, tmp_path):
    c = torch.randn(30, 20, dtype=torch.complex64)
    bcp.save({"c": c}, str(tmp_path / "ck"))
    for dest in (
        fake.as_device(torch.zeros(30, 20, dtype=torch.complex64)).conj(),
        torch.zeros(30, 20, dtype=torch.complex64).conj(),
        fake.as_device(torch.zeros(20, 30, dtype=torch.complex64)).t().conj(),
    ):
        out = bcp.load({"c": dest}, str(tmp_path / "ck"))
        assert torch.equal(out["c"].resolve_conj(), c)
    assert fake.violations == []


def test_load_reshard_boxes_into_device_memory(fake, saved):
    uri, ref = saved
    reader = bcp.open(uri)
    boxes = [((0, 0), (300, 257)), ((17, 3), (120, 200)), ((299, 0), (1, 257)), ((5, 250), (200, 7))]
    dests = [fake.as_device(torch.full(n, -1.0)) for _o, n in boxes]
    reader.fill(
        [("w", b, d) for b, d in zip(boxes, dests, strict=True)], pool=CheckedPool(StagingPool(3 * SLAB, SLAB), fake)
    )
    for (o, n), d in zip(boxes, dests, strict=True):
        assert torch.equal(d, ref["w"][o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    assert fake.pending() == 0 and fake.violations == []


def test_device_load_keeps_host_memory_to_a_few_slabs(fake, tmp_path):
    big = torch.randn(1000, 1000)  # 4 MB through a pool of 3 slabs of 128 KiB
    bcp.save({"big": big}, str(tmp_path / "ck"))
    pool = StagingPool(3 * SLAB, SLAB)
    dest = fake.as_device(torch.zeros(1000, 1000))
    bcp.open(str(tmp_path / "ck")).fill([("big", ((0, 0), (1000, 1000)), dest)], pool=pool)
    assert torch.equal(dest, big)
    assert pool.allocated_bytes <= 3 * SLAB < big.numel() * 4 // 10


# -- pieces, slabs, reservations -------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    limit=st.integers(1, 600),
    block=st.sampled_from([8, 64, 128]),
)
def test_contiguous_pieces_tile_the_box_in_row_major_order(lengths, itemsize, limit, block):
    lengths = tuple(lengths)
    pieces = contiguous_pieces(lengths, itemsize, limit, block)
    strides = [math.prod(lengths[d + 1 :]) for d in range(len(lengths))]
    cursor = 0
    for off, n in pieces:
        assert len(off) == len(n) == len(lengths)
        assert all(o + k <= L for o, k, L in zip(off, n, lengths, strict=True))
        start = sum(o * s for o, s in zip(off, strides, strict=True))
        assert start == cursor, "pieces must follow one another in row-major order"
        count = math.prod(n)
        assert count > 0
        last = sum((o + k - 1) * s for o, k, s in zip(off, n, strides, strict=True))
        assert last - start + 1 == count, "a piece must be contiguous in the box"
        assert count * itemsize <= max(limit, itemsize)
        cursor += count
    assert cursor == math.prod(lengths) if lengths else cursor in (0, 1)


def test_pieces_end_on_checksum_blocks_when_rows_allow():
    pieces = contiguous_pieces((8192, 3072), 2, (32 << 20) - 4096, 64 << 10)
    assert len(pieces) > 1
    assert all((o[0] * 3072 * 2) % (64 << 10) == 0 for o, _n in pieces)


def test_exactly_sized_slab_never_overruns():
    slab = Slab(torch.zeros(1 << 16, dtype=torch.uint8))
    assert slab.view(1 << 16, shift=100).data_ptr() == slab.tensor.data_ptr()  # shift dropped
    assert slab.view(1000, shift=100).data_ptr() == slab.tensor.data_ptr() + 100
    with pytest.raises(ValueError, match="does not fit"):
        slab.view((1 << 16) + 1)


def test_reserve_staging_prepares_the_first_save_off_the_critical_path(tmp_path):
    state = {f"w{i}": torch.randn(128, 256) for i in range(6)}  # 768 KiB
    pool = StagingPool(64 * SLAB, SLAB)
    reservation = bcp.reserve_staging(state, pool=pool)
    assert reservation.wait(timeout=60) >= 6 * 128 * 256 * 4
    before = pool.allocated_bytes
    bcp.async_save(state, str(tmp_path / "ck"), pool=pool).wait()
    assert pool.allocated_bytes == before, "the first save still allocated staging memory"


def test_reserve_staging_is_capped_by_the_budget(tmp_path):
    state = {"w": torch.randn(1024, 1024)}  # 4 MiB
    pool = StagingPool(4 * SLAB, SLAB)
    assert bcp.reserve_staging(state, pool=pool, background=False).wait() == 4 * SLAB
    bcp.async_save(state, str(tmp_path / "ck"), pool=pool).wait()  # bigger than the budget: still saved
    assert torch.equal(bcp.open(str(tmp_path / "ck")).read("w"), state["w"])
    assert pool.allocated_bytes == 4 * SLAB


def test_manager_load_latest_starts_the_reservation(tmp_path):
    manager = bcp.CheckpointManager(str(tmp_path / "run"), keep_last=2)
    state = {"w": torch.randn(64, 64)}
    step, _ = manager.load_latest(state)
    assert step is None and manager._reservation is not None
    assert manager._reservation.wait(timeout=60) >= 64 * 64 * 4


# -- incremental saves: the digests and first-block checksums read the values at the call ----


def queued_update(fake: FakeCudaApi, state: dict) -> dict:
    """Queue on the caller's stream (not yet run, as a kernel in flight) a change of every
    tensor of ``state``; return the values once it ran."""
    new = {k: v + 1 for k, v in state.items()}
    for k, v in state.items():
        fake.caller.ops.append(((lambda v=v, n=new[k]: v.copy_(n)), []))
    return new


def incremental_device_state(fake: FakeCudaApi) -> dict:
    g = torch.Generator().manual_seed(5)
    # two items over bcp.pieces.THREAD_FROM (digested on the pool's threads) and a small one
    # (on the deciding thread); a transposed one (its first block made contiguous)
    state = {
        "a": torch.randn(256, 320, generator=g),
        "b": torch.randn(320, 256, generator=g).t(),
        "small": torch.randn(5, 7, generator=g),
    }
    for t in state.values():
        fake.as_device(t)
    return state


def save_incremental_after_queued_update(fake, tmp_path) -> tuple[str, dict]:
    state = incremental_device_state(fake)
    base, nxt = str(tmp_path / "base"), str(tmp_path / "next")
    bcp.save(state, base, incremental=True, streams=4)
    assert fake.pending() == 0 and not fake.caller.pending()
    new = queued_update(fake, state)
    bcp.save(state, nxt, base=base, streams=4)
    return nxt, new


def test_incremental_digests_wait_for_the_callers_queued_work(fake, tmp_path):
    """A save called right after the caller queued a change on its stream digests the
    changed bytes (not the base's, still in memory until the kernel runs): the pieces
    are written, not referred to the base."""
    nxt, new = save_incremental_after_queued_update(fake, tmp_path)
    assert_checkpoint_holds(nxt, new)
    assert any(e[0] == "synchronize" and e[1] == "caller" for e in fake.log)
    assert not fake.violations


def test_control_incremental_digests_without_the_callers_event_reuse_stale_pieces(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(bcp.io_scheduler.device_copy, "caller_done", lambda tensors: lambda: None)
    nxt, new = save_incremental_after_queued_update(fake, tmp_path)
    reader = bcp.open(nxt)
    assert not any(tensor_bytes_equal(reader.read(k), v) for k, v in new.items())
