"""Reads of bytes already in memory (the page cache, tmpfs): in pieces of
read_exec.IN_MEMORY_CHUNK, each checksum block verified as soon as the piece holding
it lands. The values, the verification of every byte read and the errors that name
the corrupt block stay as they were."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for, file_reads
from bcp.backends import file as file_backend
from bcp.backends.storage_errors import StorageError
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec
from recording_backend import Recording as Resident


def with_streams(monkeypatch, streams: int) -> None:
    real = read_exec.execute_reads
    monkeypatch.setattr("bcp.reader.execute_reads", lambda *a, **k: real(*a, **{**k, "streams": streams}))


def corrupt(uri: str, file: str, at: int) -> None:
    backend = backend_for(uri)
    data = bytearray(backend.read(file))
    data[at] ^= 0x5A
    backend.write(file, bytes(data))


@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 24),
    box=st.tuples(st.integers(0, 39), st.integers(1, 40), st.integers(0, 23), st.integers(1, 24)),
    block=st.sampled_from([4, 16, 64, 128, 256]),
    chunk_blocks=st.integers(1, 5),
    streams=st.sampled_from([1, 3]),
    bad=st.one_of(st.none(), st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True))),
)
def test_a_box_read_from_memory_verifies_every_block_it_touches(rows, cols, box, block, chunk_blocks, streams, bad):
    """Any byte of any block a box touches, corrupted, fails the load naming that
    block; uncorrupted, the box loads its values; no read from memory is larger than
    a chunk."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(read_exec, "IN_MEMORY_CHUNK", chunk_blocks * block)
        with_streams(mp, streams)
        r0, c0 = min(box[0], rows - 1), min(box[2], cols - 1)
        nr, nc = min(box[1], rows - r0), min(box[3], cols - c0)
        t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        uri = f"memory://mem-reads-{uuid.uuid4().hex[:8]}/ck"
        bcp.save({"t": t}, uri, checksum_block_bytes=block)
        frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
        touched = sorted(
            {
                b
                for r in range(r0, r0 + nr)
                for b in range((r * cols + c0) * 4 // block, ((r * cols + c0 + nc) * 4 - 1) // block + 1)
            }
        )
        if bad is not None:
            b = touched[int(bad[0] * len(touched))]
            b_lo, b_hi = b * block, min((b + 1) * block, frag.nbytes)
            corrupt(uri, frag.file, frag.byte_offset + b_lo + int(bad[1] * (b_hi - b_lo)))
        backend = Resident(backend_for(uri))
        reader = bcp.open(backend)
        out = torch.empty(nr, nc)
        if bad is None:
            stats = reader.read_into("t", out, box=((r0, c0), (nr, nc)))
            assert torch.equal(out, t[r0 : r0 + nr, c0 : c0 + nc])
            assert stats.bytes_read == nr * nc * 4
        else:
            span = rf"\[{frag.byte_offset + b_lo}, {frag.byte_offset + b_hi}\)"
            with pytest.raises(CorruptCheckpointError, match=span):
                reader.read_into("t", out, box=((r0, c0), (nr, nc)))
        chunk = chunk_blocks * block
        assert all(n <= max(chunk, nc * 4) for _k, _o, n in backend.data_reads), (backend.data_reads, chunk)
    finally:
        mp.undo()


@pytest.mark.parametrize("resident", [True, False])
def test_memory_reads_go_in_chunks_and_storage_reads_whole(resident, monkeypatch):
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
    t = torch.randn(64, 256)  # 64 KiB: 16 chunks
    uri = f"memory://mem-chunks-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"t": t}, uri, checksum_block_bytes=1024)
    backend = Resident(backend_for(uri), resident)
    got = bcp.open(backend).read("t")
    assert torch.equal(got, t)
    sizes = sorted(n for _k, _o, n in backend.data_reads)
    assert sizes == ([4096] * 16 if resident else [t.numel() * 4]), sizes


@pytest.mark.parametrize("streams", [1, 4])
def test_small_tensors_found_in_memory_are_read_in_place_not_through_scratch(streams, monkeypatch):
    """Parts that a coalesced request would read into scratch memory and copy are read
    straight into place when the request is in memory (and large enough per part);
    every block is still checked, and a corrupt one is named."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
    monkeypatch.setattr(read_exec, "IN_PLACE_FROM_MEMORY", 4096)
    with_streams(monkeypatch, streams)
    g = torch.Generator().manual_seed(11)
    state = {f"t{i}": torch.randn(1024 + 64 * i, generator=g) for i in range(6)}  # 4-5.3 KiB each
    uri = f"memory://mem-inplace-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(state, uri, checksum_block_bytes=1024)
    backend = Resident(backend_for(uri))
    got = bcp.open(backend).read_tensors(list(state))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert len(backend.data_reads) > len(state), "each tensor read in place, in chunks"
    assert max(n for _k, _o, n in backend.data_reads) <= 4096
    coalesced = Resident(backend_for(uri), resident=False)
    bcp.open(coalesced).read_tensors(list(state))
    assert len(coalesced.data_reads) == 1, "from storage: one request for the whole file"
    frag = bcp.open(uri).catalog.tensors["t3"].fragments[0]
    corrupt(uri, frag.file, frag.byte_offset + 4100)
    start = frag.byte_offset + 4096
    with pytest.raises(CorruptCheckpointError, match=rf"'t3'.*\[{start}, {frag.byte_offset + frag.nbytes}\)"):
        bcp.open(Resident(backend_for(uri))).read_tensors(list(state))


def test_a_corrupt_block_in_the_middle_of_a_memory_read_names_it(monkeypatch):
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 8192)
    t = torch.randn(32, 256)
    uri = f"memory://mem-corrupt-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"t": t}, uri, checksum_block_bytes=2048)
    frag = bcp.open(uri).catalog.tensors["t"].fragments[0]
    corrupt(uri, frag.file, frag.byte_offset + 5 * 2048 + 7)
    start = frag.byte_offset + 5 * 2048
    with pytest.raises(CorruptCheckpointError, match=rf"'t'.*\[{start}, {start + 2048}\)"):
        bcp.load({"t": torch.empty_like(t)}, Resident(backend_for(uri)))


def _tmpfs_dir() -> str | None:
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == "/dev/shm" and parts[2] == "tmpfs" and os.access("/dev/shm", os.W_OK):
                return "/dev/shm"
    return None


@pytest.mark.skipif(_tmpfs_dir() is None, reason="needs a writable tmpfs at /dev/shm")
def test_a_load_from_tmpfs_reads_from_memory_without_probing(monkeypatch):
    def no_probe(*_a):
        raise AssertionError("probed the page cache of a tmpfs file")

    monkeypatch.setattr(file_backend, "is_cached", no_probe)
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 1 << 16)
    uri = os.path.join("/dev/shm", f"bcp-test-{uuid.uuid4().hex[:8]}")
    try:
        state = {"a": torch.randn(1 << 20), "b": torch.randn(3, 5)}  # a: 4 MiB, read with O_DIRECT from a disk
        bcp.save(state, uri)
        backend = Resident(backend_for(uri))
        backend.in_memory = backend.inner.in_memory  # the file backend decides
        out = {k: torch.empty_like(v) for k, v in state.items()}
        bcp.load(out, backend)
        assert all(torch.equal(out[k], state[k]) for k in state)
        assert max(n for _k, _o, n in backend.data_reads) == 1 << 16, "a tmpfs file is read in chunks"
        assert backend_for(uri).in_memory("no/such/file", 0, 10) is False, "advice, not an error"
        fd = os.open(os.path.join(uri, "manifest.json"), os.O_RDONLY)
        try:
            assert file_reads.on_memory_fs(fd)
            view = memoryview(bytearray(5 << 20))
            assert backend_for(uri).read_into("manifest.json", 0, view) == os.fstat(fd).st_size
        finally:
            os.close(fd)
        frag = bcp.open(uri).catalog.tensors["a"].fragments[0]
        corrupt(uri, frag.file, frag.byte_offset + (3 << 20) + 1)
        with pytest.raises(CorruptCheckpointError, match="'a'"):
            bcp.load(out, uri)
    finally:
        import shutil

        shutil.rmtree(uri, ignore_errors=True)


def test_a_regular_file_is_not_on_a_memory_filesystem_unless_it_is(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        fs_type = file_reads.fs_type(fd)
        assert file_reads.on_memory_fs(fd) == (fs_type in file_reads.MEMORY_FS_TYPES)
        assert fs_type is not None, "fstatfs answers on Linux"
    finally:
        os.close(fd)


def test_the_quick_read_path_still_refuses_links_and_bad_keys(tmp_path):
    """Reads skip the lstat of the file itself (O_NOFOLLOW refuses a link there) and
    remember key checks: a link is still refused with the same error, a bad key still
    fails every time, and in_memory says False for either."""
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "real.bin").write_bytes(b"x" * 100)
    (tmp_path / "secret").write_bytes(b"s" * 100)
    (root / "d" / "link.bin").symlink_to(tmp_path / "secret")
    backend = backend_for(str(root))
    buf = memoryview(bytearray(10))
    assert backend.read_into("d/real.bin", 0, buf) == 10 and bytes(buf) == b"x" * 10
    for _ in range(2):
        with pytest.raises(StorageError, match="symbolic link"):
            backend.read_into("d/link.bin", 0, buf)
        with pytest.raises(ValueError, match="invalid object key"):
            backend.read_into("d/../secret", 0, buf)
    assert bytes(buf) == b"x" * 10, "nothing was read through the link"
    assert backend.in_memory("d/link.bin", 0, 10) is False
    assert backend.in_memory("d/../secret", 0, 10) is False


def test_reads_from_memory_use_no_more_threads_than_cpus(monkeypatch):
    monkeypatch.setattr(read_exec, "usable_cpus", lambda: 2)
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
    real_coalesce = read_exec.coalesce
    monkeypatch.setattr(read_exec, "coalesce", lambda parts, **k: real_coalesce(parts, **k, below=0))  # 1 per tensor
    monkeypatch.setattr(read_exec, "MAX_PADDING", 0)  # and the bulk path (execute_whole_reads) batches none
    with_streams(monkeypatch, 6)
    g = torch.Generator().manual_seed(12)
    state = {f"t{i}": torch.randn(4096, generator=g) for i in range(12)}
    uri = f"memory://mem-threads-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(state, uri, checksum_block_bytes=4096)
    seen: dict[bool, set[str]] = {}
    for resident in (True, False):
        backend = Resident(backend_for(uri), resident, latency=0.005)  # slow reads: every thread gets work
        real = backend.read_exact
        names: set[str] = set()

        def recording(key, offset, buffer, real=real, names=names):
            names.add(threading.current_thread().name)
            return real(key, offset, buffer)

        backend.read_exact = recording
        got = bcp.open(backend).read_tensors(list(state))
        assert all(torch.equal(got[k], v) for k, v in state.items())
        seen[resident] = names
    assert len(seen[True]) == 2 and len(seen[False]) > 2, seen
    assert all(n.startswith("bcp-reader") for n in seen[True] | seen[False])


@pytest.mark.parametrize("streams", [1, 2])
def test_small_whole_tensors_from_memory_cost_one_read_and_one_crc_each(streams, monkeypatch):
    """Tensors of one checksum block each, found in memory, are read in place with one
    read and one CRC call apiece, with no per-tensor wrapper (``_read``: a trace span
    and a context manager, thousands of them in a load of many tensors); a corrupt one
    is still named by tensor, file and byte range, and a file cut short by tensor."""
    monkeypatch.setattr(read_exec, "IN_PLACE_FROM_MEMORY", 1024)
    with_streams(monkeypatch, streams)
    wrapped = []
    real_read = read_exec._read
    monkeypatch.setattr(read_exec, "_read", lambda *a, **k: wrapped.append(a[1].fqn) or real_read(*a, **k))
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(256 + 16 * i, generator=g) for i in range(12)}  # 1-1.7 KiB, one block each
    uri = f"memory://mem-small-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(state, uri, checksum_block_bytes=4096)
    got = bcp.open(Resident(backend_for(uri))).read_tensors(list(state))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert wrapped == [], f"per-tensor read wrapper called for {wrapped}"
    frag = bcp.open(uri).catalog.tensors["t7"].fragments[0]
    corrupt(uri, frag.file, frag.byte_offset + 9)
    end = frag.byte_offset + frag.nbytes
    with pytest.raises(CorruptCheckpointError, match=rf"'t7': file '{frag.file}' .*\[{frag.byte_offset}, {end}\)"):
        bcp.open(Resident(backend_for(uri))).read_tensors(list(state))

    class EndsInsideT7(Resident):
        """The file found at its declared size, then ending inside t7 when read."""

        def read_exact(self, key, offset, buffer):
            if key == frag.file and offset == frag.byte_offset:
                raise EOFError(f"{key!r} ended at byte {offset + 5}")
            super().read_exact(key, offset, buffer)

    reader = bcp.open(EndsInsideT7(backend_for(uri)))
    with pytest.raises(CorruptCheckpointError, match=r"'t7'.*truncated") as info:
        reader.read_tensors(list(state))
    assert info.value.fqn == "t7" and info.value.file == frag.file and info.value.offset == frag.byte_offset
