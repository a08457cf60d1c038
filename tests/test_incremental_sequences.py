"""Random sequences of incremental saves, deletions and gc (issue 39 item 7).

Each example saves a few steps of a state whose tensors are, per step, unchanged
(frozen), changed in a range of rows, or changed everywhere; each save's base is the
newest kept step (``bcp.save(..., base=)``). Between saves it deletes random kept steps
(``bcp.delete``: generations newer steps read stay retired) and runs gc. After every
operation every kept step must load to exactly the state saved at that step: whole
(``bcp.load``, world size 1), and as 2 and 3 ranks would load it, emulated in this
process: each rank's row shard loaded with ``bcp.TensorShard`` (the load path a rank
takes, ``strict=False``) and read as a box (``reader.read(fqn, box)``). Spawning ranks
per example would cost seconds each; tests/test_incremental_save.py and the manager's
tests load incremental checkpoints on real gloo ranks. Every kept step also verifies,
and after gc no generation is left that no committed step reads.
"""

from __future__ import annotations

import itertools
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for, join_uri
from bcp.conformance.checkpoint_contract import same_bytes
from bcp.discovery import list_checkpoints
from bcp.metadata.keys import split_parent, step_name
from bcp.retention import plan_gc, run_gc
from bcp.verify import verify_root

PIECE = 128  # bytes: 4 rows of the (., 8) float32 tensors, 8 rows of the bfloat16 one
SHAPES = {"frozen": ((24, 8), torch.float32), "emb": ((30, 8), torch.float32), "head": ((17, 8), torch.bfloat16)}

change = st.one_of(
    st.just(("same",)),
    st.just(("all",)),
    st.tuples(st.just("rows"), st.integers(0, 40), st.integers(1, 6)),
)
save_op = st.tuples(st.just("save"), st.fixed_dictionaries(dict.fromkeys(SHAPES, change)))
delete_op = st.tuples(st.just("delete"), st.integers(0, 10**6))
gc_op = st.just(("gc",))
sequence = st.lists(st.one_of(save_op, save_op, delete_op, gc_op), min_size=2, max_size=7)


def _changed(state: dict, how: dict, g: torch.Generator) -> dict:
    new = {k: v.clone() for k, v in state.items()}
    for name, c in how.items():
        t = new[name]
        if c[0] == "all":
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        elif c[0] == "rows":
            lo = c[1] % t.shape[0]
            hi = min(t.shape[0], lo + c[2])
            t[lo:hi] = torch.randn(hi - lo, t.shape[1], generator=g).to(t.dtype)
    return new


def _same(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert same_bytes(got, want), f"{where}: not the bytes saved"


def _check_step(uri: str, want: dict, step: int) -> None:
    got = bcp.load({k: torch.zeros_like(v) for k, v in want.items()} | {"step": None}, uri)
    assert got["step"] == step
    for k, v in want.items():
        _same(got[k], v, f"step {step} {k} (whole)")
    reader = bcp.open(uri)
    for world in (2, 3):
        for k, v in want.items():
            rows = v.shape[0]
            bounds = [rows * r // world for r in range(world + 1)]
            for lo, hi in itertools.pairwise(bounds):
                local = torch.zeros(hi - lo, v.shape[1], dtype=v.dtype)
                shard = bcp.TensorShard(local, offsets=(lo, 0), global_shape=tuple(v.shape))
                bcp.load({k: shard}, uri, strict=False)
                _same(local, v[lo:hi], f"step {step} {k} rows [{lo}, {hi}) of {world} ranks (load)")
                box = reader.read(k, ((lo, 0), (hi - lo, v.shape[1])))
                _same(box, v[lo:hi], f"step {step} {k} rows [{lo}, {hi}) of {world} ranks (box read)")
    reader.close()


@pytest.mark.slow  # about 3-6 s on 2 cores: out of the fast tier
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=sequence, seed=st.integers(0, 2**16))
def test_random_saves_deletions_and_gc_keep_every_step_exact(uri_factory, ops, seed):
    root = split_parent(uri_factory(f"run-{uuid.uuid4().hex[:8]}/x"))[0]
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in SHAPES.items()}
    kept: dict[int, dict] = {}  # step -> the state saved there
    step = 0
    for op in ops:
        if op[0] == "save":
            state = _changed(state, op[1], g) if kept or step else state
            base = {"base": join_uri(root, step_name(max(kept)))} if kept else {"incremental": True}
            bcp.save(state | {"step": step}, join_uri(root, step_name(step)), piece_bytes=PIECE, **base)
            kept[step] = {k: v.clone() for k, v in state.items()}
            step += 1
        elif op[0] == "delete" and kept:
            victim = sorted(kept)[op[1] % len(kept)]
            bcp.delete(join_uri(root, step_name(victim)))
            del kept[victim]
        elif op[0] == "gc":
            backend = backend_for(root)
            if list(backend.list("")):
                assert run_gc(backend, plan_gc(backend, grace_seconds=0)) == []
                listed = list_checkpoints(backend).checkpoints
                assert {c.step for c in listed if c.status == "committed"} == set(kept)
                left = [(c.path, c.status, c.held_by) for c in listed if c.status != "committed"]
                assert all(status == "retired" and held for _p, status, held in left), left
        for s, want in kept.items():
            _check_step(join_uri(root, step_name(s)), want, s)
        if kept:
            report = verify_root(root)
            assert report["ok"] and len(report["checkpoints"]) == len(kept), report["problems"]
