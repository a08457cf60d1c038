"""Partial loads read each data file's needed bytes in few requests (read_merge.py):
runs whose checksum blocks overlap or touch, or that lie less than the backend's
``read_gap_bytes`` apart, are one request; the bytes returned and the verification of
every byte stay as they were with one request per run."""

from __future__ import annotations

import dataclasses
import math
import re
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.wrappers import FaultInjectingBackend
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec
from bcp.io_scheduler.read_merge import Part, coalesce, needed
from bcp.metadata import Fragment
from conftest import new_bucket, store_uri
from test_memory_reads import corrupt


class Counting(FaultInjectingBackend):
    """Counts data-file requests; optionally says whether ranges are in memory and
    which gap the reads may cross (None: the wrapped backend's)."""

    def __init__(self, inner, *, resident: bool | None = None, gap: int | None = None):
        super().__init__(inner)
        self.requests = 0
        self.resident, self.gap = resident, gap

    @property
    def hints(self):
        hints = self.inner.hints
        return hints if self.gap is None else dataclasses.replace(hints, read_gap_bytes=self.gap)

    def in_memory(self, key, offset, nbytes):
        return self.inner.in_memory(key, offset, nbytes) if self.resident is None else self.resident

    def read_exact(self, key, offset, buffer):
        if key.endswith(".bin"):
            self.requests += 1
        return super().read_exact(key, offset, buffer)


def column_shard_requests(uri: str) -> int:
    emb = torch.randn(512, 256, generator=torch.Generator().manual_seed(5))
    bcp.save({"model": {"embed.weight": emb}}, uri)
    counting = Counting(backend_for(uri))
    local = torch.empty(512, 100)
    stats = bcp.open(counting).fill([("model.embed.weight", ((0, 156), (512, 100)), local)])
    assert torch.equal(local, emb[:, 156:]), "the column shard loaded wrong values"
    assert stats.bytes_read == 512 * 100 * 4
    return counting.requests


def test_a_column_shard_from_memory_is_one_request():
    requests = column_shard_requests(f"memory://gaps-{uuid.uuid4().hex[:8]}/ck")
    assert requests <= 2, f"{requests} requests for one column shard of a 512 KiB tensor"


@pytest.mark.parametrize("kind", ["moto"])
def test_a_column_shard_from_s3_is_one_request(kind, moto_server):
    uri = store_uri("s3", moto_server, new_bucket(moto_server), "ck")
    requests = column_shard_requests(uri)
    assert requests <= 2, f"{requests} ranged GETs for one column shard of a 512 KiB tensor (was 1024)"


real_coalesce = read_exec.coalesce


def unmerged(monkeypatch) -> None:
    """Requests as before read_merge: one per run, partial blocks completed afterwards."""
    real = read_exec.coalesce
    monkeypatch.setattr(read_exec, "coalesce", lambda parts, **k: real(parts, **{**k, "block": None, "gap": 0}))


@settings(deadline=None, max_examples=60)
@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    data=st.data(),
    block=st.sampled_from([4, 8, 16, 64, 256]),
    gap=st.sampled_from([0, 8, 100, 1 << 20]),
    resident=st.booleans(),
    streams=st.sampled_from([1, 3]),
    flip=st.one_of(st.none(), st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True))),
)
def test_merged_reads_return_the_same_bytes_and_verify_every_block(shape, data, block, gap, resident, streams, flip):
    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    lengths = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True)]
    box = (tuple(offsets), tuple(lengths))
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    uri = f"memory://gaps-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"t": full}, uri, checksum_block_bytes=block)
    frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
    mp = pytest.MonkeyPatch()
    try:
        real = read_exec.execute_reads
        mp.setattr("bcp.reader.execute_reads", lambda *a, **k: real(*a, **{**k, "streams": streams}))
        got = {}
        for merge in (False, True):
            if not merge:
                unmerged(mp)
            else:
                mp.setattr(read_exec, "coalesce", real_coalesce)
            counting = Counting(backend_for(uri), resident=resident, gap=gap)
            out = torch.full(tuple(lengths), -1.0)
            stats = bcp.open(counting).read_into("t", out, box=box)
            got[merge] = (out, counting.requests)
            assert stats.bytes_read == want.numel() * 4
        assert torch.equal(got[True][0], want) and torch.equal(got[False][0], want), "merged reads changed the bytes"
        assert got[True][1] <= got[False][1], f"merging made more requests: {got[True][1]} > {got[False][1]}"
        if flip is None:
            return
        # a byte flipped anywhere in a block the box touches fails the merged load, naming that block
        elems = [
            sum(i * s for i, s in zip(idx, full.stride(), strict=True))
            for idx in torch.cartesian_prod(*[torch.arange(o, o + n) for o, n in zip(offsets, lengths, strict=True)])
            .reshape(-1, len(shape))
            .tolist()
        ]
        touched = sorted({b for e in elems for b in (e * 4 // block, (e * 4 + 3) // block)})
        b = touched[int(flip[0] * len(touched))]
        lo, hi = b * block, min((b + 1) * block, frag.nbytes)
        corrupt(uri, frag.file, frag.byte_offset + lo + int(flip[1] * (hi - lo)))
        span = re.escape(f"[{frag.byte_offset + lo}, {frag.byte_offset + hi})")
        with pytest.raises(CorruptCheckpointError, match=rf"tensor 't'.*{span}"):
            bcp.open(Counting(backend_for(uri), resident=resident, gap=gap)).read_into("t", out, box=box)
    finally:
        mp.undo()


@settings(deadline=None, max_examples=200)
@given(
    runs=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 40)), min_size=1, max_size=12),
    size=st.integers(1, 500),
    at=st.integers(0, 1000),
    block=st.one_of(st.none(), st.sampled_from([1, 7, 16, 64, 1000])),
    gap=st.sampled_from([0, 5, 50]),
    limit=st.integers(8, 300),
)
def test_merged_requests_stay_inside_their_fragment_and_their_scratch_limit(runs, size, at, block, gap, limit):
    """Every request lies inside the fragment (so inside the file's declared size), holds
    each of its parts at ``at``, is at most ``limit`` bytes unless it is one part read
    bare, and covers every whole block its parts touch when it was widened to them."""
    frag = Fragment("t", "[]", "uint8", (1 << 40,), (0,), (size,), "f", at, size, (0,), 0)
    parts = []
    for start, n in runs:
        start = min(start, size - 1)
        parts.append(Part(frag, start, memoryview(bytearray(min(n, size - start)))))
    requests = coalesce(parts, limit=limit, below=limit, padding=0, block=block, gap=gap)
    assert sorted(id(p) for r in requests for p in r.parts) == sorted(id(p) for p in parts)
    for r in requests:
        assert at <= r.offset and r.offset + r.nbytes <= at + size, "a request reaches beyond its fragment"
        bare = len(r.parts) == 1 and r.nbytes == len(r.parts[0].target)
        assert r.nbytes <= limit or bare, f"a {r.nbytes}-byte request over the {limit}-byte scratch limit"
        assert r.extra >= 0 and r.gaps >= 0
        for p, where in zip(r.parts, r.at, strict=True):
            assert where == at + p.start - r.offset and where >= 0 and where + len(p.target) <= r.nbytes
            lo, hi = needed(p, block)
            assert (r.offset <= lo and hi <= r.offset + r.nbytes) or hi - lo > limit, "a part's blocks were cut"
