"""Resharding at the planner level: simulated ranks, no process group.

Random global shapes (0-4 dims, size-0 and size-1 dims), dtypes, save layouts over N
ranks (grid boxes, flat ranges, replication, uneven splits) and load layouts over M
ranks. Every loaded element must equal the original, and the data bytes read must
equal the bytes needed exactly (checksum verification reads are counted apart and
stay inside the checksum blocks the data touched).
"""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.commit import commit, write_catalog
from bcp.errors import ShardingError
from bcp.metadata import Catalog
from bcp.metadata.keys import catalog_key, data_file_key, generation_name
from bcp.planning import plan_save
from bcp.saver import _decide_objects, build_manifest, prepare_save
from bcp.shards import FlatShard, TensorShard, local_pieces
from helpers import examples, tensor_bytes_equal, write_rank_data

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.complex64, torch.bool, torch.float64]


def simulated_save(states: list[dict], uri: str, block: int = 64):
    """What bcp.save does across ranks, with the collectives replaced by lists."""
    backend = backend_for(uri)
    prepared = [prepare_save(s, r, False) for r, s in enumerate(states)]
    layouts = [p.layout for p in prepared]
    plan = plan_save(layouts)
    objects = _decide_objects([p.objects for p in prepared])
    save_id = uuid.uuid4().hex[:16]
    gen = generation_name(save_id)
    frags, files = [], []
    for r, p in enumerate(prepared):
        boxes = layouts[r].boxes()
        items = [p.pieces[boxes[i]] for i in plan.writes[r].tolist()]
        report = write_rank_data(backend, data_file_key(gen, r), r, items, block)
        frags += report.fragments
        files += [report.file] if report.file else []
    catalog = write_catalog(backend, catalog_key(gen), Catalog(frags))
    options = bcp.SaveOptions(checksum_block_bytes=block)
    commit(
        backend, build_manifest(save_id, catalog, frags, tuple(files), objects, len(states), options), overwrite=False
    )
    return plan


@st.composite
def cuts(draw, n: int, parts: int) -> list[int]:
    """Sorted cut points splitting range(n) into `parts` (possibly empty, uneven) pieces."""
    inner = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    return [0, *inner, n]


@st.composite
def layout(draw, shape: tuple[int, ...], ranks: int):
    """One shard spec per simulated rank: ('full',), ('flat', start, n) or ('box', (off, lens)).
    Grid layouts give one rank per cell plus replica ranks, so the rank count may exceed ``ranks``."""
    kind = draw(st.sampled_from(["replicated", "grid", "flat"] if shape else ["replicated"]))
    if kind == "replicated":
        return [("full",)] * ranks
    if kind == "flat":
        c = draw(cuts(math.prod(shape), ranks))
        return [("flat", c[r], c[r + 1] - c[r]) for r in range(ranks)]
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2, unique=True))
    splits = {d: draw(cuts(shape[d], draw(st.integers(1, 3)))) for d in dims}
    cells = [((), ())]
    for d in range(len(shape)):
        c = splits.get(d, [0, shape[d]])
        cells = [((*o, c[i]), (*n, c[i + 1] - c[i])) for o, n in cells for i in range(len(c) - 1)]
    specs = [("box", cell) for cell in cells]
    replicas = draw(st.lists(st.sampled_from(specs), max_size=2))
    return specs + replicas


def materialize(spec, full: torch.Tensor, *, zero: bool):
    """Build the shard object for `spec` over `full` (a copy; zeroed for templates)."""
    src = torch.zeros_like(full) if zero else full
    if spec[0] == "full":
        return src.clone()
    if spec[0] == "flat":
        _k, start, n = spec
        return FlatShard(src.reshape(-1)[start : start + n].clone(), tuple(full.shape), start)
    _k, (off, lens) = spec
    region = tuple(slice(o, o + n) for o, n in zip(off, lens, strict=True))
    return TensorShard(src[region].clone(), tuple(full.shape), off)


def expected_box(full: torch.Tensor, box) -> torch.Tensor:
    off, lens = box
    return full[tuple(slice(o, o + n) for o, n in zip(off, lens, strict=True))]


