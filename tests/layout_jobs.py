"""Multi-process jobs for tests/test_layout_grid.py: random layouts saved on N gloo
ranks and loaded on M, every kind of shard spec on both sides.

A case is plain data (picklable, drawn by hypothesis in the test process): a few
tensors, each with a global shape, a dtype and a layout for the save and one for the
load. Every rank can build the global tensor from the case, so each rank builds its
own share and checks what it loaded without talking to the others.

Layouts (``kind``, ``arg``):
    plain        the whole tensor on every rank (replicated)
    shard        a DTensor over a 1-D mesh of all ranks, Shard(arg)
    replicate    a DTensor over a 1-D mesh, Replicate()
    mesh2d       a DTensor over a 2-D mesh (world 4: 2x2; else 1 x world), arg is a
                 pair of placements, each a dim to shard on or None for Replicate
    box          a TensorShard: dim ``arg[0]`` cut at the points ``arg[1]``
    flat         a FlatShard: the flattening cut at the points ``arg``
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

import bcp
from helpers import tensor_bytes_equal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


class Layout(NamedTuple):
    kind: str
    arg: Any = None


class TensorCase(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    save: Layout
    load: Layout


class Case(NamedTuple):
    index: int
    save_world: int
    load_world: int
    tensors: tuple[TensorCase, ...]


def global_tensor(case: Case, t: TensorCase) -> torch.Tensor:
    """The global value of one tensor: distinct elements, different in every case."""
    n = math.prod(t.shape)
    values = torch.arange(n, dtype=torch.int64) * 7 + 1000 * case.index + 3
    return values.to(DTYPES[t.dtype]).reshape(t.shape)


_meshes: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _meshes:  # every rank builds the same meshes in the same order
        _meshes[shape] = init_device_mesh("cpu", shape)
    return _meshes[shape]


def mesh2d_shape(world: int) -> tuple[int, int]:
    return (2, 2) if world == 4 else (1, world)


def _placement(dim: int | None):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if dim is None else Shard(dim)


def _cut(size: int, points: tuple[int, ...], rank: int) -> tuple[int, int]:
    """The [start, stop) of piece ``rank`` when ``range(size)`` is cut at ``points``."""
    bounds = (0, *points, size)
    return bounds[rank], bounds[rank + 1]


def make_leaf(full: torch.Tensor, layout: Layout, rank: int, world: int) -> Any:
    """This rank's leaf for ``full`` in ``layout`` (a collective for DTensors)."""
    from torch.distributed.tensor import distribute_tensor

    if layout.kind == "plain":
        return full.clone()
    if layout.kind == "shard":
        return distribute_tensor(full, _mesh((world,)), [_placement(layout.arg)])
    if layout.kind == "replicate":
        return distribute_tensor(full, _mesh((world,)), [_placement(None)])
    if layout.kind == "mesh2d":
        return distribute_tensor(full, _mesh(mesh2d_shape(world)), [_placement(d) for d in layout.arg])
    if layout.kind == "box":
        dim, points = layout.arg
        start, stop = _cut(full.shape[dim], points, rank)
        offsets = tuple(start if d == dim else 0 for d in range(full.dim()))
        return bcp.TensorShard(full.narrow(dim, start, stop - start).clone(), full.shape, offsets)
    if layout.kind == "flat":
        start, stop = _cut(full.numel(), layout.arg, rank)
        return bcp.FlatShard(full.reshape(-1)[start:stop].clone(), full.shape, start)
    raise AssertionError(layout.kind)


def local_data(leaf: Any) -> torch.Tensor:
    """The memory a leaf holds on this rank."""
    from torch.distributed.tensor import DTensor

    if isinstance(leaf, DTensor):
        return leaf.to_local()
    if isinstance(leaf, (bcp.TensorShard, bcp.FlatShard)):
        return leaf.local
    return leaf


def save_cases(rank: int, world: int, cases: list[Case], root: str) -> None:
    for case in cases:
        if case.save_world != world:
            continue
        state = {t.name: make_leaf(global_tensor(case, t), t.save, rank, world) for t in case.tensors}
        bcp.save(state, f"{root}/case{case.index}")


def load_cases(rank: int, world: int, cases: list[Case], root: str) -> None:
    for case in cases:
        if case.load_world != world:
            continue
        template = {}
        expected = {}
        for t in case.tensors:
            full = global_tensor(case, t)
            expected[t.name] = local_data(make_leaf(full, t.load, rank, world))
            template[t.name] = make_leaf(torch.zeros_like(full), t.load, rank, world)
        loaded = bcp.load(template, f"{root}/case{case.index}")
        for t in case.tensors:
            got = local_data(loaded[t.name])
            assert got.shape == expected[t.name].shape, (case, t.name)
            assert tensor_bytes_equal(got, expected[t.name]), f"case {case.index} {t.name}: {t.save} -> {t.load}"


# -- FSDP2 saved, resumed tensor-parallel only -------------------------------------------

HIDDEN = 8


def _tp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, HIDDEN), torch.nn.LayerNorm(HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 6)
    )


def fsdp2_save_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """FSDP2 on every rank, a few AdamW steps, saved through get_state_dict; the full
    state as the reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dist_jobs

    model = _tp_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dist_jobs.train(model, opt, range(3), rank)
    bcp.save(dist_jobs.sharded_state(model, opt), uri)
    ref = dist_jobs.full_reference(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)


def tp_only_load_job(rank: int, world: int, uri: str, ref_path: str) -> None:
    """Tensor parallelism only: the linear layers are DTensors, the LayerNorm (replicated
    under TP) stays plain. Every tensor comes back exact, the plain ones whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import dist_jobs

    model = _tp_model()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "3": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():  # AdamW state for every parameter, to be overwritten by the load
        p.grad = torch.zeros_like(p)
    opt.step()
    state = dist_jobs.sharded_state(model, opt)
    plain = [k for k, v in dist_jobs.flatten_tensors(state).items() if not isinstance(v, DTensor) and v.dim() > 0]
    assert any(k.startswith("model.1.") for k in plain), plain  # the LayerNorm is plain beside DTensors
    state = bcp.load(state, uri)
    dist_jobs.restore(model, opt, state)
    ref = torch.load(ref_path, weights_only=True)
    got = dist_jobs.full_reference(model, opt)
    want_t, got_t = dist_jobs.flatten_tensors(ref), dist_jobs.flatten_tensors(got)
    assert set(want_t) == set(got_t) and len(want_t) > 8, sorted(got_t)
    for key, value in want_t.items():
        assert tensor_bytes_equal(got_t[key], value), key
