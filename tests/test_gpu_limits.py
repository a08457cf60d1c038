"""The runtime limits of a multi-host GPU job, checked where the logic can be seen on
CPU: overlapped saves with any optimizer hooks, the CUDA RNG a rank saves and
restores, the pinned staging budget per host and cgroup, device temporaries of
loads streamed, the first save never waiting for pinning, reservations sized from
the rank's own writes, blocking events and one side stream per device.

CUDA itself is replaced by tests/cuda_fakes.py (copies deferred until waited on)
and small fakes here; tests/test_cuda.py runs the same checks on a real GPU.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import bcp
import bcp.io_scheduler.device_copy
import bcp.io_scheduler.staging
import bcp.training
import dist_jobs
from bcp.async_save import staging_bytes
from bcp.io_scheduler.staging import StagingPool, available_memory, cgroup_available, default_budget
from cuda_fakes import CheckedPool, FakeCudaApi, fake_cuda  # noqa: F401 - the fixture 'fake'
from helpers import tensor_bytes_equal

SLAB = 128 << 10


def flat(state: dict) -> dict:
    from bcp.state import flatten_state

    return {leaf.fqn: leaf.value.detach().clone() for leaf in flatten_state(state).values() if leaf.is_tensor}


def assert_holds(uri: str, expected: dict) -> None:
    reader = bcp.open(uri)
    for key, value in expected.items():
        assert tensor_bytes_equal(reader.read(key), value), f"{key} in {uri} differs from the values at the call"


# -- 5. overlap with any hooks ---------------------------------------------------------------


def training(fake: FakeCudaApi | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(16, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state exists
    if fake is not None:
        for t in model.state_dict().values():
            fake.as_device(t)
        for s in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                fake.as_device(s[k])
    return model, opt, step


def test_two_overlapped_saves_then_step_with_user_hooks_before_and_after(fake, tmp_path):
    model, opt, step = training(fake)
    ran: list[str] = []
    before = opt.register_step_pre_hook(lambda *_: ran.append("before"))
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = flat(state)
    pool = StagingPool(64 * SLAB, SLAB)
    fake.gate.clear()  # background writers cannot complete the copies: only the step's wait can
    a = bcp.async_save(state, str(tmp_path / "a"), overlap=opt, pool=pool)
    between = opt.register_step_pre_hook(lambda *_: ran.append("between"))
    b = bcp.async_save(state, str(tmp_path / "b"), overlap=opt, pool=pool)
    after = opt.register_step_pre_hook(lambda *_: ran.append("after"))
    global_after = register_optimizer_step_pre_hook(lambda *_: ran.append("global"))
    try:
        step()  # torch iterates the hooks: nothing may be removed meanwhile
        step()
    finally:
        fake.gate.set()  # never leave writers blocked for the tests after this one
        a.wait()
        b.wait()
        for handle in (before, between, after, global_after):
            handle.remove()
    assert ran == ["global", "before", "between", "after"] * 2
    assert_holds(str(tmp_path / "a"), expected)
    assert_holds(str(tmp_path / "b"), expected)
    assert fake.violations == []
    assert not torch.equal(model[0].weight, expected["model.0.weight"]), "the steps did change the weights"


def test_a_user_hook_that_removes_itself_beside_overlapped_saves(tmp_path):
    model, opt, step = training(None)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = flat(state)
    box: list = []

    def once(*_):
        box[0].remove()  # the user's own hook is the only one removed during the step

    handles = [bcp.async_save(state, str(tmp_path / f"c{k}"), overlap=opt) for k in range(3)]
    box.append(opt.register_step_pre_hook(once))
    step()
    for k, handle in enumerate(handles):
        handle.wait()
        assert_holds(str(tmp_path / f"c{k}"), expected)
    step()  # no pending save: the hook has nothing to wait for


def test_overlapped_saves_of_two_optimizers_wait_only_for_their_own(tmp_path):
    model, opt, step = training(None)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = flat(state)
    handle = bcp.async_save(state, str(tmp_path / "ck"), overlap=opt)
    other.step()  # another optimizer's step takes nothing of this save's
    step()
    handle.wait()
    assert_holds(str(tmp_path / "ck"), expected)


# -- a. the CUDA RNG a rank saves and restores ------------------------------------------------------


class FakeCudaRng:
    """CUDA generators with the CUDA state format (16 bytes: seed, offset)."""

    def __init__(self, devices: int = 8, current: int = 0) -> None:
        self.devices, self.current = devices, current
        self.states = {d: self.seeded_state(100 + d) for d in range(devices)}
        self.set_calls: list[tuple[int, int]] = []

    def available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def get_state(self, device: int) -> torch.Tensor:
        return self.states[device].clone()

    def set_state(self, state: torch.Tensor, device: int) -> None:
        if state.numel() != 16:
            raise RuntimeError("RNG state is wrong size")  # CUDAGeneratorImpl::set_state
        self.states[device] = state.clone()
        self.set_calls.append((device, state.numel()))

    def seeded_state(self, seed: int) -> torch.Tensor:
        return torch.tensor([seed % 2**63, 0], dtype=torch.int64).view(torch.uint8)


@pytest.fixture
def cuda_rng(monkeypatch):
    def install(devices: int = 8, current: int = 0) -> FakeCudaRng:
        rng = FakeCudaRng(devices, current)
        monkeypatch.setattr(bcp.training, "cuda_rng", rng)
        return rng

    return install


def test_a_rank_saves_its_current_devices_cuda_rng_and_restores_it_on_its_current_device(cuda_rng):
    saving = cuda_rng(devices=8, current=3)  # LOCAL_RANK=3 on an 8-GPU host
    saved = bcp.training.rng_state()
    assert torch.equal(saved["cuda_device"], saving.states[3]) and "cuda" not in saved
    resuming = cuda_rng(devices=4, current=1)  # the same rank on a 4-GPU host
    bcp.training.set_rng_state(saved)
    assert resuming.set_calls == [(1, 16)], "restored once, on the current device"
    assert torch.equal(resuming.states[1], saving.states[3])


def test_derived_cuda_rng_states_have_the_cuda_generators_format(cuda_rng):
    cuda_rng(devices=2, current=0)
    values = {}
    for r in range(2):
        torch.manual_seed(r)
        values[r] = bcp.training.rng_state()
    resuming = cuda_rng(devices=2, current=1)
    got = [bcp.training.reshard_rng_states(values, r, 4) for r in range(4)]
    for r in (2, 3):
        assert got[r]["cuda_device"].numel() == 16, "a CUDA state made by the CPU generator has 5,056 bytes"
        assert got[r]["cuda_device"].numel() != torch.get_rng_state().numel()
        bcp.training.set_rng_state(got[r])  # the fake refuses a wrong size as CUDA does
    assert not torch.equal(got[2]["cuda_device"], got[3]["cuda_device"]), "every new rank its own stream"
    assert torch.equal(bcp.training.reshard_rng_states(values, 3, 4)["cuda_device"], got[3]["cuda_device"])
    assert resuming.set_calls == [(1, 16), (1, 16)]


def test_derived_rng_state_without_cuda_here_or_there(cuda_rng):
    cuda_rng(devices=0)
    values = {0: bcp.training.rng_state()}
    assert values[0]["cuda_device"] is None
    derived = bcp.training.derived_rng_state(values, 1)
    assert derived["cuda_device"] is None
    bcp.training.set_rng_state(derived)
    cuda_rng(devices=0)
    with_cuda = {0: dict(values[0], cuda_device=FakeCudaRng().seeded_state(7))}
    assert bcp.training.derived_rng_state(with_cuda, 1)["cuda_device"] is None, "nothing to restore it on"


def test_rng_states_of_older_checkpoints_still_restore_by_device_index(cuda_rng):
    rng = cuda_rng(devices=2, current=1)
    old = {
        bcp.training.RNG_MARK: 1,
        "torch": torch.get_rng_state(),
        "cuda": [rng.seeded_state(1), rng.seeded_state(2)],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    bcp.training.set_rng_state(old)
    assert rng.set_calls == [(0, 16), (1, 16)]
    assert bcp.training.derived_rng_state({0: old}, 1)["cuda_device"].numel() == 16


def test_rng_round_trips_through_a_checkpoint(cuda_rng, tmp_path):
    rng = cuda_rng(devices=8, current=5)
    bcp.save({"rng": bcp.PerRank(bcp.training.rng_state())}, str(tmp_path / "ck"))
    loaded = bcp.load({"rng": None}, str(tmp_path / "ck"))["rng"]
    resumed = cuda_rng(devices=2, current=0)
    bcp.training.set_rng_state(loaded)
    assert torch.equal(resumed.states[0], rng.states[5])


# -- b. the pinned staging budget ----------------------------------------------------------------


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


GiB = 1 << 30


def test_cgroup_v2_limit_caps_available_memory(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/job.slice/rank\n")
    write(root / "job.slice" / "memory.max", f"{16 * GiB}\n")
    write(root / "job.slice" / "memory.current", f"{15 * GiB}\n")
    write(root / "job.slice" / "memory.stat", f"anon 1\ninactive_file {4 * GiB}\nactive_file 5\n")
    write(root / "job.slice" / "rank" / "memory.max", "max\n")  # no limit of its own: the parent's counts
    write(root / "job.slice" / "rank" / "memory.current", f"{GiB}\n")
    write(tmp_path / "meminfo", f"MemTotal: {512 * GiB // 1024} kB\nMemAvailable: {400 * GiB // 1024} kB\n")
    # usage without the inactive page cache: 15 - 4 = 11 GiB of 16
    assert cgroup_available(str(root), str(tmp_path / "self")) == 5 * GiB
    assert available_memory(str(tmp_path / "meminfo"), str(root), str(tmp_path / "self")) == 5 * GiB


def test_cgroup_v1_limit_inside_a_container(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "4:memory:/docker/abc\n0::/\n")  # the host's path; the container sees its own at the root
    write(root / "memory" / "memory.limit_in_bytes", f"{8 * GiB}\n")
    write(root / "memory" / "memory.usage_in_bytes", f"{3 * GiB}\n")
    write(root / "memory" / "memory.stat", f"inactive_file 7\ntotal_inactive_file {GiB}\n")
    write(tmp_path / "meminfo", f"MemAvailable: {400 * GiB // 1024} kB\n")
    assert cgroup_available(str(root), str(tmp_path / "self")) == 6 * GiB
    assert available_memory(str(tmp_path / "meminfo"), str(root), str(tmp_path / "self")) == 6 * GiB


def test_no_cgroup_limit_leaves_memavailable(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/\n")
    write(root / "memory.max", "max\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    write(tmp_path / "meminfo", f"MemAvailable: {10 * GiB // 1024} kB\n")
    assert cgroup_available(str(root), str(tmp_path / "self")) is None
    assert available_memory(str(tmp_path / "meminfo"), str(root), str(tmp_path / "self")) == 10 * GiB
    assert cgroup_available(str(tmp_path / "absent"), str(tmp_path / "absent-self")) is None


def test_budget_is_per_host_shared_by_the_local_ranks():
    assert default_budget(environ={"LOCAL_WORLD_SIZE": "8"}, available=80 * GiB) == int(80 * GiB * 0.4) // 8
    assert default_budget(environ={}, available=80 * GiB) == int(80 * GiB * 0.4)
    eight = [default_budget(environ={"LOCAL_WORLD_SIZE": "8"}, available=80 * GiB) for _ in range(8)]
    assert sum(eight) <= 0.4 * 80 * GiB, "8 ranks of one host together stay within 40% of its memory"
    assert default_budget(environ={"LOCAL_WORLD_SIZE": "64"}, available=GiB) == 256 << 20  # the floor
    assert default_budget(environ={"LOCAL_WORLD_SIZE": "8", "BCP_MEMORY_BUDGET": "1e9"}, available=GiB) == 10**9
    assert default_budget(environ={"LOCAL_WORLD_SIZE": "x"}, available=10 * GiB) == 4 * GiB


# -- c. device temporaries of loads, streamed -----------------------------------------------------


def test_cast_and_strided_loads_keep_one_piece_of_device_temporaries_per_stream(fake, tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(6)}  # 256 KiB each, fp32
    bcp.save(state, str(tmp_path / "ck"))
    template = {k: fake.as_device(torch.zeros(256, 256, dtype=torch.bfloat16)) for k in list(state)[:3]}
    template |= {k: fake.as_device(torch.zeros(256, 256)).t() for k in list(state)[3:]}  # strided
    pool = CheckedPool(StagingPool(8 * SLAB, SLAB), fake)
    reader = bcp.open(str(tmp_path / "ck"))
    streams = reader.backend.hints.concurrency
    whole = ((0, 0), (256, 256))
    reader.fill([(k, whole, t) for k, t in template.items()], pool=pool)
    for k, t in template.items():
        assert torch.equal(t, state[k].to(t.dtype)), k
    every = sum(v.numel() * 4 for v in state.values())
    # one whole temporary per destination (the old way) would be 1.5 MiB here
    assert fake.peak_temporary_bytes <= streams * SLAB < every
    assert fake.peak_temporaries <= streams
    assert fake.live_temporaries == 0 and fake.violations == [] and fake.pending() == 0


def _two_fragment_save(rank: int, world: int, uri: str) -> None:
    full = torch.arange(64 * 40, dtype=torch.float32).reshape(64, 40)
    bcp.save({"w": bcp.TensorShard(full[rank * 32 : (rank + 1) * 32].clone(), (64, 40), (rank * 32, 0))}, uri)


def test_shared_values_in_memory_are_not_overwritten_by_a_piece_beside_them(fake, tmp_path):
    uri = str(tmp_path / "ck")
    dist_jobs.spawn(_two_fragment_save, 2, uri)
    full = torch.arange(64 * 40, dtype=torch.float32).reshape(64, 40)
    reader = bcp.open(uri)
    assert len(reader.catalog.fragments) == 2
    held = {("w", ((0, 0), (32, 40))): full[:32].clone()}  # rank 0's fragment, shared by a peer
    for dest in (
        fake.as_device(torch.full((64, 40), -1.0)),  # lands directly: one piece spans both fragments
        fake.as_device(torch.full((64, 40), -1.0, dtype=torch.float64)),  # cast through a temporary
        fake.as_device(torch.full((40, 64), -1.0)).t(),  # strided
    ):
        pool = CheckedPool(StagingPool(8 * SLAB, SLAB), fake)
        pool._pool.acquire = _dirty(pool._pool.acquire)
        reader.fill([("w", ((0, 0), (64, 40)), dest)], in_memory=held, pool=pool)
        assert torch.equal(dest, full.to(dest.dtype)), dest.dtype
    assert fake.violations == []


def _dirty(acquire):
    """Slabs that hold an earlier use's bytes, as reused slabs do."""

    def dirty():
        slab = acquire()
        slab.tensor.fill_(0x7F)
        return slab

    return dirty


