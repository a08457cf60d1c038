"""bcp.integrations.dcp: DCP's own checkpoint format written and read through bcp's
backends (file, memory://, S3 on moto), with CRC32C verified on read and ``.metadata``
committed last, create-only."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from bcp.backends import IOHints, backend_for
from bcp.backends.memory import MemoryBackend, clear_memory_store
from bcp.errors import CheckpointExistsError, PickleNotAllowedError
from bcp.integrations.dcp import CHECKSUMS_KEY, METADATA_KEY, BcpStorageReader, BcpStorageWriter
from bcp.integrations.dcp_storage import ObjectStream
from bcp.metadata.checksum import crc32c
from conftest import new_bucket, store_uri
from dcp_storage_jobs import async_process_job, round_trip_job
from dist_jobs import spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 33, generator=g),
        "ids": torch.arange(100, dtype=torch.int64),
        "nested": {"half": torch.randn(7, generator=g).to(torch.bfloat16), "flag": torch.tensor([True, False])},
        "step": 12,
        "note": "text",
    }


def zeros_like_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = zeros_like_state(v)
        else:
            out[k] = None
    return out


def assert_same(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == got[k].dtype and torch.equal(got[k], v), f"{where}: {k}"
        elif isinstance(v, dict):
            assert_same(got[k], v, where)
        else:
            assert got[k] == v, f"{where}: {k}: {got[k]!r} != {v!r}"


def save(state: dict, uri: str, **kw) -> None:
    dcp.save(state, storage_writer=BcpStorageWriter(uri, **kw))


def load(uri: str, like: dict, **kw) -> dict:
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=BcpStorageReader(uri, **kw))
    return out


# -- one process, no process group ----------------------------------------------------------------


def test_round_trip_without_a_process_group(uri):
    state = sample_state()
    save(state, uri)
    assert_same(load(uri, state), state, uri)
    backend = backend_for(uri)
    names = set(backend.list())
    assert {METADATA_KEY, CHECKSUMS_KEY} <= names and any(n.endswith(".distcp") for n in names), names


def test_dcps_own_reader_loads_it_from_a_directory(tmp_path):
    state = sample_state()
    save(state, str(tmp_path / "c"), thread_count=2)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert_same(out, state, "FileSystemReader")


def test_a_checkpoint_dcps_writer_wrote_reads_with_verify_false_only(tmp_path):
    state = sample_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")))
    assert_same(load(str(tmp_path / "c"), state, verify=False), state, "verify=False")
    with pytest.raises(CheckpointException, match=r"\.bcp-checksums\.json does not exist"):
        load(str(tmp_path / "c"), state)


def test_async_save_through_the_writer(uri):
    state = sample_state()
    dcp.async_save(state, storage_writer=BcpStorageWriter(uri)).result()
    assert_same(load(uri, state), state, "async_save")


def test_large_tensor_is_written_in_parts_and_the_file_checksummed_whole(tmp_path):
    state = {"big": torch.randn(3_000_000)}  # 12 MB: two 8 MiB parts on the file backend
    save(state, str(tmp_path / "c"))
    assert_same(load(str(tmp_path / "c"), state), state, "big")
    sidecar = json.loads((tmp_path / "c" / CHECKSUMS_KEY).read_text())
    ((name, entry),) = sidecar["files"].items()
    assert entry["size"] == (tmp_path / "c" / name).stat().st_size > 12_000_000
    assert sum(length for _, length, _ in entry["segments"]) == entry["size"]


# -- corruption, kills, overwrites ---------------------------------------------------------------


def flip_byte(uri: str, key: str, offset: int) -> None:
    backend = backend_for(uri)
    data = bytearray(backend.read(key))
    data[offset] ^= 0x40
    backend.write(key, bytes(data))


def test_a_corrupted_data_byte_is_detected_naming_the_file(uri):
    state = sample_state()
    save(state, uri)
    sidecar = json.loads(backend_for(uri).read(CHECKSUMS_KEY))
    ((name, entry),) = sidecar["files"].items()
    offset, length, _crc = max(entry["segments"], key=lambda s: s[1])  # inside the largest tensor
    flip_byte(uri, name, offset + length // 2)
    with pytest.raises(CheckpointException) as caught:
        load(uri, state)
    text = str(caught.value)
    assert "CorruptCheckpointError" in text and name in text and f"bytes {offset}..{offset + length}" in text


def test_a_corrupted_metadata_byte_is_detected(uri):
    state = sample_state()
    save(state, uri)
    flip_byte(uri, METADATA_KEY, 40)
    with pytest.raises(CheckpointException, match=r"\.metadata: \d+ bytes with CRC32C"):
        load(uri, state)


def test_metadata_naming_other_globals_is_refused_unless_allow_pickle(tmp_path):
    uri = str(tmp_path / "c")
    save(sample_state(), uri)
    backend_for(uri).write(METADATA_KEY, pickle.dumps(print))  # what a crafted .metadata would do
    with pytest.raises(PickleNotAllowedError, match=r"builtins\.print"):
        BcpStorageReader(uri, verify=False).read_metadata()


def test_existing_checkpoint_is_refused_unless_overwrite(uri):
    first, second = sample_state(), {"w": torch.ones(5)}
    save(first, uri)
    with pytest.raises(CheckpointException) as caught:
        save(second, uri)
    assert CheckpointExistsError.__name__ in str(caught.value) and "overwrite=True" in str(caught.value)
    assert_same(load(uri, first), first, "the first save is intact")
    save(second, uri, overwrite=True)
    assert_same(load(uri, second), second, "overwritten")


KILLED_SAVE = """
import os, signal, sys, torch, torch.distributed.checkpoint as dcp
from bcp.integrations.dcp import BcpStorageWriter

