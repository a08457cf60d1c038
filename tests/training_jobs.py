"""Multi-process jobs for tests/test_training_state.py (gloo on CPU, spawned with
dist_jobs.spawn): FSDP2 + AdamW + LR scheduler + StatefulDataLoader saved and resumed
with bcp.TrainingState, and the FSDP2 ``optimizer.state_dict()`` mistake."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
import torch.distributed as dist

import bcp
import dist_jobs
from bcp.dataloader import ShardedSampler

NUM_SAMPLES = 40
BATCH = 3
STEPS_BEFORE_SAVE = 2

warnings.filterwarnings("ignore", message=".*set_vital.*")


def fsdp_job_parts(world: int):
    """An FSDP2 model over every rank, AdamW, a step scheduler and a StatefulDataLoader."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    model = dist_jobs.make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = torch.arange(NUM_SAMPLES)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=ShardedSampler(NUM_SAMPLES, seed=5))
    return model, opt, sched, loader


def rng_digest() -> str:
    return hashlib.sha256(bytes(torch.get_rng_state().numpy())).hexdigest()


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save_training_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """Train STEPS_BEFORE_SAVE steps on per-rank seeded RNG, save with one call, and
    keep a reference: full optimizer state, LR, consumed sample ids, RNG digests."""
    model, opt, sched, loader = fsdp_job_parts(world)
    torch.manual_seed(100 + rank)  # after make_model's seed: each rank its own RNG
    batches = iter(loader)
    consumed: list[int] = []
    for step in range(STEPS_BEFORE_SAVE):
        ids = next(batches)
        consumed += ids.tolist()
        model(dist_jobs.batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    extra = {"step": STEPS_BEFORE_SAVE}
    bcp.TrainingState(model, opt, sched, loader, extra).save(uri)
    ref = dist_jobs.full_reference(model, opt)
    consumed_all, digests = gather(consumed), gather(rng_digest())
    if rank == 0:
        ref.update(lr=sched.get_last_lr(), last_epoch=sched.last_epoch, consumed=consumed_all, rng=digests)
        torch.save(ref, ref_path)


def load_training_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """Resume with one call at any world size: optimizer tensors exact, scheduler,
    step and LR restored, the rest of the epoch dealt without loss or repeat, and
    every rank's RNG distinct (kept for ranks that existed)."""
    ref = torch.load(ref_path, weights_only=False)
    torch.manual_seed(0)  # every rank the same RNG before resuming: the load must undo that
    model, opt, sched, loader = fsdp_job_parts(world)
    extra = {"step": 0}
    bcp.TrainingState(model, opt, sched, loader, extra).load(uri)
    assert extra["step"] == STEPS_BEFORE_SAVE
    assert sched.last_epoch == ref["last_epoch"] and sched.get_last_lr() == ref["lr"]
    assert opt.param_groups[0]["lr"] == ref["lr"][0]
    got = dist_jobs.full_reference(model, opt)
    want_t, got_t = dist_jobs.flatten_tensors(ref["optim"]), dist_jobs.flatten_tensors(got["optim"])
    assert set(want_t) == set(got_t) and want_t
    for key, value in want_t.items():
        assert torch.equal(got_t[key], value), key
    for key, value in dist_jobs.flatten_tensors(ref["model"]).items():
        assert torch.equal(dist_jobs.flatten_tensors(got["model"])[key], value), key
    digests = gather(rng_digest())
    assert len(set(digests)) == world, f"two ranks share an RNG state: {digests}"
    saved_ranks = len(ref["rng"])
    if rank < saved_ranks:
        assert digests[rank] == ref["rng"][rank]
    else:
        assert digests[rank] not in ref["rng"]
    rest = [int(i) for batch in loader for i in batch]
    seen = [i for ids in ref["consumed"] for i in ids] + [i for ids in gather(rest) for i in ids]
    assert sorted(seen) == list(range(NUM_SAMPLES)), "a sample was lost or repeated"


def save_with_optimizer_state_dict_job(rank: int, world: int, uri: str) -> None:
    """The FSDP2 mistake on save: opt.state_dict() (int-keyed, DTensor values)."""
    model, opt, _sched, _loader = fsdp_job_parts(world)
    dist_jobs.train(model, opt, range(1), rank)
    bcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, uri)