# -- d. the first save never waits for pinning; reservations sized from the rank's writes --------


class SlowPinningPool(StagingPool):
    """A "pinned" pool on CPU: pinning takes ``delay`` s a slab and records its thread."""

    def __init__(self, capacity: int, slab_bytes: int, delay: float = 0.02) -> None:
        super().__init__(capacity, slab_bytes, pinned=True)
        self.delay = delay
        self.pinned_in: list[str] = []
        self.peak = 0
        self._peak_lock = threading.Lock()

    def _pinned_buffer(self, nbytes: int) -> torch.Tensor:
        time.sleep(self.delay)
        self.pinned_in.append(threading.current_thread().name)
        return torch.empty(nbytes, dtype=torch.uint8)

    def acquire(self):
        slab = super().acquire()
        with self._peak_lock:
            self.peak = max(self.peak, self._allocated + self._standins)
        return slab


@pytest.mark.slow
def test_first_async_save_without_a_reservation_never_waits_for_pinning(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(8)}  # 8 chunks of 256 KiB
    pool = SlowPinningPool(64 * SLAB, 2 * SLAB, delay=0.15)  # pinning all 8 slabs would take 1.2 s
    caller = threading.current_thread().name
    started = time.perf_counter()
    handle = bcp.async_save(state, str(tmp_path / "a"), pool=pool)
    blocking = time.perf_counter() - started
    handle.wait()
    assert caller not in pool.pinned_in, "the caller pinned memory on the critical path"
    lent = pool.standins_lent
    assert 1 <= lent <= 8, lent  # pinning runs meanwhile: under load it may finish a slab before the last chunk
    assert blocking < 8 * 0.15, "the first save waited for pinning"
    assert_holds(str(tmp_path / "a"), state)
    assert pool.wait_pinned(timeout=30)
    assert pool.allocated_bytes == 8 * 2 * SLAB, "pinned in the background up to the demand seen"
    assert set(pool.pinned_in) == {"bcp-pin-staging"}
    bcp.async_save(state, str(tmp_path / "b"), pool=pool).wait()
    assert pool.standins_lent == lent, "a later save finds its slabs pinned"
    assert_holds(str(tmp_path / "b"), state)
    assert pool.peak <= pool.max_slabs


