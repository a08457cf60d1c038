"""The file backend's page-cache probe must not answer its own question: a probe that
reads the page it asks about made the next probe of the range say "cached", and a cold
load then read its ranges through the page cache instead of O_DIRECT. And a direct read
that fetches its unaligned head and tail around the middle still returns exactly the
file's bytes, short where the file ends."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcp.backends import backend_for, file_reads

SIZE = 8 << 20


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(SIZE))
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if file_reads.on_memory_fs(fd):
            pytest.skip("the test directory is on a memory filesystem: every page is cached")
    finally:
        os.close(fd)
    return path


PROBES = {
    "cachestat": file_reads.cached_share,
    "mincore": file_reads.cached_middle_page,
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_probe_of_a_cold_range_leaves_it_cold(cold_file: Path, name: str) -> None:
    probe = PROBES[name]
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        first = probe(fd, 0, SIZE)
        if first is None:
            pytest.skip(f"{name} is not available here")
        if first:
            pytest.skip("this filesystem kept the pages after POSIX_FADV_DONTNEED")
        assert [probe(fd, 0, SIZE) for _ in range(3)] == [False] * 3, f"{name} read the page it asked about"
        os.pread(fd, SIZE, 0)
        assert probe(fd, 0, SIZE) is True, f"{name} missed a range just read through the page cache"
    finally:
        os.close(fd)


def test_is_cached_twice_on_a_cold_range_says_no_twice(cold_file: Path) -> None:
    """The bug: the second probe answered yes because the first had read the page."""
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        if all(probe(fd, 0, SIZE) is None for probe in PROBES.values()):
            pytest.skip("no probe here that reads nothing")
        answers = [file_reads.is_cached(fd, str(cold_file), SIZE, 0) for _ in range(3)]
    finally:
        os.close(fd)
    if answers[0]:
        pytest.skip("this filesystem kept the pages after POSIX_FADV_DONTNEED")
    assert answers == [False, False, False]


def test_a_cold_large_read_goes_direct_after_probing(cold_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load probes a range (``in_memory``), then reads it: the read must still go O_DIRECT."""
    backend = backend_for(str(cold_file.parent))
    direct: list[int] = []
    real = file_reads.pread_direct

    def counting(path: str, view: memoryview, offset: int, like: int | None = None) -> int:
        direct.append(len(view))
        return real(path, view, offset, like)

    monkeypatch.setattr(file_reads, "pread_direct", counting)
    assert backend.in_memory(cold_file.name, 64, SIZE - 128) is False
    arena = mmap.mmap(-1, SIZE)
    target = memoryview(arena)[64 : SIZE - 64]
    assert backend.read_into(cold_file.name, 64, target) == SIZE - 128
    assert direct and sum(direct) >= SIZE - 2 * 4096, "a probed cold range was read through the page cache"
    assert bytes(target) == cold_file.read_bytes()[64 : SIZE - 64]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(0, SIZE - 1),
    phase=st.sampled_from([None, 0, 64, 4095]),
    length=st.integers(file_reads.DIRECT_READ_FROM, SIZE + 8192),
)
def test_direct_reads_with_edges_fetched_around_the_middle_return_the_files_bytes(
    cold_file: Path, offset: int, phase: int | None, length: int
) -> None:
    """``phase`` None: memory agrees with the file modulo 4096 (head, direct middle, tail);
    otherwise the memory's offset in a page, mostly disagreeing (bounced)."""
    backend = backend_for(str(cold_file.parent))
    data = cold_file.read_bytes()
    evict(cold_file)
    arena = mmap.mmap(-1, length + 8192)
    start = offset % 4096 if phase is None else phase
    target = memoryview(arena)[start : start + length]
    got = backend.read_into(cold_file.name, offset, target)
    assert got == min(length, SIZE - offset)
    assert bytes(target[:got]) == data[offset : offset + got]


@pytest.mark.parametrize("planted", ["fifo", "other file", "link"])
def test_a_reopen_for_a_direct_read_or_probe_is_the_file_opened(tmp_path: Path, monkeypatch, planted: str) -> None:
    """A direct read (and the last-resort probe) opens the path again: where another user
    swapped it since the first open (a FIFO, another file, a link), the reopen fails at
    once (ESTALE, ELOOP) instead of reading another file or waiting on a FIFO forever."""
    path = tmp_path / "data"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(mmap.mmap(-1, 8192))
        assert file_reads.pread_direct(str(path), view, 0, fd) == 8192 and bytes(view) == b"x" * 8192
        os.rename(path, tmp_path / "moved")
        if planted == "fifo":
            os.mkfifo(path)
        elif planted == "other file":
            path.write_bytes(b"y" * 8192)
        else:
            os.symlink(tmp_path / "moved", path)
        for read in (file_reads.pread_direct, file_reads.pread_bounced):
            with pytest.raises(OSError, match=r"replaced while being read|symbolic links|Too many levels") as caught:
                read(str(path), view, 0, fd)
            assert caught.value.errno in (errno.ESTALE, errno.ELOOP)
        monkeypatch.setattr(file_reads, "cached_share", lambda *a: None)
        monkeypatch.setattr(file_reads, "cached_middle_page", lambda *a: None)
        with pytest.raises(OSError, match=r"replaced while being read|symbolic links|Too many levels") as caught:
            file_reads.is_cached(fd, str(path), 8192, 0)
        assert caught.value.errno in (errno.ESTALE, errno.ELOOP)
    finally:
        os.close(fd)