def load_with_optimizer_state_dict_job(rank: int, world: int, uri: str) -> None:
    """Resuming with a fresh opt.state_dict() on several FSDP2 ranks is refused, naming
    the keys and the fix, before the reader allocates anything."""
    from bcp.reader import CheckpointReader

    model, opt, _sched, _loader = fsdp_job_parts(world)
    allocations = []
    real_empty = CheckpointReader.empty

    def counting_empty(self, fqn, box=None):
        allocations.append(fqn)
        return real_empty(self, fqn, box)

    CheckpointReader.empty = counting_empty  # a spy: counts calls, the real method runs
    try:
        bcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, uri)
    except bcp.UnsupportedStateError as e:
        message = str(e)
    else:
        raise AssertionError("loading full-size plain optimizer state beside DTensors succeeded")
    finally:
        CheckpointReader.empty = real_empty
    assert "optim.state.0.exp_avg" in message and "get_optimizer_state_dict" in message, message
    assert allocations == [], allocations
    # a plain full-size tensor the caller put in the template beside DTensors is a
    # request for the whole tensor on this rank: honoured, however it was saved
    full = torch.full((dist_jobs.HIDDEN, 10), 7.0)
    template = {"model": model.state_dict(), "optim": {"state": {0: {"exp_avg": full}}}}
    bcp.load(template, uri, strict=False)
    assert torch.equal(full, bcp.open(uri).read("optim.state.0.exp_avg"))


def load_plain_into_ddp_like_ranks_job(rank: int, world: int, uri: str) -> None:
    """Plain (unsharded) models on several ranks load an FSDP2 checkpoint: no DTensor
    in the template, so the guard stays silent and every rank gets the whole tensors."""
    model = dist_jobs.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = bcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, uri)
    opt.load_state_dict(state["optim"])
    assert opt.state_dict()["state"][0]["exp_avg"].shape == model[0].weight.shape


def ddp_training_save_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """DDP + AdamW + StepLR saved with one call; the reference is the unwrapped state."""
    from torch.nn.parallel import DistributedDataParallel

    model = dist_jobs.make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        ddp(dist_jobs.batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.manual_seed(rank)
    bcp.TrainingState(ddp, opt, sched, extra={"step": 2}).save(uri)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state()}, ref_path)