def test_stand_ins_keep_the_values_at_the_call_and_the_budget(fake, tmp_path):
    """Device copies into stand-ins are ordered as into pinned slabs; a state larger
    than the budget: stand-ins and background pinning share the budget."""
    from test_device_ordering import assert_checkpoint_holds, device_state, mutate, snapshot

    state = device_state(fake, seed=4)
    expected = snapshot(state)
    pool = SlowPinningPool(64 * SLAB, SLAB, delay=0.01)
    fake.gate.clear()  # writers cannot complete the copies before the caller changes the state
    handle = bcp.async_save(state, str(tmp_path / "ck"), pool=CheckedPool(pool, fake))
    assert fake.pending() == 0 and pool.standins_lent > 0
    mutate(state)
    fake.gate.set()
    handle.wait()
    assert_checkpoint_holds(str(tmp_path / "ck"), expected)

    state = device_state(fake, seed=5)
    expected = snapshot(state)
    small = SlowPinningPool(3 * SLAB, SLAB, delay=0.01)  # a few slabs for many chunks
    bcp.async_save(state, str(tmp_path / "small"), pool=CheckedPool(small, fake)).wait()
    assert_checkpoint_holds(str(tmp_path / "small"), expected)
    assert small.peak <= small.max_slabs == 3
    assert small.wait_pinned(timeout=30) and small.allocated_bytes <= small.capacity
    assert fake.violations == []


