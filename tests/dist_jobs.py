"""Multi-process jobs for tests/test_distributed.py (gloo on CPU, started from a fork
server by torch.multiprocessing.start_processes). Every job asserts inside the workers; a failure
propagates to the test with the worker's traceback."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import sys

import torch
import torch.distributed as dist

import bcp
from bcp.metadata import MANIFEST_KEY

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from dataloader_reshard import ShardedSampler, consumed_ids, reshard_sampler_state

HIDDEN = 34  # odd over 4 ranks (uneven FSDP shards); even over 2 (DTensor TP needs that)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Imported once by the fork server, so that a rank starts in a tenth of a second instead
#: of importing torch anew (Python 3.11's fork server ignores the tests' sys.path, so only
#: installed modules can be preloaded; a failed import is skipped silently).
PRELOAD = [
    "numpy",
    "pyarrow",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    # an optimizer's first step() imports this (and sympy): about 2.5 CPU-s in every rank
    # that trains, paid once here instead; only preloaded, never called
    "torch._dynamo",
    "bcp",
    # what the integration tests' ranks import (about 1.5 CPU-s each, in every one of some
    # 25 ranks a session starts); optional extras: skipped where not installed
    "lightning.pytorch",
    "transformers.trainer",
]


def fork_context():
    """The fork-server context every multi-process test starts its ranks from.

    A fork server keeps sys.path and the working directory of the test (multiprocessing
    sends them with each process) but not its environment or umask: pass
    :func:`parent_settings` along and apply it with :func:`adopt`.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def parent_settings() -> tuple[dict[str, str], int]:
    """The test's environment and umask, for the ranks to adopt."""
    mask = os.umask(0o022)
    os.umask(mask)
    return dict(os.environ), mask


def adopt(settings: tuple[dict[str, str], int]) -> None:
    """Make a forked rank's environment and umask the test's (monkeypatched ones included)."""
    env, mask = settings
    os.environ.clear()
    os.environ.update(env)
    os.umask(mask)


def spawn(job, world: int, *args) -> None:
    """Run ``job(rank, world, *args)`` on ``world`` gloo ranks; a rank's failure fails the test."""
    import torch.multiprocessing as mp

    fork_context()
    mp.start_processes(
        _entry,
        args=(world, free_port(), job, args, parent_settings()),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )


def _entry(rank: int, world: int, port: int, job, args, settings) -> None:
    adopt(settings)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("BCP_COLLECTIVE_TIMEOUT", "120")
    torch.set_num_threads(1)
    import faulthandler

    faulthandler.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job(rank, world, *args)
    dist.barrier()  # no rank tears down gloo while another still talks to it
    dist.destroy_process_group()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 6))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 10, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(model, opt, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        loss = model(batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- FSDP2 and 2-D (FSDP x TP) ---------------------------------------------------------


def sharded_model(world: int, layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if layout == "2d":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def sharded_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def restore(model, opt, state) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_reference(model, opt) -> dict:
    """Full (unsharded) model and optimizer state, for comparisons."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    # clone: some entries (optimizer 'step') are the live tensors, which training mutates
    return _clone({"model": msd, "optim": osd})


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def flatten_tensors(d, prefix="") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_tensors(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = v
    return out


def assert_equal_to_reference(got: dict, ref: dict, where: str) -> None:
    a, b = flatten_tensors(got), flatten_tensors(ref)
    assert a.keys() == b.keys(), f"{where}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs from the reference"


def save_sharded_job(rank: int, world: int, layout: str, uri: str, ref_path: str) -> None:
    """Train, save with bcp, write the full reference; then check that a same-layout
    reload continues training bitwise identically."""
    model, opt = sharded_model(world, layout)
    train(model, opt, range(3), rank)
    info = bcp.save(sharded_state(model, opt), uri)
    assert info.world_size == world and info.rank_bytes_written > 0, f"rank {rank} wrote nothing: {info}"
    ref = full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
    expected = train(model, opt, range(3, 6), rank)

    model2, opt2 = sharded_model(world, layout)
    state = sharded_state(model2, opt2)
    bcp.load(state, uri)
    restore(model2, opt2, state)
    assert_equal_to_reference(full_reference(model2, opt2), ref, f"rank {rank} same-layout reload")
    resumed = train(model2, opt2, range(3, 6), rank)
    assert resumed == expected, f"rank {rank}: losses after reload {resumed} != {expected}"


def load_sharded_job(rank: int, world: int, layout: str, uri: str, ref_path: str) -> None:
    """Load a checkpoint saved at another world size/layout; compare with the reference."""
    model, opt = sharded_model(world, layout)
    state = sharded_state(model, opt)
    bcp.load(state, uri)
    restore(model, opt, state)
    ref = torch.load(ref_path, weights_only=True)
    assert_equal_to_reference(full_reference(model, opt), ref, f"rank {rank} of {world} after reshard")
    train(model, opt, range(3, 4), rank)  # and it trains


# -- DDP (replicated) with per-rank dataloader state -----------------------------------


def ddp_save_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    train(ddp, opt, range(3), rank)
    sampler = ShardedSampler(64, rank, world, seed=3)
    sampler.take(5 + rank)  # ranks progress unevenly
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "loader": bcp.PerRank(sampler.state_dict()),
        "rng": bcp.PerRank(torch.get_rng_state()),
        "step": 3,
    }
    info = bcp.save(state, uri)
    share = info.rank_bytes_written / info.bytes_written
    assert abs(share - 1 / world) < 0.25, f"rank {rank} wrote {share:.2f} of the bytes (expected about 1/{world})"
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, ref_path)


def ddp_load_job(rank: int, world: int, uri: str, ref_path: str, saved_world: int) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "loader": None, "rng": None, "step": 0}
    if world != saved_world:
        try:
            bcp.load(state, uri)
        except bcp.UnsupportedStateError as e:
            assert "reshard_objects" in str(e) and "loader" in str(e)
        else:
            raise AssertionError("per-rank objects were silently given to a different world size")
    state = bcp.load(state, uri, reshard_objects=reshard_sampler_state)
    opt.load_state_dict(state["optim"])
    ref = torch.load(ref_path, weights_only=True)
    assert_equal_to_reference({"model": model.state_dict(), "optim": opt.state_dict()}, ref, f"DDP rank {rank}")
    assert state["step"] == 3
    if world == saved_world:
        assert state["loader"]["rank"] == rank, "same world size: each rank must get its own loader state"
    sampler = ShardedSampler(64, rank, world)
    sampler.load_state_dict(state["loader"])
    already = consumed_ids(state["loader"]) if world == saved_world else []
    everyone = [None] * world
    dist.all_gather_object(everyone, (already, sampler.take(1000)))
    seen = sorted(i for before, after in everyone for i in before + after)
    if world != saved_world:  # the consumed ids live in the saved states, not the new ones
        reader = bcp.open(uri)
        seen = sorted(seen + [i for st in reader.per_rank_objects("loader").values() for i in consumed_ids(st)])
    assert seen == list(range(64)), f"samples lost or repeated after {saved_world} -> {world} ranks: {seen}"


def shared_read_job(rank: int, world: int, uri: str, ref_path: str, share: bool) -> None:
    """Every rank loads full (replicated) tensors; with sharing, storage is read once."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "loader": None, "rng": None, "step": 0}
    info = bcp.load_with_info(state, uri, share_reads=share, reshard_objects=reshard_sampler_state)
    opt.load_state_dict(state["optim"])
    ref = torch.load(ref_path, weights_only=True)
    assert_equal_to_reference({"model": model.state_dict(), "optim": opt.state_dict()}, ref, f"shared-read rank {rank}")
    everyone = [None] * world
    dist.all_gather_object(everyone, info.bytes_read)
    total = bcp.open(uri).manifest.stats["tensor_bytes"]
    if share:
        assert sum(everyone) == total, f"with sharing, storage bytes {everyone} should add up to {total} once"
    else:
        assert everyone == [total] * world, f"without sharing every rank reads everything: {everyone}"


def failing_rank_job(rank: int, world: int, uri: str) -> None:
    """Rank 1's storage fails while writing: no commit, and every rank raises."""
    import os as _os

    state = {"w": bcp.TensorShard(torch.full((4, 3), float(rank)), (4 * world, 3), (4 * rank, 0)), "step": 1}
    real, real_v = _os.pwrite, _os.pwritev
    if rank == 1:  # every way the file backend writes (one buffer, or a sync save's batch of many)

        def broken(*_args):
            raise OSError(5, "Input/output error")

        _os.pwrite = _os.pwritev = broken
    try:
        bcp.save(state, uri)
    except Exception as e:  # noqa: BLE001 - each rank raises its own type; the message is checked
        message = str(e) + "".join(getattr(e, "__notes__", []))
        assert "rank 1" in message and "Input/output error" in message, f"rank {rank}: unclear error: {message}"
    else:
        raise AssertionError(f"rank {rank}: save succeeded although rank 1 failed")
    finally:
        _os.pwrite, _os.pwritev = real, real_v
    dist.barrier()
    assert not _os.path.exists(_os.path.join(uri, MANIFEST_KEY)), "a failed save committed"
    leftovers = [f for _d, _s, fs in _os.walk(uri) for f in fs]
    assert leftovers == [], f"failed save left files: {leftovers}"


def missing_rank_job(rank: int, world: int, uri: str) -> None:
    """Rank 1 never calls save: rank 0 must fail within the collective timeout, not hang."""
    import time as _time

    if rank == 0:
        started = _time.monotonic()
        try:
            bcp.save({"w": torch.zeros(3)}, uri)
        except Exception:  # noqa: BLE001 - gloo reports the timeout as a RuntimeError
            elapsed = _time.monotonic() - started
            assert elapsed < 60, f"took {elapsed:.0f} s to notice"
        else:
            raise AssertionError("save returned although rank 1 never joined")
        assert not os.path.exists(os.path.join(uri, MANIFEST_KEY))


def load_as_flat_shards_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """DTensor (FSDP2) checkpoint -> FlatShard templates (FSDP1 / ZeRO style)."""
    ref = torch.load(ref_path, weights_only=True)

    def flat(t: torch.Tensor):
        per = -(-t.numel() // world)
        start = min(rank * per, t.numel())
        n = max(0, min(per, t.numel() - start))
        return bcp.FlatShard(torch.zeros(n, dtype=t.dtype), tuple(t.shape), start), start, n

    state: dict = {"model": {}, "optim": {"state": {}, "param_groups": None}}
    expect = []
    for k, t in ref["model"].items():
        shard, start, n = flat(t)
        state["model"][k] = shard
        expect.append((shard, t.reshape(-1)[start : start + n]))
    for p, entry in ref["optim"]["state"].items():
        state["optim"]["state"][p] = {}
        for name, t in entry.items():
            shard, start, n = flat(t)
            state["optim"]["state"][p][name] = shard
            expect.append((shard, t.reshape(-1)[start : start + n]))
    bcp.load(state, uri)
    for shard, want in expect:
        assert torch.equal(shard.local, want), f"rank {rank}: flat shard at {shard.start} differs"
    assert state["optim"]["param_groups"] == ref["optim"]["param_groups"]


def async_ping_pong_job(rank: int, world: int, uri: str) -> None:
    """Two async saves in flight at once across ranks (they use the two group slots),
    each rank mutating its shard right after each call returns."""
    shard = torch.full((4, 8), float(rank))
    state = {"w": bcp.TensorShard(shard, (4 * world, 8), (4 * rank, 0)), "step": 1}
    first = bcp.async_save(state, f"{uri}/a")
    shard.add_(10)
    state["step"] = 2
    second = bcp.async_save(state, f"{uri}/b")
    shard.add_(10)
    third = bcp.async_save(state, f"{uri}/c")  # waits for the first (same slot)
    shard.fill_(-1)
    for handle in (first, second, third):
        info = handle.wait()
        assert info.world_size == world
    dist.barrier()
    for name, add, step in (("a", 0, 1), ("b", 10, 2), ("c", 20, 2)):
        reader = bcp.open(f"{uri}/{name}")
        expected = torch.cat([torch.full((4, 8), float(r + add)) for r in range(world)])
        assert torch.equal(reader.read("w"), expected), f"checkpoint {name} holds the wrong values"
        assert reader.read("step") == step


def manager_job(rank: int, world: int, root: str) -> None:
    """Two ranks save replicated state through one CheckpointManager; they agree on
    the steps and on what load_latest returns."""
    m = bcp.CheckpointManager(root, keep_last=2)
    for step in (10, 20, 30):
        m.save(step, {"w": torch.full((8,), float(step)), "rank_view": bcp.PerRank(rank)})
    m.wait()
    dist.barrier()
    steps = m.steps()
    everyone = [None] * world
    dist.all_gather_object(everyone, steps)
    assert all(s == [20, 30] for s in everyone), f"ranks disagree on the kept steps: {everyone}"
    step, out = m.load_latest({"w": torch.zeros(8), "rank_view": None})
    assert step == 30 and torch.equal(out["w"], torch.full((8,), 30.0)) and out["rank_view"] == rank


def errors_keep_type_job(rank: int, world: int, uri: str) -> None:
    """Errors travel between ranks with their type and fields: the coordinator's
    (a corrupt catalog) and one rank's own (a state mismatch on rank 1 only)."""
    bcp.save({"w": torch.arange(6.0)}, uri)
    dist.barrier()
    # 1. rank 1 alone asks for a key the checkpoint lacks: it raises its own error,
    #    the others a RankFailedError holding rank 1's error intact
    state = {"w": torch.zeros(6)} if rank == 0 else {"w": torch.zeros(6), "extra": torch.zeros(1)}
    try:
        bcp.load(state, uri)
    except bcp.StateMismatchError as e:
        assert rank == 1 and e.missing == ["extra"], f"rank {rank}: {e!r}"
    except bcp.RankFailedError as e:
        assert rank == 0, f"rank {rank}: {e!r}"
        assert isinstance(e.errors[1], bcp.StateMismatchError) and e.errors[1].missing == ["extra"], e.errors
    else:
        raise AssertionError(f"rank {rank}: load succeeded")
    dist.barrier()
    # 2. the coordinator finds the catalog damaged: every rank raises that error, with its fields
    if rank == 0:
        catalog = bcp.open(uri).manifest.catalog.path
        with open(os.path.join(uri, catalog), "r+b") as f:
            f.write(b"X")
    dist.barrier()
    try:
        bcp.load({"w": torch.zeros(6)}, uri)
    except bcp.CorruptCheckpointError as e:
        assert e.file is not None and e.file.endswith("fragments.arrow"), f"rank {rank}: {e.file}"
    else:
        raise AssertionError(f"rank {rank}: load of a damaged catalog succeeded")


def open_fails_on_one_rank_job(rank: int, world: int, uri: str) -> None:
    """Opening the reader fails on rank 1 alone (its backend, which in a local-tier
    recovery differs by host): every rank raises at once (rank 1 its own error, the
    others a RankFailedError holding it), none waits in a later phase for a rank that
    left (a short collective timeout makes such a wait fail instead of hang)."""
    import bcp.loader

    os.environ["BCP_COLLECTIVE_TIMEOUT"] = "20"  # before bcp's group exists (the save below makes it)
    bcp.save({"w": torch.arange(6.0)}, uri)
    dist.barrier()
    if rank == 1:

        def unreadable(*_args, **_kwargs):
            raise PermissionError("this host cannot open the checkpoint")

        bcp.loader.open_reader = unreadable  # this process only
    try:
        bcp.load({"w": torch.zeros(6)}, uri)
    except PermissionError as e:
        assert rank == 1 and "opening the checkpoint" in " ".join(getattr(e, "__notes__", [])), repr(e)
    except bcp.RankFailedError as e:
        assert rank == 0 and isinstance(e.errors[1], PermissionError), f"rank {rank}: {e!r}"
        assert "opening the checkpoint failed on 1 of 2 ranks" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: load succeeded")


# -- catalog v2 read in part (each rank fetches only its sections) ---------------------


def small_sections_save_job(rank: int, world: int, layout: str, uri: str, ref_path: str) -> None:
    """save_sharded_job with catalog sections of a single row minimum, so even this
    small checkpoint's catalog has several sections."""
    from bcp.metadata.catalog import sections

    sections.MIN_SECTION_ROWS = 1
    save_sharded_job(rank, world, layout, uri, ref_path)


def partial_catalog_load_job(rank: int, world: int, layout: str, uri: str, ref_path: str) -> None:
    """load_sharded_job with every catalog treated as large: the coordinator shares only
    the head, every rank reads its own sections (checked on the coordinator)."""
    import bcp.loader
    import bcp.reader

    bcp.reader.WHOLE_CATALOG_BYTES = 0
    seen: list[bool] = []
    fetch = bcp.reader.fetch_metadata

    def recording(backend, **kwargs):
        metadata = fetch(backend, **kwargs)
        seen.append(metadata.head_only)
        return metadata

    bcp.loader.fetch_metadata = recording
    load_sharded_job(rank, world, layout, uri, ref_path)
    if rank == 0:
        assert seen == [True], f"the coordinator should have read only the catalog's head: {seen}"


def malformed_share_part_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """The coordinator sends rank 1 a share_reads part of another version: every rank
    raises before any exchange (rank 1 its CheckpointError, the others RankFailedError)."""
    import dataclasses

    from bcp import shared_read

    parts_of = shared_read.SharePlan.parts

    def corrupt(self, world_size):
        parts = parts_of(self, world_size)
        parts[1] = dataclasses.replace(parts[1], version=99)
        return parts

    shared_read.SharePlan.parts = corrupt
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "loader": None, "rng": None, "step": 0}
    try:
        bcp.load(state, uri, share_reads=True, reshard_objects=reshard_sampler_state)
    except bcp.RankFailedError as e:
        assert rank != 1 and "checking the share_reads plan" in str(e) and "version 99" in str(e), (rank, e)
    except bcp.errors.CheckpointError as e:
        assert rank == 1 and "share_reads plan part for rank 1: version 99" in str(e), (rank, e)
    else:
        raise AssertionError(f"rank {rank} loaded with a malformed share_reads part")
    finally:
        shared_read.SharePlan.parts = parts_of


def strided_shard_job(rank: int, world: int, root: str) -> None:
    """A strided shard alone (hand-made) holds rows no one box describes: refused by save
    and load, naming the key; FSDP2's (a later Shard of the same dim) round-trips."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 makes these; no public name

    full = torch.arange(24.0).reshape(8, 3)
    alone = [_StridedShard(0, split_factor=2)]
    mesh = init_device_mesh("cpu", (world,))
    bcp.save({"w": full}, f"{root}/plain")
    for call in (
        lambda: bcp.save({"w": distribute_tensor(full, mesh, alone)}, f"{root}/alone"),
        lambda: bcp.load({"w": distribute_tensor(torch.zeros(8, 3), mesh, alone)}, f"{root}/plain"),
    ):
        try:
            call()
        except bcp.UnsupportedStateError as e:
            assert "'w'" in str(e) and "strided shard" in str(e), e
        else:
            raise AssertionError("a strided shard alone was taken as one box")
    mesh2 = init_device_mesh("cpu", (1, world))  # FSDP2 over TP: (_StridedShard(0, tp), Shard(0))
    fsdp_tp = [_StridedShard(0, split_factor=world), Shard(0)]
    bcp.save({"w": distribute_tensor(full, mesh2, fsdp_tp)}, f"{root}/fsdp_tp")
    assert torch.equal(bcp.open(f"{root}/fsdp_tp").read("w"), full)
    t = distribute_tensor(torch.zeros(8, 3), mesh2, fsdp_tp)
    bcp.load({"w": t}, f"{root}/plain")
    assert torch.equal(t.full_tensor(), full)
