"""FileBackend: the shared object contract, plus what only a filesystem can get wrong
(partial files, emptied directories, path and URI forms, OS error wrapping)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp.backends.file as file_mod
from bcp.backends import Backend, ObjectNotFoundError, StorageError, WriterClosedError, backend_for
from bcp.backends.file import PARTIAL_MARKER, FileBackend
from bcp.conformance import BackendContractTests
from helpers import examples


def _object_path(backend: FileBackend, key: str) -> str:
    return os.path.join(backend.root, *key.split("/"))


def _all_files(root: str | Path) -> list[str]:
    """Every file name under ``root``, partial ones included (list() hides those)."""
    return [name for _dir, _dirs, files in os.walk(root) for name in files]


class TestFileBackendContract(BackendContractTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Backend]:
        b = backend_for(str(tmp_path / "store"))
        assert isinstance(b, FileBackend)
        yield b
        b.close()

    def raw_put(self, backend: Backend, key: str, data: bytes) -> None:
        path = _object_path(backend, key)  # type: ignore[arg-type]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def raw_get(self, backend: Backend, key: str) -> bytes:
        with open(_object_path(backend, key), "rb") as f:  # type: ignore[arg-type]
            return f.read()


class TestFileBackendNoFsyncContract(TestFileBackendContract):
    """``fsync=false`` skips every fsync; the contract (apart from durability) must hold."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Backend]:
        b = backend_for(f"file://{tmp_path}/store?fsync=false")
        assert isinstance(b, FileBackend) and b.fsync is False
        yield b
        b.close()


@pytest.fixture
def fb(tmp_path: Path) -> FileBackend:
    b = backend_for(str(tmp_path / "store"))
    assert isinstance(b, FileBackend)
    return b


# -- partial files ---------------------------------------------------------------------


def test_partial_file_left_by_crash_is_not_listed(fb: FileBackend) -> None:
    fb.write("ckpt/real", b"x")
    # A writer killed before commit leaves its partial file behind.
    Path(_object_path(fb, "ckpt/data")).with_name(f"data{PARTIAL_MARKER}deadbeef0000").write_bytes(b"half")
    assert sorted(fb.list("")) == ["ckpt/real"], "a partial file left by a crashed writer was listed"


def test_partial_file_alone_in_directory_is_not_listed(fb: FileBackend) -> None:
    os.makedirs(_object_path(fb, "lonely"))
    Path(_object_path(fb, "lonely/x")).with_name(f"x{PARTIAL_MARKER}0123456789ab").write_bytes(b"")
    assert list(fb.list("lonely/")) == [], "a partial file was listed under its directory prefix"


def test_partial_file_does_not_exist_as_object(fb: FileBackend) -> None:
    Path(fb.root).mkdir(parents=True)
    Path(fb.root, f"k{PARTIAL_MARKER}0123456789ab").write_bytes(b"half")
    assert not fb.exists("k"), "a partial file made its target key exist"


def test_key_with_partial_marker_is_rejected(fb: FileBackend) -> None:
    with pytest.raises(ValueError, match="reserved"):
        fb.write(f"a{PARTIAL_MARKER}x", b"")


def test_open_writer_is_a_partial_file(fb: FileBackend) -> None:
    with fb.open_writer("k", size=3) as w:
        w.write_at(0, b"abc")
        names = _all_files(fb.root)
        assert len(names) == 1 and PARTIAL_MARKER in names[0], f"an open writer should hold one partial file: {names}"
        w.abort()


def test_no_partial_file_after_commit(fb: FileBackend) -> None:
    with fb.open_writer("d/k", size=3) as w:
        w.write_at(0, b"abc")
        w.commit()
    assert _all_files(fb.root) == ["k"], "a partial file remained after commit"


def test_no_partial_file_after_abort(fb: FileBackend) -> None:
    w = fb.open_writer("d/k", size=3)
    w.write_at(0, b"abc")
    w.abort()
    assert _all_files(fb.root) == [], "a partial file remained after abort"


