"""Random layouts saved on N gloo ranks and loaded on M (N, M in 1..4): DTensors
(Shard on any dim, Replicate, 2-D meshes), TensorShard, FlatShard and plain
replicated tensors, on the save side and in the template, mixed in one state.
Every rank's loaded bytes must equal its share of the original.

Processes are expensive here (2 cores), so hypothesis draws a batch of cases at a
time and the test runs them with one spawn per world size: at most 4 saving and 4
loading spawns per example, however many cases. The jobs are in tests/layout_jobs.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dist_jobs
import layout_jobs
from layout_jobs import Case, Layout, TensorCase

distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

#: batches per run; each runs up to 8 spawns (raise it locally for a longer search)
EXAMPLES = int(os.environ.get("BCP_LAYOUT_EXAMPLES", "1"))


@st.composite
def _points(draw, size: int, parts: int) -> tuple[int, ...]:
    """Cut points splitting range(size) into ``parts`` pieces (uneven, possibly empty)."""
    return tuple(sorted(draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1))))


@st.composite
def _layout(draw, shape: tuple[int, ...], world: int) -> Layout:
    kinds = ["plain", "replicate", "flat"]
    if shape:
        kinds += ["shard", "mesh2d", "box"]
    kind = draw(st.sampled_from(kinds))
    if kind == "shard":
        return Layout(kind, draw(st.integers(0, len(shape) - 1)))
    if kind == "mesh2d":
        dims = st.none() | st.integers(0, len(shape) - 1)
        return Layout(kind, (draw(dims), draw(dims)))
    if kind == "box":
        dim = draw(st.integers(0, len(shape) - 1))
        return Layout(kind, (dim, draw(_points(shape[dim], world))))
    if kind == "flat":
        numel = 1
        for n in shape:
            numel *= n
        return Layout(kind, draw(_points(numel, world)))
    return Layout(kind)


@st.composite
def _case(draw, index: int) -> Case:
    save_world, load_world = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    tensors = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
        tensors.append(
            TensorCase(
                name=f"t{i}",
                shape=shape,
                dtype=draw(st.sampled_from(sorted(layout_jobs.DTYPES))),
                save=draw(_layout(shape, save_world)),
                load=draw(_layout(shape, load_world)),
            )
        )
    return Case(index, save_world, load_world, tuple(tensors))


@st.composite
def _cases(draw) -> list[Case]:
    return [draw(_case(i)) for i in range(draw(st.integers(6, 10)))]


def _run(cases: list[Case], root: str) -> None:
    for world in sorted({c.save_world for c in cases}):
        dist_jobs.spawn(layout_jobs.save_cases, world, cases, root)
    for world in sorted({c.load_world for c in cases}):
        dist_jobs.spawn(layout_jobs.load_cases, world, cases, root)


@distributed
@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each try costs several spawns
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(cases=_cases())
def test_random_layouts_reshard_exactly_across_world_sizes(cases, tmp_path_factory):
    _run(cases, str(tmp_path_factory.mktemp("grid")))


@distributed
def test_every_layout_pair_on_a_fixed_grid(tmp_path):
    """Every save kind against every load kind once, 3 ranks -> 2 and 2 -> 4 (uneven
    cuts, an empty piece, a 2-D mesh), so each pair is covered on every run."""
    kinds = {
        3: [
            Layout("plain"),
            Layout("shard", 1),
            Layout("replicate"),
            Layout("mesh2d", (None, 0)),
            Layout("box", (0, (1, 1))),
            Layout("flat", (5, 17)),
        ],
        2: [
            Layout("plain"),
            Layout("shard", 0),
            Layout("replicate"),
            Layout("mesh2d", (1, None)),
            Layout("box", (1, (2,))),
            Layout("flat", (11,)),
        ],
        4: [
            Layout("plain"),
            Layout("shard", 1),
            Layout("replicate"),
            Layout("mesh2d", (0, 1)),
            Layout("box", (0, (0, 2, 3))),
            Layout("flat", (3, 3, 20)),
        ],
    }
    cases = []
    for save_world, load_world in ((3, 2), (2, 4)):
        tensors = []
        for i, s in enumerate(kinds[save_world]):
            for j, load in enumerate(kinds[load_world]):
                tensors.append(TensorCase(f"t{i}_{j}", (4, 6), "float32", s, load))
        cases.append(Case(len(cases), save_world, load_world, tuple(tensors)))
    _run(cases, str(tmp_path))


@distributed
def test_fsdp2_checkpoint_resumes_tensor_parallel_only(tmp_path):
    """Replicated under TP, the LayerNorm's tensors are plain beside DTensors in the
    template: loaded whole and exact, as DCP does (the old guard refused them)."""
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(layout_jobs.fsdp2_save_job, 2, uri, ref)
    dist_jobs.spawn(layout_jobs.tp_only_load_job, 2, uri, ref)