def tp_training_save_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """Tensor parallelism (column- then row-wise) saved with one call; full reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = dist_jobs.make_model()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dist_jobs.train(model, opt, range(2), 0)  # the same batch on every rank: TP ranks see one input
    bcp.TrainingState(model, opt, extra={"step": 2}).save(uri)
    ref = dist_jobs.full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)


def fresh_fsdp_resume_job(rank: int, world: int, root: str) -> None:
    """FSDP2: a fresh run's load_latest and a save before the first step leave the
    optimizer without state; that run, and one resumed from its step-0 checkpoint,
    equal the loop without bcp bit for bit."""

    def train(model, opt, sched, steps: int) -> dict:
        for step in range(steps):
            model(dist_jobs.batch(step, rank)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return dist_jobs.flatten_tensors(dist_jobs.full_reference(model, opt))

    model, opt, sched, _loader = fsdp_job_parts(world)
    want = train(model, opt, sched, 3)

    model, opt, sched, _loader = fsdp_job_parts(world)
    manager = bcp.CheckpointManager(root, async_save=True)
    job = bcp.TrainingState(model, opt, sched)
    assert manager.load_latest({"train": job})[0] is None
    manager.save(0, {"train": job})
    manager.wait()
    assert not opt.state, "neither load_latest nor the save leaves optimizer state"
    got = train(model, opt, sched, 3)
    assert got.keys() == want.keys() and want
    for key, value in want.items():
        assert torch.equal(got[key], value), f"uninterrupted: {key}"

    model, opt, sched, _loader = fsdp_job_parts(world)
    assert manager.load_latest({"train": bcp.TrainingState(model, opt, sched)})[0] == 0
    assert not opt.state
    got = train(model, opt, sched, 3)
    for key, value in want.items():
        assert torch.equal(got[key], value), f"resumed from step 0: {key}"
    manager.close()


def fsdp_cached_state_job(rank: int, world: int) -> None:
    """FSDP2: TrainingState.state_dict() after the first call (cached) equals a fresh
    TrainingState's (get_state_dict's full path), the live DTensors, across a first
    step, scheduler steps, a load and an unshard/reshard; get_state_dict is called
    only when the cache does not fit."""
    from unittest import mock

    from torch.distributed.checkpoint import state_dict as dsd

    from test_training_state_cache import assert_same_state

    model, opt, sched, _loader = fsdp_job_parts(world)
    ts = bcp.TrainingState(model, opt, sched, rng=False)

    def check(live: bool = True) -> dict:
        got = ts.state_dict()
        assert_same_state(got, bcp.TrainingState(model, opt, sched, rng=False).state_dict(), "", live)
        return got

    def step(i: int) -> None:
        model(dist_jobs.batch(i, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    with mock.patch.object(dsd, "get_state_dict", wraps=dsd.get_state_dict) as full:
        check(live=False)  # before the first step: full path, nothing cached
        step(0)
        check()  # the first step: state appears, the full path learns
        calls = full.call_count
        for i in range(1, 3):
            step(i)
            saved = check()
        assert full.call_count == calls + 2, "only the uncached references call get_state_dict"
        ts.load_state_dict(saved)
        check()
        model.unshard()  # the unsharded parameters registered: the cache does not fit them
        model.reshard()
        check()


def load_one_rank_save_on_more_job(rank: int, world: int, uri: str, seen_path: str) -> None:
    """A TrainingState saved by one process (its dataloader mid-epoch, its RNG), loaded on
    ``world`` ranks: the rest of the epoch dealt over them (each sample once), and each
    rank its own RNG state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        torch.arange(NUM_SAMPLES), batch_size=BATCH, sampler=ShardedSampler(NUM_SAMPLES, seed=5)
    )
    bcp.TrainingState(torch.nn.Linear(2, 2), dataloader=loader).load(uri)
    rest = [int(i) for batch in loader for i in batch]
    gathered, rngs = gather(rest), gather(rng_digest())
    if rank == 0:
        seen = torch.load(seen_path, weights_only=True)
        dealt = [i for part in gathered for i in part]
        assert sorted(dealt) == sorted(set(range(NUM_SAMPLES)) - set(seen)), (seen, gathered)
        assert len(set(rngs)) == world, "two ranks resumed with the same RNG state"


def per_rank_without_a_hook_job(rank: int, world: int, uri: str) -> None:
    """``bcp.load`` of a PerRank one process saved, on ``world`` ranks with no
    ``reshard_objects``: refused on every rank naming the key (it gave every rank the one
    value before: twin RNG states), nothing else asked."""
    from bcp.errors import UnsupportedStateError

    with pytest.raises(UnsupportedStateError, match=r"saved by 1 rank\(s\), is loaded by 2.*reshard_objects.*'?rng"):
        bcp.load({"rng": bcp.PerRank(None), "w": torch.zeros(2)}, uri)
    hook = lambda fqn, by_rank, r, w: {"seed": by_rank[0]["seed"] + r}  # noqa: E731 - what a caller decides
    assert bcp.load({"rng": bcp.PerRank(None), "w": torch.zeros(2)}, uri, reshard_objects=hook)["rng"] == {
        "seed": 7 + rank
    }