@settings(max_examples=examples(int(__import__("os").environ.get("BCP_RESHARD_EXAMPLES", "200"))))
@given(
    shape=st.lists(st.sampled_from([0, 1, 2, 3, 5, 8]), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
    n_save=st.integers(1, 4),
    n_load=st.integers(1, 4),
    verify=st.booleans(),
    data=st.data(),
)
def test_any_layout_to_any_layout(shape, dtype, n_save, n_load, verify, data):
    numel = math.prod(shape)
    raw = (
        torch.arange(numel * dtype.itemsize, dtype=torch.int64)
        .remainder(2 if dtype == torch.bool else 251)
        .to(torch.uint8)
    )
    full = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    uri = f"memory://plan-{uuid.uuid4().hex[:8]}/ck"
    save_layout = data.draw(layout(shape, n_save), label="save layout")
    simulated_save([{"t": materialize(spec, full, zero=False), "step": 3} for spec in save_layout], uri)

    reader = bcp.open(uri, verify=verify)
    assert reader.meta("t").shape == torch.Size(shape) and reader.read_object("step") == 3
    for spec in data.draw(layout(shape, n_load), label="load layout"):
        target = materialize(spec, full, zero=True)
        _shape, _dtype, pieces, _rep = local_pieces(target, "t")
        requests = [("t", p.box, p.tensor) for p in pieces]
        stats = reader.fill(requests)
        needed = sum(math.prod(b[1]) for _f, b, _t in requests) * dtype.itemsize
        assert stats.bytes_read == needed, f"read {stats.bytes_read} data bytes for {needed} needed"
        assert stats.verify_bytes == 0 or verify, "verification reads with verify off"
        for p in pieces:
            assert tensor_bytes_equal(p.tensor, expected_box(full, p.box)), f"box {p.box} loaded wrong values"


def test_verification_reads_only_inside_touched_blocks():
    """A box in the middle of a big fragment: data read exactly, plus at most the rest
    of the two checksum blocks at its edges."""
    full = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    uri = f"memory://plan-{uuid.uuid4().hex[:8]}/ck"
    block = 64 << 10
    simulated_save([{"t": full}], uri, block=block)
    reader = bcp.open(uri)
    dest = torch.zeros(100, 1024)
    stats = reader.fill([("t", ((300, 0), (100, 1024)), dest)])
    assert torch.equal(dest, full[300:400])
    assert stats.bytes_read == 100 * 1024 * 4 and stats.requests == 1, "one contiguous run expected"
    assert 0 < stats.verify_bytes <= 2 * block


def test_corruption_inside_a_partly_read_block_is_caught():
    full = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    uri = f"memory://plan-{uuid.uuid4().hex[:8]}/ck"
    simulated_save([{"t": full}], uri, block=4096)
    backend = backend_for(uri)
    frag = bcp.open(uri).meta("t").fragments[0]
    data = bytearray(backend.read(frag.file))
    data[frag.byte_offset + 4096 + 8] ^= 0xFF  # row 16, outside the rows we ask for but in their block
    backend.write(frag.file, bytes(data))
    with pytest.raises(bcp.CorruptCheckpointError, match=r"tensor 't'.*bytes \[4096, 8192\)"):
        bcp.open(uri).fill([("t", ((17, 0), (2, 64)), torch.zeros(2, 64))])
    # with verification off the rows we asked for are returned untouched
    dest = torch.zeros(2, 64)
    bcp.open(uri, verify=False).fill([("t", ((17, 0), (2, 64)), dest)])
    assert torch.equal(dest, full[17:19])


def test_replicated_boxes_are_balanced_over_ranks():
    """DDP-like: 4 ranks hold every tensor; each writes about a quarter."""
    tensors = {f"w{i}": torch.zeros(1000 + 37 * i) for i in range(40)}
    plan = simulated_save([dict(tensors) for _ in range(4)], f"memory://plan-{uuid.uuid4().hex[:8]}/ck")
    loads = list(plan.bytes_per_rank.values())
    biggest = max(t.numel() * 4 for t in tensors.values())
    assert max(loads) - min(loads) <= biggest, f"unbalanced: {loads}"
    assert sum(loads) == sum(t.numel() * 4 for t in tensors.values()), "replicas written more than once"


def _plan_of(*rank_states):
    """The plan and, per rank, the (fqn, box) pairs it writes."""
    layouts = [prepare_save(s, r, False).layout for r, s in enumerate(rank_states)]
    plan = plan_save(layouts)
    return plan, {r: [layouts[r].boxes()[i] for i in idx.tolist()] for r, idx in plan.writes.items()}


def test_overlapping_shards_are_refused_naming_the_tensor():
    full = torch.zeros(10, 4)
    with pytest.raises(ShardingError, match=r"tensor 'w'.*overlap"):
        _plan_of({"w": TensorShard(full[:6], (10, 4), (0, 0))}, {"w": TensorShard(full[4:], (10, 4), (4, 0))})


def test_gaps_are_refused_naming_the_tensor():
    full = torch.zeros(10, 4)
    with pytest.raises(ShardingError, match=r"tensor 'w'.*cover 32 of its 40"):
        _plan_of({"w": TensorShard(full[:5], (10, 4), (0, 0))}, {"w": TensorShard(full[7:], (10, 4), (7, 0))})


def test_ranks_disagreeing_on_shape_or_dtype_are_refused():
    with pytest.raises(ShardingError, match=r"tensor 'w': rank 0 has float32\[4\] but rank 1 has float32\[5\]"):
        _plan_of({"w": torch.zeros(4)}, {"w": torch.zeros(5)})
    with pytest.raises(ShardingError, match="bfloat16"):
        _plan_of({"w": torch.zeros(4)}, {"w": torch.zeros(4, dtype=torch.bfloat16)})


def test_tied_weights_across_ranks_are_written_once():
    w = torch.randn(64, 8)
    plan, writes = _plan_of({"emb": w, "head": w}, {"emb": w, "head": w})
    assert plan.total_bytes == w.numel() * 4
    owner = [r for r, items in writes.items() if ("emb", ((0, 0), (64, 8))) in items]
    assert len(owner) == 1, "the target written more than once"
    assert ("head", ((0, 0), (64, 8))) in writes[owner[0]], "alias not placed with its target"


def test_per_rank_and_differing_objects_are_stored_per_rank():
    from bcp.shards import PerRank

    states = [{"w": torch.zeros(2), "same": 1, "differs": r, "marked": PerRank(7)} for r in range(3)]
    objects = _decide_objects([prepare_save(s, r, False).objects for r, s in enumerate(states)])
    assert [e.rank for e in objects["same"]] == [None]
    assert [(e.rank, e.value) for e in objects["differs"]] == [(0, 0), (1, 1), (2, 2)]
    assert [e.rank for e in objects["marked"]] == [0, 1, 2]
