"""Rank bodies for tests/test_dtensor_boxes.py (spawned by dist_jobs.spawn)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from bcp import shards
from bcp.errors import UnsupportedStateError


def chunk_box(d) -> tuple:
    (chunk,) = d.__create_chunk_list__()
    return tuple(chunk.offsets), tuple(chunk.sizes)


def kept_boxes_job(rank: int, world: int) -> None:
    """Every (mesh, placements, shape) gets the box torch computes, on the first call and
    from the kept table after, for a detached copy (a new object: what model.state_dict()
    gives under FSDP2) and after a redistribution (new placements: its own box)."""
    shards._DTENSOR_BOXES.clear()
    meshes = [
        init_device_mesh("cpu", (world,)),
        init_device_mesh("cpu", (1, world)),
        init_device_mesh("cpu", (world, 1)),
    ]
    shapes = [(5, 3), (2, 7), (1, 1), (0, 4), (9, 2)]  # uneven and empty shards included
    for mesh, shape in itertools.product(meshes, shapes):
        options = [Shard(0), Shard(1), Replicate()]
        for placements in itertools.product(options, repeat=mesh.ndim):
            full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
            d = distribute_tensor(full, mesh, list(placements))
            want = chunk_box(d)
            for value in (d, d, d.detach()):  # computed, then kept, then a new object of the same spec
                got = shards.local_pieces(value, "w")
                assert got.pieces[0].box == want, (mesh, placements, shape, got.pieces[0].box, want)
                replica = any(p == Replicate() and mesh.size(i) > 1 for i, p in enumerate(placements))
                assert shards.holds_replica(value) is replica, (mesh, placements)
                local = got.pieces[0].tensor
                assert local.data_ptr() == d.to_local().data_ptr() or local.numel() == 0
                assert torch.equal(local, full[tuple(slice(o, o + n) for o, n in zip(*want, strict=True))])
    assert shards._DTENSOR_BOXES, "boxes were kept"
    # a kept box asks torch nothing (failed before: a chunk list at every call)
    d = distribute_tensor(torch.ones(6, 4), meshes[0], [Shard(0)])
    shards.local_pieces(d, "w")
    cls, calls = type(d), []
    real = cls.__create_chunk_list__
    cls.__create_chunk_list__ = lambda self: calls.append(1) or real(self)
    try:
        for value in (d, d.detach(), d.detach()):
            shards.local_pieces(value, "w")
    finally:
        cls.__create_chunk_list__ = real
    assert calls == []
    # the same DTensor after a redistribution: new placements, a box of their own
    mesh = meshes[0]
    d = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    assert shards.local_pieces(d, "w").pieces[0].box == chunk_box(d)
    moved = d.redistribute(mesh, [Shard(1)])
    assert shards.local_pieces(moved, "w").pieces[0].box == chunk_box(moved) != chunk_box(d)
    # a Partial placement is refused every time (never kept)
    partial = d.redistribute(mesh, [Replicate()])
    partial = type(partial).from_local(partial.to_local(), mesh, [Partial()], run_check=False)
    for _ in range(2):
        with pytest.raises(UnsupportedStateError, match="Partial placement"):
            shards.local_pieces(partial, "p")
    # the local tensor is the DTensor's own memory, with or without grad mode
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    local = shards.local_pieces(param, "p").pieces[0].tensor
    assert not local.requires_grad or local.grad_fn is None
    local.fill_(float(rank + 3))
    assert torch.equal(param.to_local(), torch.full_like(local, float(rank + 3)))


def flatten_dtensors_job(rank: int, world: int) -> None:
    """A str-keyed dict's DTensor values are leaves at once (failed before: each went
    through ``_walk``'s five checks), with the names, paths and values the walk gives;
    two entries flattening to one name are still refused."""
    from bcp import state

    mesh = init_device_mesh("cpu", (world,))
    d1, d2 = (distribute_tensor(torch.full((4, 2), float(i)), mesh, [Shard(0)]) for i in range(2))
    plain = torch.ones(3)
    tree = {"a": d1, "b": {"c": d2, "e": 3, "p": plain}, "f": plain}
    walked = []
    real = state._walk

    def counting(value, *args):
        walked.append(type(value))
        return real(value, *args)

    state._walk = counting
    try:
        leaves = state.flatten_state(tree)
    finally:
        state._walk = real
    assert type(d1) not in walked, walked
    assert sorted(leaves) == ["a", "b.c", "b.e", "b.p", "f"]
    assert leaves["b.e"].value == 3 and leaves["a"].path == (("d", "a"),)
    for f, value in (("a", d1), ("b.c", d2), ("b.p", plain), ("f", plain)):
        assert leaves[f].value is value
    assert leaves["b.c"].path == (("d", "b"), ("d", "c"))
    with pytest.raises(UnsupportedStateError, match=r"same key 'a\.b'"):
        state.flatten_state({"a": {"b": d1}, "a.b": d2})
