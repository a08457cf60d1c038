"""A pass over a pickle's opcodes before it is unpickled: declared lengths must fit
the bytes present and BUILD steps may copy no more items than the pickle spells out,
so a small hostile ``.metadata`` cannot make the unpickler allocate gigabytes. The same
for a torch.save zip (a file, or an entry of DCP's): its entries' declared sizes
(:func:`check_archive`), before torch's loader inflates them."""

from __future__ import annotations

import io
import os
import pickletools
import zipfile
from typing import Any, BinaryIO

from bcp.convert.files import open_regular
from bcp.errors import FormatError


class _Value:
    """A value on the simulated stack of :func:`check_pickle`: how many items were
    put into it, and (for a tuple) what it holds."""

    __slots__ = ("items", "parts")

    def __init__(self, items: int = 0, parts: tuple[Any, ...] = ()) -> None:
        self.items = items
        self.parts = parts


def _state_items(state: Any) -> int:
    """The items BUILD copies from ``state`` (a dict, or a (dict, slots) pair)."""
    if isinstance(state, _Value) and len(state.parts) == 2:
        return sum(p.items for p in state.parts if isinstance(p, _Value)) + state.items
    return state.items if isinstance(state, _Value) else 0


_CONTAINERS = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "EMPTY_TUPLE"}
_FROM_MARK = {"DICT", "LIST", "TUPLE", "FROZENSET"}
_INTO = {"SETITEMS", "APPENDS", "ADDITEMS"}


def check_pickle(data: bytes, *, where: str) -> None:
    """FormatError naming ``where`` and the offset unless ``data`` is a sequence of
    pickle opcodes ending in STOP whose declared lengths fit in the bytes there are
    (the C unpickler allocates a declared length before it reads, so 14 bytes could
    otherwise make it allocate gigabytes), and whose BUILDs together copy no more
    items into objects than the pickle's size: a stack machine follows which values
    are containers and how many items each got, so one memoized dict handed to BUILD
    for every object (a quadratic copy) is refused. DCP's pickles build each object
    from a state spelled out once."""
    stream = io.BytesIO(data)
    pos = 0  # where the opcode being read starts
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    copied = 0

    def to_mark() -> list[Any]:
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    try:
        for opcode, arg, _at in pickletools.genops(stream):
            name = opcode.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in _CONTAINERS:
                stack.append(_Value())
            elif name in _INTO:
                added = len(to_mark())
                if isinstance(stack[-1], _Value):
                    stack[-1].items += added
            elif name in ("SETITEM", "APPEND"):
                del stack[-(2 if name == "SETITEM" else 1) :]
                if isinstance(stack[-1], _Value):
                    stack[-1].items += 1
            elif name in _FROM_MARK:
                items = to_mark()
                stack.append(_Value(len(items), tuple(items) if name == "TUPLE" else ()))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = stack[-n:]
                if len(items) != n:
                    raise ValueError(f"{name} on a stack of {len(items)}")
                del stack[-n:]
                stack.append(_Value(n, tuple(items)))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "BUILD":
                copied += _state_items(stack.pop())
                if copied > len(data):
                    raise ValueError(f"its BUILDs copy {copied:,} items into objects, more than its size spells out")
                if not stack:
                    raise ValueError("BUILD without an object to build")
            elif name == "POP":
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
            elif name == "POP_MARK":
                to_mark()
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "STOP":
                break
            else:  # everything else makes a new value from what it pops
                before = opcode.stack_before
                if pickletools.markobject in before:
                    to_mark()
                    count = before.index(pickletools.markobject)
                else:
                    count = len(before)
                if count > len(stack):
                    raise ValueError(f"{name} on a stack of {len(stack)}")
                del stack[len(stack) - count :]
                stack.extend(_Value() for _ in opcode.stack_after)
            pos = stream.tell()
    except Exception as e:  # ValueError for a truncated or unknown opcode, UnicodeDecodeError, ...
        text = str(e) if not isinstance(e, (IndexError, KeyError)) else f"{type(e).__name__}: stack or memo misused"
        raise FormatError(f"{where}: not a readable DCP metadata pickle (the opcode at byte {pos}): {text}") from e


#: what a torch.save zip's entries may declare beyond the file's own bytes (torch stores them
#: uncompressed; a zip bomb declares far more)
ZIP_SLACK_BYTES = 16 << 20


def check_archive(src: str | io.IOBase | BinaryIO, where: str | None = None) -> None:
    """FormatError, before torch reads it, for a zip whose entries declare more bytes than
    it holds (plus ``ZIP_SLACK_BYTES``: a bomb inflates in memory before torch's loader
    refuses it) or whose names leave the archive (``..``, ``/``). ``src``: a file's path,
    or a seekable binary stream (a DCP entry, :class:`FileSlice`), left at its start;
    ``where`` names it in errors (default: the path). A legacy (non-zip) torch.save
    passes: torch reads it record by record."""
    name = where or str(src)
    if isinstance(src, str):  # a FIFO in a file's place is refused, not waited on
        with open_regular(src) as f:
            return check_archive(f, where=name)
    size = src.seek(0, io.SEEK_END)
    try:
        if not zipfile.is_zipfile(src):
            return
        try:
            with zipfile.ZipFile(src) as archive:
                entries = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise FormatError(f"{name}: not a readable torch.save zip: {e}") from None
    finally:
        src.seek(0)
    declared = sum(entry.file_size for entry in entries)
    if declared > size + ZIP_SLACK_BYTES:
        raise FormatError(f"{name}: its zip entries declare {declared} bytes, far more than its {size} bytes hold")
    for entry in entries:
        if entry.filename.startswith("/") or ".." in entry.filename.split("/"):
            raise FormatError(f"{name}: a zip entry named {entry.filename!r} lies outside the archive")


class FileSlice(io.RawIOBase):
    """Bytes ``start``..``start + length`` of an open file (descriptor ``fd``, not closed
    here) as a seekable stream: :func:`check_archive` of one entry of a DCP data file
    reads only its zip directory, never the whole entry."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._at = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the start")
        self._at = base + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._at))
        if not n:
            return 0
        data = os.pread(self._fd, n, self._start + self._at)
        view[: len(data)] = data
        self._at += len(data)
        return len(data)