def test_failed_commit_removes_the_partial_file_and_closes_the_writer(
    fb: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fb.write("k", b"old")
    w = fb.open_writer("k", size=3)
    w.write_at(0, b"new")

    def failing_rename(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(StorageError, match="committing 'k'"):
        w.commit()
    monkeypatch.undo()
    assert _all_files(fb.root) == ["k"] and fb.read("k") == b"old", "a failed commit left a partial file or lost 'k'"
    with pytest.raises(WriterClosedError):
        w.commit()
    w.abort()  # safe after a failed commit


def test_no_partial_file_after_write_if_absent(fb: FileBackend) -> None:
    fb.write_if_absent("k", b"first")
    with pytest.raises(FileExistsError):
        fb.write_if_absent("k", b"second")
    assert _all_files(fb.root) == ["k"], "write_if_absent left a partial file behind"


# -- directories -----------------------------------------------------------------------


def test_delete_last_key_removes_emptied_directories(fb: FileBackend) -> None:
    fb.write("d1/d2/d3/k", b"x")
    fb.delete("d1/d2/d3/k")
    assert not os.path.exists(os.path.join(fb.root, "d1")), "directories emptied by delete were left behind"


def test_delete_keeps_root(fb: FileBackend) -> None:
    fb.write("d1/k", b"x")
    fb.delete("d1/k")
    assert os.path.isdir(fb.root), "delete removed the backend's root directory"


def test_delete_keeps_non_empty_directories(fb: FileBackend) -> None:
    fb.write("d1/a", b"x")
    fb.write("d1/d2/b", b"x")
    fb.delete("d1/d2/b")
    assert os.path.isdir(os.path.join(fb.root, "d1")) and not os.path.exists(os.path.join(fb.root, "d1", "d2")), (
        "delete should remove only the directories it emptied"
    )


# -- URIs, paths and options -----------------------------------------------------------


def test_file_uri_and_plain_path_are_the_same_store(tmp_path: Path) -> None:
    backend_for(f"file://{tmp_path}/store").write("k", b"via-uri")
    assert backend_for(str(tmp_path / "store")).read("k") == b"via-uri", "file:// URI and plain path disagree"


def test_file_uri_root(tmp_path: Path) -> None:
    b = backend_for(f"file://{tmp_path}/store")
    assert isinstance(b, FileBackend) and b.root == str(tmp_path / "store")


def test_file_uri_with_localhost(tmp_path: Path) -> None:
    b = backend_for(f"file://localhost{tmp_path}/store")
    assert isinstance(b, FileBackend) and b.root == str(tmp_path / "store")


def test_file_uri_percent_decoded(tmp_path: Path) -> None:
    b = backend_for(f"file://{tmp_path}/my%20store")
    assert isinstance(b, FileBackend) and b.root == str(tmp_path / "my store")


def test_remote_file_uri_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local file URI"):
        backend_for("file://otherhost/data")


def test_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    b = backend_for("rel/store")
    assert isinstance(b, FileBackend) and b.root == str(tmp_path / "rel" / "store")
    b.write("k", b"rel")
    assert (tmp_path / "rel" / "store" / "k").read_bytes() == b"rel", "relative-path backend wrote elsewhere"


def test_fsync_on_by_default(fb: FileBackend) -> None:
    assert fb.fsync is True


def test_fsync_false_via_uri_query(tmp_path: Path) -> None:
    b = backend_for(f"file://{tmp_path}/store?fsync=false")
    assert isinstance(b, FileBackend) and b.fsync is False
    assert b.root == str(tmp_path / "store"), "the query string leaked into the root path"


def test_fsync_keyword_option(tmp_path: Path) -> None:
    b = backend_for(str(tmp_path / "store"), fsync=False)
    assert isinstance(b, FileBackend) and b.fsync is False


def test_invalid_fsync_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        backend_for(f"file://{tmp_path}/store?fsync=maybe")


def test_unknown_option_names_it(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="bogus"):
        backend_for(str(tmp_path / "store"), bogus="1")


def test_unknown_query_option_names_it(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="colour"):
        backend_for(f"file://{tmp_path}/store?colour=blue")


# -- error wrapping --------------------------------------------------------------------


def test_os_read_error_is_wrapped(fb: FileBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    fb.write("k", b"data")
    cause = OSError(errno.EIO, "Input/output error")

    def failing_preadv(*args: object) -> int:
        raise cause

    monkeypatch.setattr(file_mod.os, "preadv", failing_preadv)
    with pytest.raises(StorageError) as info:
        fb.read_into("k", 0, memoryview(bytearray(4)))
    e = info.value
    assert not isinstance(e, ObjectNotFoundError), "an I/O error was reported as a missing object"
    assert e.action == "reading" and e.key == "k", f"wrong action/key on {e!r}"
    assert "reading" in str(e) and "'k'" in str(e) and "Input/output error" in str(e), f"message lacks context: {e}"
    assert e.__cause__ is cause, "the OS error is not chained as __cause__"


def test_reading_a_directory_is_a_wrapped_not_found(fb: FileBackend) -> None:
    # A directory is not an object: the OS error (EISDIR) becomes ObjectNotFoundError, a StorageError.
    fb.write("dir/obj", b"x")
    with pytest.raises(ObjectNotFoundError) as info:
        fb.read_into("dir", 0, memoryview(bytearray(4)))
    e = info.value
    assert isinstance(e, StorageError) and e.action == "reading" and "'dir'" in str(e), f"lacks action and key: {e}"
    assert isinstance(e.__cause__, OSError), "the OS error is not chained as __cause__"


def test_write_error_is_wrapped(fb: FileBackend) -> None:
    fb.write("taken", b"x")  # a file where the next key needs a directory
    with pytest.raises(StorageError) as info:
        fb.write("taken/child", b"y")
    assert "'taken/child'" in str(info.value) and info.value.__cause__ is not None


@pytest.mark.parametrize("cold", [True, False])
def test_large_reads_at_any_alignment_return_the_right_bytes(tmp_path, cold):
    """Reads of 4 MiB and more take the O_DIRECT paths (split when memory and file
    agree modulo 4096, bounced otherwise) or the page cache; all must agree."""
    import mmap as _mmap
    import os as _os

    from bcp.backends import backend_for as _backend_for

    backend = _backend_for(str(tmp_path / "store"))
    data = _os.urandom(12 << 20)
    backend.write("big.bin", data)
    path = tmp_path / "store" / "big.bin"
    arena = _mmap.mmap(-1, 16 << 20)  # page-aligned, so we can pick the memory phase
    for offset, phase, length in [
        (0, 0, 5 << 20),
        (4096 * 3 + 64, 64, 6 << 20),
        (12345, 777, 5 << 20),
        (100, 0, (12 << 20) - 100),
        ((12 << 20) - (4 << 20) - 5, 4091, 4 << 20),
    ]:
        if cold:
            fd = _os.open(path, _os.O_RDONLY)
            _os.posix_fadvise(fd, 0, 0, _os.POSIX_FADV_DONTNEED)
            _os.close(fd)
        target = memoryview(arena)[phase : phase + length]
        got = backend.read_into("big.bin", offset, target)
        assert got == min(length, len(data) - offset)
        assert bytes(target[:got]) == data[offset : offset + got], f"wrong bytes at offset {offset}, phase {phase}"


@pytest.mark.parametrize("on_memory", [True, False])
def test_a_writer_of_known_size_preallocates_only_outside_memory_file_systems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_memory: bool
) -> None:
    """tmpfs/ramfs (the local tier's /dev/shm): the partial file gets its size, sparse,
    without posix_fallocate zero-filling its pages before the writes; elsewhere it is
    preallocated. Either way a gap the writes skip reads as zeros after the commit."""
    calls: list[int] = []
    real = os.posix_fallocate

    def counting(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counting)
    monkeypatch.setattr(file_mod, "on_memory_fs", lambda _fd: on_memory)
    fb = FileBackend(str(tmp_path), fsync=False)
    size = 3 << 20
    with fb.open_writer("k", size=size) as w:
        (partial,) = _all_files(fb.root)
        assert os.path.getsize(os.path.join(fb.root, partial)) == size, "the partial file lacks its size"
        w.write_at(0, b"a" * 4096)
        w.write_at(size - 4096, b"z" * 4096)  # the middle is never written
        w.commit()
    assert calls == ([] if on_memory else [size])
    data = fb.read("k")
    assert len(data) == size and data[:4096] == b"a" * 4096 and data[-4096:] == b"z" * 4096
    assert data[4096:-4096] == bytes(size - 8192)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_writer_on_dev_shm_allocates_no_page_before_it_writes() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        fb = FileBackend(root, fsync=False)
        with fb.open_writer("k", size=8 << 20) as w:
            (partial,) = _all_files(root)
            st = os.stat(os.path.join(root, partial))
            if not file_mod.on_memory_fs(w.fd):  # type: ignore[attr-defined]
                pytest.skip("/dev/shm is not tmpfs here")
            assert st.st_size == 8 << 20 and st.st_blocks == 0, (st.st_size, st.st_blocks)
            w.abort()


# -- many buffers in one request (write_parts) ---------------------------------------------

_PAGE_SOURCE = bytes(range(256)) * 64  # 16 KiB of a known pattern


@settings(max_examples=examples(40), deadline=None)
@given(
    offset=st.integers(0, 3 * 4096),
    parts=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 3 * 4096 + 100)), min_size=1, max_size=8),
)
def test_write_parts_writes_the_concatenation_with_one_direct_request(tmp_path_factory, offset, parts) -> None:
    """Parts of any length, at any memory alignment, land back to back exactly; the
    whole pages between go to the O_DIRECT descriptor in one pwritev, never one
    request a part (a buffered write only for the partial pages at either end)."""
    import mmap

    fb = FileBackend(str(tmp_path_factory.mktemp("parts")))
    arena = mmap.mmap(-1, 8 * 4096)  # page-aligned memory, so some parts lie aligned
    arena.write(_PAGE_SOURCE * 2)
    views = [memoryview(arena)[skip : skip + n] for skip, n in parts]
    expected = b"".join(bytes(v) for v in views)
    writer = fb.open_writer("k", size=offset + len(expected))
    calls: list[tuple[int, int]] = []
    pwritev = os.pwritev

    def counting(fd, buffers, at):
        calls.append((fd, len(buffers)))
        return pwritev(fd, buffers, at)

    file_mod.os.pwritev = counting  # type: ignore[attr-defined]
    try:
        if offset:
            writer.write_at(0, bytes(offset))
        writer.write_parts(offset, views)  # type: ignore[attr-defined]
    finally:
        file_mod.os.pwritev = pwritev  # type: ignore[attr-defined]
    direct_fd = writer.dfd  # type: ignore[attr-defined]
    writer.commit()
    with open(_object_path(fb, "k"), "rb") as f:
        assert f.read() == bytes(offset) + expected
    whole_pages = (offset + len(expected)) // 4096 > -(-offset // 4096)
    if direct_fd is not None and whole_pages:
        assert [fd for fd, _n in calls].count(direct_fd) == 1
    assert len(calls) <= 3


def test_a_directory_replaced_by_a_link_after_its_check_is_still_refused(tmp_path):
    """The same backend checked ``step/`` while writing into it; then it is replaced by a
    link to a directory outside the root. A write, a delete, a size and a listing through
    it are refused (the checked directory used to be trusted for good: the delete emptied
    the outside directory, the write landed there)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"theirs")
    backend = backend_for(str(root))
    backend.write("step/k", b"data")
    assert backend.read("step/k") == b"data"
    (root / "step" / "k").unlink()
    (root / "step").rmdir()
    (root / "step").symlink_to(outside)
    for call in (
        lambda: backend.write("step/new", b"x"),
        lambda: backend.delete("step/victim"),
        lambda: backend.size("step/victim"),
        lambda: list(backend.list("step/")),
    ):
        with pytest.raises(StorageError, match="is a symbolic link"):
            call()
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == b"theirs"
