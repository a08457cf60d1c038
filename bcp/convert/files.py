"""The local files a conversion reads and writes: an input opened only if it is a regular
file (:func:`open_regular`), each finished file moved into place with the mode a plain
``open()`` gives, the files of an earlier export found (and only those removed), and
tensors whose memory is a scratch file (page cache the kernel can reclaim, so a
checkpoint larger than RAM converts)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence, Set
from typing import BinaryIO

import torch

from bcp.errors import FormatError

log = logging.getLogger(__name__)


def regular_fd(path: str, *, follow_links: bool = True) -> int:
    """A descriptor of ``path`` for reading when it is a regular file: a FIFO or a device
    in its place is refused, never waited on (a plain ``open()`` of a FIFO blocks for
    good); without ``follow_links`` a link is refused too (one inside a checkpoint).
    FormatError naming it otherwise; other errors (missing, no permission) as ``open()``
    raises them."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)  # link-ok: only an input the user named (follow_links), FIFOs refused below
    except OSError as e:  # ELOOP: a link, where none is followed
        if e.errno != errno.ELOOP or follow_links:
            raise
        raise FormatError(f"{path}: not a data file bcp reads ({e.strerror}; links are never followed)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{path}: not a regular file")
    return fd


def open_regular(path: str, *, follow_links: bool = True) -> BinaryIO:
    """:func:`regular_fd` as a binary file object."""
    return os.fdopen(regular_fd(path, follow_links=follow_links), "rb")


def current_umask() -> int:
    """The process's umask, read from /proc where Linux shows it (nothing changes); else
    set and restored at once (other threads could create a file in between)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(tmp: str, final: str) -> None:
    """Move a finished temporary file into place with the mode a plain ``open()`` gives
    (0666 & ~umask): a writer that creates its file private (safetensors' ``save_file``
    makes it 0600) would leave an export that another user's serving process cannot read."""
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, final)


def publish_dir(staging: str, dst_dir: str, stale: Sequence[str], *, last: str) -> None:
    """Move every file of ``staging`` into ``dst_dir`` and remove the ``stale`` ones:
    the old ``last`` (the index) first, so that no index names a mix of old and new
    files, the new one at the end, so that it names only files in place."""
    written = sorted(os.listdir(staging))
    if last in stale:
        os.remove(os.path.join(dst_dir, last))
    for name in written:
        if name != last:
            publish(os.path.join(staging, name), os.path.join(dst_dir, name))
    for name in stale:
        if name != last and name not in written:
            os.remove(os.path.join(dst_dir, name))
    if last in written:
        publish(os.path.join(staging, last), os.path.join(dst_dir, last))


def stale_files(
    dst_dir: str, *, kind: str, wanted: Callable[[str], bool], overwrite: bool, keep: Set[str] = frozenset()
) -> list[str]:
    """Names in ``dst_dir`` that an export of ``kind`` files must remove before it
    writes (``keep`` excepted): those ``wanted`` picks, regular files or links, never
    followed. FileExistsError when ``dst_dir`` is not empty and not ``overwrite``, or
    is not a directory. Nothing is removed here: the caller does, once it knows the
    export can be written."""
    try:
        entries = list(os.scandir(dst_dir))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise FileExistsError(f"{dst_dir} exists and is not a directory") from None
    if entries and not overwrite:
        shown = ", ".join(sorted(e.name for e in entries)[:5])
        raise FileExistsError(
            f"{dst_dir} is not empty ({shown}{', ...' if len(entries) > 5 else ''}); choose an empty directory, "
            f"or pass overwrite=True (--overwrite) to replace the {kind} files in it"
        )
    return sorted(
        e.name
        for e in entries
        if wanted(e.name) and e.name not in keep and (e.is_symlink() or e.is_file(follow_symlinks=False))
    )


def file_backed(scratch: str, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory is a file in ``scratch`` (mmap, shared); an
    empty one (no element) is a plain empty tensor: a 1-byte storage under it was
    written by torch.save as a record torch.load then refused."""
    if not torch.Size(shape).numel():
        return torch.empty(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    path = os.path.join(scratch, f"{len(os.listdir(scratch)):08d}-{abs(hash(name)) % 10**8}.bin")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    strides = torch.empty(shape, device="meta").stride()
    # torch's stubs type from_file's result as _StorageBase | TypedStorage; it is an UntypedStorage
    return torch.empty(0, dtype=dtype).set_(storage, 0, torch.Size(shape), strides)  # type: ignore[arg-type]
