"""Coalesced reads: loading everything on one rank fetches runs that follow each other
in a data file with few large requests, not one request per fragment; the bytes,
values, verification and error messages stay as they were."""

from __future__ import annotations

import math
import uuid

import pytest
import torch

import bcp
import bcp.convert
from bcp.backends import backend_for
from bcp.backends.wrappers import FaultInjectingBackend
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec
from bcp.io_scheduler.read_exec import _Part, coalesce
from bcp.metadata import Fragment
from bcp.shards import TensorShard
from test_reshard_planner import simulated_save


class CountingBackend(FaultInjectingBackend):
    """Counts storage requests to data files (one read_exact is one request)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.requests = 0

    def read_exact(self, key, offset, buffer):
        if key.endswith(".bin"):
            self.requests += 1
        return super().read_exact(key, offset, buffer)


def fsdp_states(ranks: int, tensors: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    full = {f"w{i}": torch.randn(4 * ranks + i % 3, 5, generator=g) for i in range(tensors)}
    states = []
    for r in range(ranks):
        state = {}
        for name, t in full.items():
            rows = torch.tensor_split(torch.arange(t.shape[0]), ranks)[r]
            start = int(rows[0]) if len(rows) else t.shape[0]
            state[name] = TensorShard(t[start : start + len(rows)].clone(), tuple(t.shape), (start, 0))
        states.append(state)
    return states, full


@pytest.mark.parametrize("streams", [1, 4])
def test_full_load_of_an_fsdp_checkpoint_reads_each_file_in_one_request(streams, monkeypatch):
    ranks, tensors = 8, 20
    states, full = fsdp_states(ranks, tensors)
    uri = f"memory://coalesce-{uuid.uuid4().hex[:8]}/ck"
    simulated_save(states, uri)
    counting = CountingBackend(backend_for(uri))
    reader = bcp.open(counting)
    fragments = sum(len(reader.catalog.tensors[f].fragments) for f in reader.tensor_keys())
    assert fragments == ranks * tensors
    real = read_exec.execute_reads
    monkeypatch.setattr(read_exec, "execute_reads", lambda *a, **k: real(*a, **{**k, "streams": streams}), raising=True)
    monkeypatch.setattr("bcp.reader.execute_reads", read_exec.execute_reads)
    got = reader.read_tensors(reader.tensor_keys())
    for name, t in full.items():
        assert torch.equal(got[name], t), f"{name} loaded wrong values"
    files = len(reader.manifest.data_files)
    assert counting.requests == files, f"{counting.requests} requests for {files} data files ({fragments} fragments)"
    # the same through fill, with the statistics a load reports
    stats = reader.fill([(f, ((0, 0), tuple(t.shape)), torch.empty_like(t)) for f, t in full.items()])
    assert stats.requests == files and stats.bytes_read == sum(t.numel() * 4 for t in full.values())
    assert 0 < stats.padding_bytes < 64 * ranks * tensors, "only the writers' alignment padding is read besides"


def test_state_and_exports_coalesce(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {"layers": [{"w": torch.randn(33, 7, generator=g), "b": torch.randn(7, generator=g)} for _ in range(40)]}
    state["step"] = 4
    uri = f"memory://coalesce-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(state, uri)
    counting = CountingBackend(backend_for(uri))
    reader = bcp.open(counting)
    got = reader.state()
    assert got["step"] == 4
    for i, layer in enumerate(state["layers"]):
        assert torch.equal(got["layers"][i]["w"], layer["w"]) and torch.equal(got["layers"][i]["b"], layer["b"])
    per_tensor = len(reader.tensor_keys())
    assert counting.requests <= 2, f"state() issued {counting.requests} requests for {per_tensor} tensors in one file"
    counting.requests = 0
    bcp.convert.to_torch(reader, str(tmp_path / "out.pt"))
    assert counting.requests <= 2, f"to_torch issued {counting.requests} requests"
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(loaded["layers"][7]["w"], state["layers"][7]["w"])
    counting.requests = 0
    bcp.convert.to_safetensors(reader, str(tmp_path / "st"))
    assert counting.requests <= 2, f"to_safetensors issued {counting.requests} requests"


def test_a_truncated_file_still_names_the_tensor_it_cuts(tmp_path):
    g = torch.Generator().manual_seed(6)
    state = {f"t{i}": torch.randn(100, generator=g) for i in range(10)}
    uri = str(tmp_path / "ck")
    bcp.save(state, uri)
    reader = bcp.open(uri)
    frag = reader.catalog.tensors["t6"].fragments[0]
    path = tmp_path / "ck" / frag.file
    data = path.read_bytes()
    path.write_bytes(data[: frag.byte_offset + 10])
    reader = bcp.open(uri)
    reader._sizes_checked.update(f.path for f in reader.manifest.data_files)  # get past the size check
    with pytest.raises(CorruptCheckpointError, match=r"'t6'.*truncated"):
        reader.read_tensors(reader.tensor_keys())


def test_a_corrupt_fragment_in_a_coalesced_request_fails_its_checksum(tmp_path):
    g = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randn(100, generator=g) for i in range(10)}
    uri = str(tmp_path / "ck")
    bcp.save(state, uri)
    frag = bcp.open(uri).catalog.tensors["t3"].fragments[0]
    path = tmp_path / "ck" / frag.file
    data = bytearray(path.read_bytes())
    data[frag.byte_offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 't3'"):
        bcp.open(uri).state()


def _part(file: str, offset: int, n: int, *, start: int = 0, size: int | None = None) -> _Part:
    """A part of ``n`` bytes at ``offset`` in ``file``: bytes [start, start+n) of a
    fragment of ``size`` bytes (default: exactly the part)."""
    size = n + start if size is None else size
    frag = Fragment("t", "[]", "uint8", (1 << 40,), (0,), (size,), file, offset - start, size, (0,), 0)
    return _Part(frag, start, memoryview(bytearray(n)))


def test_coalesce_merges_only_small_parts_back_to_back_in_one_file_up_to_the_limit():
    parts = [_part("a", 0, 10), _part("a", 10, 10), _part("a", 25, 5), _part("b", 30, 5), _part("a", 20, 5)]
    parts += [_part("a", 30, 50), _part("a", 80, 10), _part("a", 90, 60)]
    requests = coalesce(parts, limit=60, below=40, padding=0)
    got = [(r.file, r.offset, r.nbytes, len(r.parts)) for r in requests]
    # a[0:30) merges (four parts, 30 bytes); a[30:80) is not small; a[80:90) alone
    # (a[90:150) is not small); b stays alone
    assert got == [("a", 0, 30, 4), ("a", 30, 50, 1), ("a", 80, 10, 1), ("a", 90, 60, 1), ("b", 30, 5, 1)]
    for r in requests:
        assert r.nbytes == sum(len(p.target) for p in r.parts) and (len(r.parts) == 1 or r.nbytes <= 60)
    many = [_part("c", i * 7, 7) for i in range(100)]
    sizes = [r.nbytes for r in coalesce(many, limit=64, below=40)]
    assert sum(sizes) == 700 and max(sizes) <= 64 and len(sizes) == math.ceil(700 / 63)


def test_coalesce_crosses_padding_only_between_whole_fragment_ends():
    # fragment ends at 10, the next starts at 16 (6 bytes of padding): joined
    got = coalesce([_part("a", 0, 10), _part("a", 16, 10)], limit=64, below=40, padding=8)
    assert [(r.offset, r.nbytes, r.at) for r in got] == [(0, 26, [0, 16])]
    # too much padding: two requests
    assert len(coalesce([_part("a", 0, 10), _part("a", 30, 10)], limit=64, below=40, padding=8)) == 2
    # a gap inside a fragment (a partial box's runs) is never read
    inside = [_part("a", 0, 4, start=0, size=40), _part("a", 8, 4, start=8, size=40)]
    assert len(coalesce(inside, limit=64, below=40, padding=8)) == 2
    # the first part does not end its fragment, or the second does not start its own
    assert len(coalesce([_part("a", 0, 10, size=12), _part("a", 16, 10)], limit=64, below=40, padding=8)) == 2
    assert len(coalesce([_part("a", 0, 10), _part("a", 16, 10, start=2)], limit=64, below=40, padding=8)) == 2