class Killed(BcpStorageWriter):
    def finish(self, metadata, results):
        os.kill(os.getpid(), signal.SIGKILL)  # every data file is written and committed

dcp.save({"w": torch.randn(100, 10), "step": 3}, storage_writer=Killed(sys.argv[1]))
"""


def test_a_save_killed_before_finish_leaves_no_loadable_checkpoint(tmp_path):
    uri = str(tmp_path / "c")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE), uri], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    names = set(backend_for(uri).list())
    assert any(n.endswith(".distcp") for n in names) and METADATA_KEY not in names, names
    like = {"w": torch.zeros(100, 10), "step": None}
    with pytest.raises(CheckpointException, match=r"\.metadata does not exist"):
        dcp.load(like, storage_reader=BcpStorageReader(uri))
    with pytest.raises(CheckpointException):
        dcp.load(like, storage_reader=dcp.FileSystemReader(uri))
    save({"w": torch.ones(100, 10), "step": 4}, uri)  # the URI is free for the next save
    assert load(uri, {"w": torch.ones(100, 10), "step": 4})["step"] == 4


# -- FSDP2 over gloo ranks ---------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "world"), [("file", 1), ("file", 2), ("memory", 1)])
def test_fsdp_state_round_trips_bit_exact(tmp_path, backend, world):
    if backend == "file":
        uri = dcp_dir = str(tmp_path / "c")
    else:  # memory:// is per process: one rank saves and loads
        uri, dcp_dir = f"memory://dcp-{tmp_path.name}/c", None
    spawn(round_trip_job, world, uri, dcp_dir)


@pytest.mark.slow
def test_fsdp_state_round_trips_through_s3(moto_server):
    uri = store_uri("moto", moto_server, new_bucket(moto_server), "run/step-3")
    spawn(round_trip_job, 2, uri, None)
    names = set(backend_for(uri).list())
    assert {METADATA_KEY, CHECKSUMS_KEY, "__0_0.distcp", "__1_0.distcp"} <= names, names


class EightByteParts(MemoryBackend):
    """memory://, with 8-byte parts and parallel writes; records every write_at."""

    calls: list[tuple[int, int]]

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=8, concurrency=3)

    def open_writer(self, key, *, size=None):
        writer = super().open_writer(key, size=size)
        write_at = writer.write_at

        def recorded(offset, data):
            self.calls.append((offset, len(data)))
            write_at(offset, data)

        writer.write_at = recorded
        return writer


@given(sizes=st.lists(st.integers(0, 30), max_size=12))
@settings(deadline=None)
def test_object_stream_cuts_parts_and_segments_wherever_writes_and_tells_fall(sizes):
    """Whole 8-byte parts but the last, segments between tells, and the object's bytes
    and CRC32C exactly what was written, whatever the sizes of the writes."""
    backend = EightByteParts.from_uri(f"memory://stream-{uuid.uuid4().hex[:8]}/x")
    backend.calls = []
    data = bytes((i * 7) % 251 for i in range(sum(sizes)))
    got: list = []
    stream = ObjectStream(backend, "obj", got.append)
    start = 0
    for n in sizes:
        stream.write(data[start : start + n])
        stream.tell()
        start += n
    stream.close()
    assert backend.read("obj") == data
    ((key, size, crc, segments),) = got
    assert (key, size, crc) == ("obj", len(data), crc32c(data))
    assert [length for _, length, _ in segments] == [n for n in sizes if n]
    assert all(crc32c(data[o : o + n]) == c for o, n, c in segments)
    calls = sorted(backend.calls)
    assert all(offset % 8 == 0 and n == 8 for offset, n in calls[:-1]), calls
    assert sum(n for _, n in calls) == len(data)
    clear_memory_store(backend.root.split("/")[0])


def test_async_save_in_process_mode_pickles_the_writer(tmp_path):
    """The writer crosses to DCP's checkpointing process: what it holds open is made again there."""
    spawn(async_process_job, 1, str(tmp_path / "c"))
    assert (tmp_path / "c" / CHECKSUMS_KEY).exists()