def test_pinning_failure_leaves_saves_on_stand_ins(tmp_path, caplog):
    class Failing(StagingPool):
        def _pinned_buffer(self, nbytes: int) -> torch.Tensor:
            raise RuntimeError("cudaHostAlloc failed")

    pool = Failing(16 * SLAB, SLAB, pinned=True)
    state = {"w": torch.randn(256, 256)}
    bcp.async_save(state, str(tmp_path / "ck"), pool=pool).wait()
    assert pool.wait_pinned(timeout=30)
    bcp.async_save(state, str(tmp_path / "ck2"), pool=pool).wait()
    assert_holds(str(tmp_path / "ck2"), state)
    assert pool.allocated_bytes == 0
    assert sum("pinning staging memory failed" in r.message for r in caplog.records) == 1


def test_reservation_counts_one_slab_per_object_store_part(tmp_path):
    slab, part = 256 << 10, 128 << 10
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(300, 200, generator=g) for i in range(4)}  # 234 KiB each
    uri = f"fsspec+memory://bcp-{uuid.uuid4().hex}/ck?part_size=128KiB"
    size = sum(t.numel() * 4 for t in state.values())
    reserved = staging_bytes(state, slab, part_size=part)
    assert reserved >= -(-size // part) * slab > -(-size // slab) * slab
    pool = StagingPool(64 * slab, slab, pinned=False)
    assert bcp.reserve_staging(state, pool=pool, part_size=part, background=False).wait() == reserved
    bcp.async_save(state, uri, pool=pool).wait()
    assert pool.allocated_bytes == reserved, "the first save needed slabs the reservation did not count"
    assert_holds(uri, state)


def _ddp_reservation_job(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)  # every rank the same replicated state (DDP)
    state = {f"layer{i}.weight": torch.randn(128, 256) for i in range(8)}  # 128 KiB each, 1 MiB
    pool = StagingPool(64 * SLAB, SLAB, pinned=False)
    bcp.io_scheduler.staging._default = pool
    whole = staging_bytes(state, SLAB)
    manager = bcp.CheckpointManager(root, keep_last=2)
    step, _ = manager.load_latest(state)
    assert step is None
    reserved = manager._reservation.wait(timeout=60)
    assert reserved <= whole * 0.625, f"rank {rank} reserved {reserved} of a state taking {whole} whole"
    manager.save(1, state)
    manager.wait()
    assert pool.allocated_bytes == reserved, f"rank {rank}: the first save allocated beyond its reservation"
    local = bcp.reserve_staging(state, pool=StagingPool(64 * SLAB, SLAB, pinned=False), background=False)
    assert local.wait() == whole, "without collective=True the reservation is the whole local state"


def test_ddp_ranks_reserve_their_own_share_after_the_resume_load(tmp_path):
    dist_jobs.spawn(_ddp_reservation_job, 2, str(tmp_path / "run"))


def test_manager_starts_the_reservation_after_the_resume_load(tmp_path, monkeypatch):
    import bcp.manager

    order: list[str] = []
    real_load, real_reserve = bcp.manager.load_with_info, bcp.manager.reserve_staging
    monkeypatch.setattr(bcp.manager, "load_with_info", lambda *a, **k: order.append("load") or real_load(*a, **k))
    monkeypatch.setattr(
        bcp.manager, "reserve_staging", lambda *a, **k: order.append("reserve") or real_reserve(*a, **k)
    )
    state = {"w": torch.randn(64, 64)}
    with bcp.CheckpointManager(str(tmp_path / "run"), async_save=False) as m:
        m.save(1, state)
    manager = bcp.CheckpointManager(str(tmp_path / "run"))
    step, _ = manager.load_latest({"w": torch.zeros(64, 64)})
    assert step == 1 and order == ["load", "reserve"]
    assert manager._reservation is not None and manager._reservation.wait(timeout=60) >= 64 * 64 * 4


# -- e. blocking events, one side stream per device ----------------------------------------------------


def test_events_block_instead_of_spinning(monkeypatch):
    made: list[dict] = []

    class Event:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    bcp.io_scheduler.device_copy.CudaApi().new_event()
    assert made == [{"blocking": True}]


def test_cuda_api_makes_one_side_stream_per_device(monkeypatch):
    made: list = []

    class Stream:
        def __init__(self, device) -> None:
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    api = bcp.io_scheduler.device_copy.CudaApi()
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert api.side_stream(d0) is api.side_stream(d0)
    assert api.side_stream(d1) is not api.side_stream(d0)
    assert made == [d0, d1]


def test_saves_and_loads_reuse_one_side_stream(fake, tmp_path):
    from test_device_ordering import device_state

    state = device_state(fake, seed=6)
    pool = StagingPool(64 * SLAB, SLAB)
    handles = [bcp.async_save(state, str(tmp_path / f"a{k}"), pool=pool) for k in range(3)]
    for handle in handles:
        handle.wait()
    bcp.save(state, str(tmp_path / "s"), pool=pool)
    dest = fake.as_device(torch.zeros(300, 257))
    bcp.open(str(tmp_path / "s")).fill([("big", ((0, 0), (300, 257)), dest)], pool=pool)
    assert torch.equal(dest, state["big"])
    assert [s.name for s in fake.streams] == ["side0"], "a new side stream per save or load"
    assert fake.violations == []
