"""Multi-process jobs for tests/test_replica_check.py: ranks whose copies of a
replicated tensor differ are refused before anything is written. Started with
dist_jobs.spawn; every job asserts inside the workers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import bcp
from bcp.metadata import MANIFEST_KEY
from bcp.replicas import SMALL_REPLICA_BYTES


def _refused(state: dict, uri: str, **options) -> bcp.ReplicaMismatchError:
    """The save must fail on this rank with ReplicaMismatchError; returns it."""
    try:
        bcp.save(state, uri, **options)
    except bcp.ReplicaMismatchError as e:
        return e
    raise AssertionError(f"rank {dist.get_rank()}: the save to {uri} was not refused")


def _no_manifest(uri: str) -> None:
    dist.barrier()  # the coordinator has cleaned up on every path before anyone looks
    assert not os.path.exists(os.path.join(uri, MANIFEST_KEY)), f"{uri} was committed"


def two_ranks_job(rank: int, world: int, root: str) -> None:
    torch.manual_seed(rank)  # each rank its own generator, as in a real job
    nan = torch.full((3,), float("nan"))
    good = {
        "w": torch.arange(6.0),
        "nan": nan,  # equal bytes on every rank: not a difference
        "rng": bcp.PerRank(torch.get_rng_state()),  # differs per rank, saved per rank
        "shard": bcp.TensorShard(torch.full((2,), float(rank)), (2 * world,), (2 * rank,)),
        "step": 7,
    }
    first = f"{root}/first"
    bcp.save(good, first)
    committed = bcp.open(first).manifest.save_id
    got = bcp.load({"w": torch.zeros(6), "nan": torch.zeros(3), "rng": None, "shard": good["shard"], "step": 0}, first)
    assert torch.equal(got["rng"], torch.get_rng_state()), "PerRank gives each rank its own generator"

    # the user's report: a per-rank plain tensor and a bare RNG state
    bad = {
        "w": torch.arange(6.0),
        "x": torch.full((4,), float(rank)),
        "rng": torch.get_rng_state(),
        "step": 7,
    }
    e = _refused(bad, f"{root}/bad")
    assert e.differing == {"x": {0: [1]}, "rng": {0: [1]}}, e.differing
    msg = str(e)
    assert "'x' (rank 1 differs from rank 0)" in msg and "'rng' (rank 1 differs from rank 0)" in msg, msg
    assert "bcp.PerRank" in msg and "DTensor" in msg and "'w'" not in msg, msg
    _no_manifest(f"{root}/bad")

    # an overwrite that is refused leaves the committed checkpoint as it was
    e = _refused(bad, first, overwrite=True)
    assert set(e.differing) == {"x", "rng"}
    dist.barrier()
    again = bcp.load(
        {"w": torch.zeros(6), "nan": torch.zeros(3), "rng": None, "shard": good["shard"], "step": 0}, first
    )
    assert torch.equal(again["w"], torch.arange(6.0)) and torch.equal(again["rng"], got["rng"])
    assert bcp.open(first).manifest.save_id == committed

    # the same layout twice: the second save takes the cached plan, and still compares
    same = {"w": torch.arange(6.0), "x": torch.zeros(4), "rng": torch.zeros(5056, dtype=torch.uint8)}
    bcp.save(same, f"{root}/cached-ok")
    e = _refused(dict(same, x=torch.full((4,), float(rank))), f"{root}/cached-bad")
    assert e.differing == {"x": {0: [1]}}, e.differing
    _no_manifest(f"{root}/cached-bad")

    # NaNs compare by bytes: equal payloads pass (above), different payloads differ
    payload = torch.full((3,), float("nan")).view(torch.int32)
    payload[0] += rank
    e = _refused({"nan": payload.view(torch.float32)}, f"{root}/nan-bits")
    assert e.differing == {"nan": {0: [1]}}

    # a non-contiguous view is compared by its logical row-major bytes
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t() if rank == 0 else base.t().contiguous()
    bcp.save({"v": view}, f"{root}/strided")

    # above the default size: not checked unless asked; "off" checks nothing
    big = torch.full((SMALL_REPLICA_BYTES // 4 + 1,), float(rank))
    bcp.save({"big": big}, f"{root}/big-default")
    e = _refused({"big": big}, f"{root}/big-all", check_replicas="all")
    assert e.differing == {"big": {0: [1]}}
    _no_manifest(f"{root}/big-all")
    bcp.save(bad, f"{root}/off", check_replicas="off")

    # async_save refuses at the call: its checksums are of the values at the call
    x = torch.full((4,), float(rank))
    with pytest.raises(bcp.ReplicaMismatchError) as refused:
        bcp.async_save({"x": x}, f"{root}/async")
    assert refused.value.differing == {"x": {0: [1]}}
    _no_manifest(f"{root}/async")
    handle = bcp.async_save({"x": torch.zeros(4)}, f"{root}/async-ok")
    handle.wait()


def four_ranks_job(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # ranks 0 and 1 agree; 2 and 3 each differ from them; eleven keys differ
    value = float(max(rank, 1))
    bad = {f"k{i:02d}": torch.full((2,), value + i) for i in range(11)}
    bad["same"] = torch.ones(3)
    e = _refused(bad, f"{root}/many")
    msg = str(e)
    assert len(e.differing) == 11 and all(v == {0: [2, 3]} for v in e.differing.values()), e.differing
    assert "'k00' (ranks 2, 3 differ from rank 0)" in msg and ", and 3 more." in msg, msg
    assert sum(f"'k{i:02d}'" in msg for i in range(11)) == 8, "at most 8 keys listed"
    _no_manifest(f"{root}/many")

    # 2-D mesh: replicated over "dp", sharded over "tp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(8.0).reshape(4, 2)
    hsdp = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    sharded = distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])
    sharded.to_local().add_(100 * rank)  # each rank its own rows: nothing is replicated
    bcp.save({"hsdp": hsdp, "sharded": sharded}, f"{root}/dtensor-ok", check_replicas="all")
    if mesh.get_coordinate()[0] == 1:  # the second replica of each tp shard drifts
        hsdp.to_local().add_(1)
    e = _refused({"hsdp": hsdp, "sharded": sharded}, f"{root}/dtensor-bad")
    # mesh (dp, tp): rank = 2 * dp + tp; the tp shard 0 lives on ranks 0 and 2, shard 1 on 1 and 3
    assert e.differing == {"hsdp": {0: [2], 1: [3]}}, e.differing
    assert "rank 2 differs from rank 0; rank 3 differs from rank 1" in str(e), str(e)
    _no_manifest(f"{root}/dtensor-bad")


def clashing_keys_job(rank: int, world: int, root: str) -> None:
    """Ranks whose states give two entries one place: refused on every rank, naming the
    keys and ranks, before anything is written; then the same root saves and loads.
    Failed before: these saves committed a checkpoint every load refused (and
    CheckpointManager's retention then deleted the good ones)."""
    full = {"w": torch.arange(4.0), "b": torch.ones(2)}
    cases = {
        "empty": (full, {}),  # torch's full_state_dict=True: the state on rank 0, {} elsewhere
        "none": (full, None),
        "nested": ({"state": full}, {"state": {}}),
        "same_key": (full, {"w": None, "b": torch.ones(2)}),
    }
    for name, (first, other) in cases.items():
        uri = os.path.join(root, name)
        with pytest.raises(bcp.UnsupportedStateError, match=r"give two entries one place: 'model\.") as raised:
            bcp.save({"model": first if rank == 0 else other, "step": 7}, uri)
        assert "rank(s) [0]" in str(raised.value) and "rank(s) [1]" in str(raised.value), str(raised.value)
        _no_manifest(uri)
    # a kept plan (the same layouts on every rank as a good save) with an object that now clashes
    uri = os.path.join(root, "kept-then-clash")
    bcp.save({"model": full, "step": 7} if rank == 0 else {"step": 7}, uri)
    with pytest.raises(bcp.UnsupportedStateError, match=r"'model\.w' is a tensor on rank\(s\) \[0\] inside 'model'"):
        bcp.save({"model": full if rank == 0 else {}, "step": 7}, uri, overwrite=True)
    assert bcp.open(uri).read("model.w").equal(full["w"])  # the good one stays
    # the legitimate neighbours: a top-level key with dots beside the tensors, saved twice (the kept plan)
    uri = os.path.join(root, "kept")
    for _ in range(2):
        bcp.save({"model": full, "step": 7, "model.w.note": 1}, uri, overwrite=True)
    out = bcp.load({"model": {"w": torch.zeros(4), "b": torch.zeros(2)}, "step": None, "model.w.note": None}, uri)
    assert torch.equal(out["model"]["w"], full["w"]) and out["step"] == 7
