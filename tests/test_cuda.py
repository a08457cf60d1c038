"""CUDA: async saves capture exactly the values at the call, loads into device memory
are exact, DTensor and FSDP2 on one GPU. Skipped without CUDA (CI has none); the
same ordering rules are checked on CPU by tests/test_device_ordering.py.

The corruption these tests guard against is a race, so the async cases use tensors
large enough (1 GiB in all) that a copy still runs when the caller's next kernel
is queued, and repeat several trials.
"""

from __future__ import annotations

import gc

import pytest
import torch

import bcp
from helpers import stored_dtypes, tensor_bytes_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ALL_DTYPES = stored_dtypes()
TRIALS = 3


def big_state(n: int = 16, mib: int = 64, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {f"t{i}": torch.randn(mib << 18, device="cuda", generator=g) for i in range(n)}


def cpu_copy(state: dict) -> dict:
    torch.cuda.synchronize()
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def assert_checkpoint(uri: str, expected: dict) -> None:
    reader = bcp.open(uri)
    bad = [k for k, v in expected.items() if isinstance(v, torch.Tensor) and not torch.equal(reader.read(k), v)]
    assert not bad, f"{len(bad)} of {len(expected)} tensors hold values from after the call: {bad[:4]}"


@pytest.mark.parametrize("trial", range(TRIALS))
def test_inplace_change_on_the_current_stream_right_after_async_save(tmp_path, trial):
    state = big_state(seed=trial)
    expected = cpu_copy(state)
    handle = bcp.async_save(state, str(tmp_path / "ck"))
    for t in state.values():
        t.mul_(-3).add_(1)  # queued at once on the default stream
    handle.wait()
    assert_checkpoint(str(tmp_path / "ck"), expected)


def test_inplace_change_on_another_stream_right_after_async_save(tmp_path):
    state = big_state(seed=7)
    expected = cpu_copy(state)
    side = torch.cuda.Stream()
    handle = bcp.async_save(state, str(tmp_path / "ck"))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in state.values():
            t.fill_(float("nan"))
    handle.wait()
    torch.cuda.synchronize()
    assert_checkpoint(str(tmp_path / "ck"), expected)


def test_values_at_the_call_include_work_queued_just_before_it(tmp_path):
    state = big_state(n=4, seed=3)
    expected = {k: v * 2 for k, v in cpu_copy(state).items()}
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(8):
        busy = busy @ busy  # about 0.1 s of queued work: the kernels below are still pending at the call
    for t in state.values():
        t.mul_(2)  # queued, not yet run, when async_save is called (no synchronize in between)
    bcp.async_save(state, str(tmp_path / "ck")).wait()
    assert_checkpoint(str(tmp_path / "ck"), expected)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_incremental_save_in_a_side_stream_right_after_an_update_on_it(tmp_path, how):
    """The digests and first-block checksums (other threads, their own streams) wait for
    the caller's stream: a piece changed there just before the call is written, not
    referred to the base's old bytes."""
    state = big_state(n=4, mib=16, seed=11)
    state["t_strided"] = torch.randn(2048, 1024, device="cuda").t()  # first block made contiguous
    base = str(tmp_path / "base")
    bcp.save(state, base, incremental=True)
    update = {k: torch.randn_like(v) for k, v in state.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        busy = torch.randn(8192, 8192, device="cuda")
        for _ in range(8):
            busy = busy @ busy  # queued work: the copies below are still pending at the call
        for k, t in state.items():
            t.copy_(update[k])
        if how == "save":
            bcp.save(state, str(tmp_path / "next"), base=base)
        else:
            bcp.async_save(state, str(tmp_path / "next"), base=base).wait()
    torch.cuda.synchronize()
    expected = {k: v.cpu() for k, v in update.items()}
    assert_checkpoint(str(tmp_path / "next"), expected)


def test_freed_tensors_memory_reused_right_after_async_save(tmp_path):
    """The contract as a user sees it (what keeps it: the save holds its sources until
    written, and waits for its copies before returning)."""
    state = big_state(seed=11)
    expected = cpu_copy(state)
    handle = bcp.async_save(state, str(tmp_path / "ck"))
    del state
    gc.collect()
    garbage = [torch.full((64 << 18,), 123.0, device="cuda") for _ in range(16)]  # likely the same blocks
    handle.wait()
    assert_checkpoint(str(tmp_path / "ck"), expected)
    del garbage


def make_training(dim: int = 2048, layers: int = 8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, dim, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, opt, step


def flat_cpu(state: dict) -> dict:
    from bcp.state import flatten_state

    torch.cuda.synchronize()
    return {leaf.fqn: leaf.value.detach().cpu().clone() for leaf in flatten_state(state).values() if leaf.is_tensor}


@pytest.mark.parametrize("overlap", [False, True])
def test_training_step_after_async_save(tmp_path, overlap):
    model, opt, step = make_training()
    for trial in range(TRIALS):
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = flat_cpu(state)
        uri = str(tmp_path / f"ck{trial}")
        handle = bcp.async_save(state, uri, overlap=opt if overlap else None)
        step()
        step()
        handle.wait()
        assert_checkpoint(uri, expected)


def test_overlap_with_freed_optimizer_state(tmp_path):
    model, opt, step = make_training(dim=1024, layers=4)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = flat_cpu(state)
    handle = bcp.async_save(state, str(tmp_path / "ck"), overlap=opt)
    step()  # the pre-hook orders this step after the background copies
    del state
    opt.state.clear()  # the moments are dropped by the optimizer while the save may still write them
    gc.collect()
    junk = [torch.full((1024, 1024), 5.0, device="cuda") for _ in range(16)]
    handle.wait()
    assert_checkpoint(str(tmp_path / "ck"), expected)
    del junk


def test_first_async_save_after_reservation_does_not_allocate(tmp_path):
    from bcp.io_scheduler.staging import StagingPool

    state = big_state(n=8, seed=5)
    pool = StagingPool(1 << 30)
    assert pool.pinned
    bcp.reserve_staging(state, pool=pool).wait()
    before = pool.allocated_bytes
    bcp.async_save(state, str(tmp_path / "ck"), pool=pool).wait()
    assert pool.allocated_bytes == before


# -- runtime limits of a multi-host job (CPU-side logic: tests/test_gpu_limits.py) ----------------


def test_two_overlapped_saves_then_step_with_user_hooks_before_and_after(tmp_path):
    model, opt, step = make_training(dim=1024, layers=4)
    ran: list[str] = []
    before = opt.register_step_pre_hook(lambda *_: ran.append("before"))
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = flat_cpu(state)
    a = bcp.async_save(state, str(tmp_path / "a"), overlap=opt)
    b = bcp.async_save(state, str(tmp_path / "b"), overlap=opt)
    after = opt.register_step_pre_hook(lambda *_: ran.append("after"))
    try:
        step()  # the old hook removed itself during torch's iteration: 'OrderedDict mutated'
        step()
        a.wait()
        b.wait()
    finally:
        before.remove()
        after.remove()
    assert ran == ["before", "after"] * 2
    assert_checkpoint(str(tmp_path / "a"), expected)
    assert_checkpoint(str(tmp_path / "b"), expected)


def test_rng_resumed_on_more_ranks_than_saved_restores_a_cuda_state():
    from bcp.training import reshard_rng_states, rng_state, set_rng_state

    torch.cuda.manual_seed(3)
    saved = {0: rng_state()}
    derived = reshard_rng_states(saved, 1, 2)  # rank 1 did not exist when saved
    set_rng_state(derived)  # a CPU-generator state here: 'RNG state is wrong size'
    assert torch.equal(torch.cuda.get_rng_state(), derived["cuda_device"])
    first = torch.rand(8, device="cuda")
    set_rng_state(derived)
    assert torch.equal(torch.rand(8, device="cuda"), first)
    set_rng_state(saved[0])
    assert torch.equal(torch.cuda.get_rng_state(), saved[0]["cuda_device"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_rng_of_the_current_device_goes_to_the_resuming_ranks_current_device():
    from bcp.training import rng_state, set_rng_state

    previous = torch.cuda.current_device()
    try:
        torch.cuda.set_device(1)  # as LOCAL_RANK=1 would
        torch.cuda.manual_seed(11)
        torch.rand(100, device="cuda")  # advance device 1's offset
        saved = rng_state()
        assert torch.equal(saved["cuda_device"], torch.cuda.get_rng_state(1))
        torch.cuda.set_device(0)  # the same rank resumed where it uses device 0
        set_rng_state(saved)
        assert torch.equal(torch.cuda.get_rng_state(0), saved["cuda_device"])
    finally:
        torch.cuda.set_device(previous)


def test_default_budget_is_shared_by_the_ranks_of_a_host(monkeypatch):
    from bcp.io_scheduler.staging import available_memory, default_budget

    monkeypatch.delenv("BCP_MEMORY_BUDGET", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_budget() <= max(256 << 20, int(available_memory() * 0.4 * 1.05) // 8)


def test_cast_and_strided_loads_stream_their_device_temporaries(tmp_path):
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(4096, 4096, generator=g) for i in range(8)}  # 8 x 64 MiB fp32, saved from CPU
    bcp.save(state, str(tmp_path / "ck"))
    template = {f"t{i}": torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda") for i in range(4)}
    template |= {f"t{i}": torch.empty(4096, 4096, device="cuda").t() for i in range(4, 8)}  # strided
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = bcp.load(template, str(tmp_path / "ck"), strict=False)  # casts fp32 -> bf16
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # a temporary per destination, allocated before the first read, was 512 MiB here
    assert extra < 256 << 20, f"{extra / 2**20:.0f} MiB of device temporaries"
    for k, v in state.items():
        assert torch.equal(out[k].cpu(), v.to(out[k].dtype)), k


_FIRST_SAVE = """
import json, sys, time
import torch, bcp
state = {f"t{i}": torch.randn(64 << 18, device="cuda") for i in range(16)}  # 1 GiB
def timed(uri):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    handle = bcp.async_save(state, uri)
    blocking = time.perf_counter() - t0
    handle.wait()
    return blocking
first = timed(sys.argv[1] + "/first")
pool = bcp.io_scheduler.staging.default_pool()
pool.wait_pinned(120)
later = min(timed(sys.argv[1] + f"/later{k}") for k in range(2))
def fresh_copy():  # the same bytes copied to the host into freshly allocated (never touched) pageable memory
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copies = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in state.values()]
    torch.cuda.synchronize()
    return time.perf_counter() - t0
fresh = min(fresh_copy() for _ in range(2))
print(json.dumps({"first": first, "later": later, "fresh": fresh, "standins": pool.standins_lent}))
"""


def test_first_async_save_without_a_reservation_does_not_wait_for_pinning(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FIRST_SAVE, str(tmp_path)], capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["standins"] > 0, "the first save found nothing to lend: it pinned on the critical path"
    # issue 37's target: the first call at most 2x a copy of the same bytes into fresh memory (pinning 1 GiB on the
    # critical path, which this guards against, costs about a second more than that)
    assert got["first"] <= 2 * got["fresh"] + 0.05, got


def test_reservation_counts_one_slab_per_object_store_part(tmp_path):
    import uuid

    from bcp.io_scheduler.staging import StagingPool

    state = big_state(n=4, mib=48, seed=4)
    pool = StagingPool(1 << 30)
    part = 16 << 20
    reserved = bcp.reserve_staging(state, pool=pool, part_size=part).wait()
    assert reserved >= 4 * 48 * pool.slab_bytes // 16  # one 32 MiB slab per 16 MiB part
    lent = pool.standins_lent
    uri = f"fsspec+memory://bcp-{uuid.uuid4().hex}/ck?part_size=16MiB"
    bcp.async_save(state, uri, pool=pool).wait()
    assert pool.allocated_bytes == reserved and pool.standins_lent == lent, "the first save lacked slabs"
    assert_checkpoint(uri, cpu_copy(state))


def test_copy_events_block_the_waiting_thread():
    import time

    from bcp.io_scheduler import device_copy

    a = torch.randn(8192, 8192, device="cuda") / 8192
    for _ in range(16):
        a = a @ a  # a few hundred ms of queued work
    event = device_copy.api.new_event()
    event.record(torch.cuda.current_stream())
    wall, cpu = time.perf_counter(), time.thread_time()
    event.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall > 0.05, "the work finished before the wait: nothing measured"
    assert cpu < 0.5 * wall, f"the waiting thread spun: {cpu:.3f} s of CPU in {wall:.3f} s"


def test_saves_and_loads_reuse_one_side_stream(tmp_path):
    state = big_state(n=2, mib=16, seed=6)
    handles = [bcp.async_save(state, str(tmp_path / f"a{k}")) for k in range(3)]
    streams = [h._job.pipeline.copies._side[torch.device("cuda", torch.cuda.current_device())] for h in handles]
    for handle in handles:
        handle.wait()
    assert all(s == streams[0] for s in streams), "each save took a new side stream"
    assert_checkpoint(str(tmp_path / "a2"), cpu_copy(state))


def host_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bytes (compared bitwise: NaN payloads and non-0/1 bools included)."""
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_and_strided_views_round_trip_through_cuda(tmp_path, dtype):
    from bcp.tensor_io import host_contiguous, raw

    host = {"plain": host_tensor(dtype, (64, 48), 1), "t": host_tensor(dtype, (40, 30), 2)}
    base, other = (raw(host[k]).cuda().view(dtype) for k in ("plain", "t"))
    state = {"plain": base, "t": other.t(), "step": base[::3, 1:], "empty": base[:0]}
    # expected bytes from the CPU originals: CUDA has no copy kernels for sub-byte dtypes
    expected = {
        "plain": host["plain"],
        "t": host_contiguous(host["t"].t()),
        "step": host_contiguous(host["plain"][::3, 1:]),
        "empty": host["plain"][:0],
    }
    bcp.async_save(state, str(tmp_path / "a")).wait()
    bcp.save(state, str(tmp_path / "s"))
    for uri in (tmp_path / "a", tmp_path / "s"):
        template = {k: torch.empty(v.shape, dtype=dtype, device="cuda") for k, v in expected.items()}
        template["t"] = torch.empty(40, 30, dtype=dtype, device="cuda").t()  # a strided destination of t's shape
        out = bcp.load(template, str(uri))
        for k, v in expected.items():
            got = raw(out[k]).cpu().view(dtype)  # integer views copy for every dtype
            assert out[k].is_cuda and tensor_bytes_equal(host_contiguous(got), v), (uri, k)


def test_load_into_cuda_templates_with_reshard_boxes_and_casts(tmp_path):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1000, 777, generator=g)
    bcp.save({"w": full, "v": torch.randn(5000, generator=g)}, str(tmp_path / "ck"))
    reader = bcp.open(str(tmp_path / "ck"))
    boxes = [((0, 0), (1000, 777)), ((123, 45), (600, 700)), ((999, 0), (1, 777)), ((0, 700), (1000, 77))]
    dests = [torch.full(n, -1.0, device="cuda") for _o, n in boxes]
    reader.fill([("w", b, d) for b, d in zip(boxes, dests, strict=True)])
    for (o, n), d in zip(boxes, dests, strict=True):
        assert torch.equal(d.cpu(), full[o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    out = bcp.load(
        {"w": torch.empty(1000, 777, dtype=torch.bfloat16, device="cuda")}, str(tmp_path / "ck"), strict=False
    )
    assert torch.equal(out["w"].cpu(), full.to(torch.bfloat16))
    shard = bcp.TensorShard(torch.empty(250, 777, device="cuda"), (1000, 777), (500, 0))
    bcp.load({"w": shard}, str(tmp_path / "ck"), strict=False)
    assert torch.equal(shard.local.cpu(), full[500:750])


def test_large_load_into_cuda_is_exact(tmp_path):
    state = big_state(n=4, mib=64, seed=9)
    expected = cpu_copy(state)
    bcp.save(state, str(tmp_path / "ck"))
    template = {k: torch.empty_like(v) for k, v in state.items()}
    out = bcp.load(template, str(tmp_path / "ck"))
    for k, v in expected.items():
        assert torch.equal(out[k].cpu(), v), k


# -- DTensor and FSDP2 on a one-GPU mesh ------------------------------------------------------


def _one_gpu_job(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    full = torch.randn(96, 40, generator=torch.Generator().manual_seed(1))
    dt = distribute_tensor(full.cuda(), mesh, [Shard(0)])
    bcp.save({"dt": dt, "rep": distribute_tensor(full.cuda(), mesh, [Replicate()])}, f"{root}/dt")
    back = distribute_tensor(torch.zeros(96, 40, device="cuda"), mesh, [Shard(1)])
    rep = torch.zeros(96, 40, device="cuda")
    bcp.load({"dt": back, "rep": rep}, f"{root}/dt")
    assert torch.equal(back.full_tensor().cpu(), full) and torch.equal(rep.cpu(), full)

    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 32, device="cuda")).sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    msd, osd = get_state_dict(model, opt)
    bcp.async_save({"model": msd, "optim": osd}, f"{root}/fsdp").wait()
    other, other_opt = trained(5)
    m2, o2 = get_state_dict(other, other_opt)
    loaded = bcp.load({"model": m2, "optim": o2}, f"{root}/fsdp")
    set_state_dict(other, other_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for (name, a), (_n, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a.full_tensor().cpu(), b.full_tensor().cpu()), name
    dist.barrier()


def test_dtensor_and_fsdp2_on_a_one_gpu_mesh_reshard_into_cpu_layouts(tmp_path):
    import torch.multiprocessing as mp

    from dist_jobs import free_port

    mp.spawn(_nccl_entry, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    reader = bcp.open(str(tmp_path / "fsdp"))
    assert reader.read("model.0.weight").shape == (64, 32) and reader.read("model.0.weight").device.type == "cpu"
    # the FSDP2 checkpoint into a plain CPU model, and into two CPU shards of another layout
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    bcp.load({"model": plain.state_dict()}, str(tmp_path / "fsdp"), strict=False)
    assert torch.equal(plain.state_dict()["0.weight"], reader.read("model.0.weight"))
    top = bcp.TensorShard(torch.empty(32, 32), (64, 32), (32, 0))
    bcp.load({"model": {"0.weight": top}}, str(tmp_path / "fsdp"), strict=False)
    assert torch.equal(top.local, reader.read("model.0.weight")[32:])


def _nccl_entry(rank: int, port: int, root: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        _one_gpu_job(0, 1, root)
    finally:
        dist.destroy_process_group()


# -- Lightning's FSDPStrategy (FSDP1) through bcp: bcp.integrations.lightning.BcpFSDPStrategy


def _fsdp1(world: int, job, root: str) -> None:
    """``job`` on ``world`` GPUs, each rank started as a launcher would (Lightning sets up NCCL)."""
    pytest.importorskip("lightning")
    import torch.multiprocessing as mp

    from dist_jobs import free_port
    from lightning_sharded_jobs import fsdp1_entry

    mp.start_processes(fsdp1_entry, args=(world, free_port(), job, (root,)), nprocs=world, start_method="spawn")


def test_lightning_fsdp1_resume_is_bit_identical_on_one_gpu(tmp_path):
    from lightning_sharded_jobs import fsdp1_resume

    _fsdp1(1, fsdp1_resume, str(tmp_path))
    with bcp.open(str(tmp_path / "first" / "epoch=1.ckpt")) as reader:  # readable anywhere: no GPU, no FSDP
        assert reader.read("state_dict.net.0.weight").shape == (5, 3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_lightning_fsdp1_resume_on_two_gpus_and_on_another_number(tmp_path):
    from lightning_sharded_jobs import fsdp1_reload, fsdp1_resume, fsdp1_save

    _fsdp1(2, fsdp1_resume, str(tmp_path / "same"))
    _fsdp1(2, fsdp1_save, str(tmp_path / "cross"))
    _fsdp1(1, fsdp1_reload, str(tmp_path / "cross"))
