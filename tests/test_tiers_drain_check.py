"""A drain uploads only bytes it checked as it uploaded them: a local data file that
changed after its save (a bit flip in /dev/shm, another process writing to it) is not
committed to the persistent root, whose older steps stay; each uploaded part is summed
from the very bytes uploaded, so a change between a check and the copy is caught too."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import bcp.tiers.tier as tier_module
from bcp.metadata import FileEntry
from bcp.tiers.holding import StreamedDigest, file_digest
from helpers import examples, flip_bit


def test_a_local_file_changed_since_its_save_is_not_drained(tmp_path, monkeypatch):
    """Step 2's local data file changes after the save checked it, before its drain:
    the drain fails naming the file and commits nothing; persistent step 1 stays, and a
    start that lost the local tier loads it exactly."""
    shm, root = tmp_path / "shm", tmp_path / "root"
    real = tier_module.drain_step

    def changed_then_drained(coord, local, remote, manifest, *args, **kwargs):
        if remote.uri.rstrip("/").endswith("step_0000000002"):
            (data,) = glob.glob(os.path.join(local.uri.removeprefix("file://"), "gen-*", "data", "*.bin"))
            flip_bit(data, 100)
        return real(coord, local, remote, manifest, *args, **kwargs)

    monkeypatch.setattr(tier_module, "drain_step", changed_then_drained)

    def manager() -> bcp.CheckpointManager:
        tier = bcp.LocalTier(dir=str(shm), keep_free=0.0, persist_every=1, keep=2, replicas=0)
        return bcp.CheckpointManager(str(root), async_save=False, keep_last=1, tier=tier)

    m = manager()
    m.save(0, {"w": torch.full((1000,), 0.0)})
    m.save(1, {"w": torch.full((1000,), 1.0)})
    with pytest.raises(bcp.CorruptCheckpointError, match=r"local copy of 'gen-\w+/data/rank00000-0\.bin' .*digest"):
        m.save(2, {"w": torch.full((1000,), 2.0)})
    m.close()
    assert m.steps() == [1]
    shutil.rmtree(shm)  # the host is lost: only the persistent root is left
    step, state = manager().load_latest({"w": torch.zeros(1000)})
    assert step == 1 and torch.equal(state["w"], torch.full((1000,), 1.0))


@st.composite
def _files(draw):
    """A file's bytes, its fragments (sorted, apart, some with gaps), a block size, a
    part size and the order the parts are read in."""
    size = draw(st.integers(0, 300))
    cuts = sorted(draw(st.sets(st.integers(0, size), max_size=10)))
    spans = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
    data = draw(st.binary(min_size=size, max_size=size))
    part = draw(st.integers(1, 64))
    order = draw(st.permutations(list(range(0, size, part))))
    return data, spans, draw(st.sampled_from([1, 5, 16, 64])), part, order


@settings(max_examples=examples(300), deadline=None)
@given(_files(), st.data())
def test_parts_in_any_order_give_the_files_digest_and_a_changed_byte_is_caught(tmp_path_factory, case, data):
    raw, spans, block, part, order = case
    path = tmp_path_factory.mktemp("f") / "data.bin"
    path.write_bytes(raw)
    size, digest = file_digest(str(path), spans, block)
    entry = FileEntry("data.bin", size, digest)

    def fed(parts: dict[int, bytes]) -> StreamedDigest:
        summed = StreamedDigest(spans, block)
        for offset in order:
            summed.feed(offset, parts.get(offset, raw[offset : offset + part]), lambda at, n: raw[at : at + n])
        return summed

    assert fed({}).problem(entry) is None
    if spans:
        start, n = data.draw(st.sampled_from(spans))
        at = data.draw(st.integers(start, start + n - 1))
        offset = at // part * part  # one part read a changed byte; every other read saw the saved bytes
        changed = bytearray(raw[offset : offset + part])
        changed[at - offset] ^= 1
        assert fed({offset: bytes(changed)}).problem(entry) is not None


def test_a_fragment_no_part_covered_is_a_problem():
    summed = StreamedDigest([(0, 10), (20, 10)], 4)
    summed.feed(0, bytes(16), lambda at, n: bytes(n))
    assert summed.problem(FileEntry("f", 30, 0)) == "part of its fragments was never read"
