"""Reading a PyTorch DCP checkpoint without running code chosen by its author.

DCP stores its ``.metadata`` as a pickle, and torch's ``FileSystemReader`` loads it
with ``pickle.load``: a crafted ``.metadata`` runs anything on ``bcp convert``. Here
it is unpickled by :class:`MetadataUnpickler`, which resolves only the globals that
DCP's own metadata contains (:data:`ALLOWED_GLOBALS`, the way
``torch.load(weights_only=True)`` does for tensors) and refuses every other one with
:class:`~bcp.errors.PickleNotAllowedError`, unless the caller passed
``allow_pickle=True``.

The allow-list was derived by unpickling the ``.metadata`` of real DCP checkpoints
(model + AdamW/SGD optimizer state, LR scheduler, nested dicts and lists, bytes,
strings, numbers, None, every common dtype, channels-last and non-contiguous tensors,
parameters) with a recording ``find_class`` (see tests/test_convert_safety.py). Every
entry is a dataclass, an enum, a value lookup or a plain constructor: calling one
with attacker-chosen arguments builds data and does nothing else.

Non-tensor values in the data files are ``torch.save``\\ d pickles too:
:class:`SafeBytesPlanner` loads them with ``weights_only=True`` unless
``allow_pickle``, and reports the ones that need more.

Memory is bounded by the bytes present: every length a pickle opcode declares is
checked against the data before the unpickler allocates it (:func:`check_pickle`), and
the allow-listed constructors that copy or size their argument (``bytearray(n)``,
``set(list)``, ...) share a budget of the file's size (:class:`MetadataUnpickler`):
DCP's own metadata never builds more than it spells out.

Torch private names (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``_get_layout``) are
only named here, as strings: they are what torch writes into the pickle.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import reprlib
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from bcp.convert.files import open_regular
from bcp.convert.formats import DCP_METADATA_FILE
from bcp.convert.pickle_check import check_pickle
from bcp.errors import CorruptCheckpointError, FormatError, PickleNotAllowedError
from bcp.metadata.geometry import tiling_problem
from bcp.state import KeyPath, PathElem, fqn_of

_DCP = "torch.distributed.checkpoint.metadata"
_PATHS = ("PosixPath", "PurePosixPath", "PureWindowsPath")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")

#: (module, name) of every global DCP's metadata pickle may name. torch dtypes
#: (``torch.float32`` ...) are allowed too, by type: see :func:`is_allowed`.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # storage_data values
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles torch.strided: a lookup by name
        ("collections", "OrderedDict"),
        *(("pathlib", p) for p in _PATHS),  # StorageMeta.checkpoint_id
        *(("pathlib._local", p) for p in _PATHS),  # the same classes on Python 3.13+
        *(("torch", f) for f in _MEMORY_FORMATS),
        *(("torch._utils", f"torch.{f}") for f in _MEMORY_FORMATS),  # how torch pickles a memory_format
        *(("builtins", b) for b in ("set", "frozenset", "slice", "complex", "bytearray")),
    }
)


def is_allowed(module: str, name: str) -> bool:
    """Whether ``module.name`` may be resolved while unpickling DCP metadata."""
    if (module, name) in ALLOWED_GLOBALS:
        return True
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


#: Allowed constructors whose result grows with their argument (a copy of a list, a
#: zero-filled buffer of a given size): each call is charged to the unpickler's budget.
SIZED_CONSTRUCTORS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        *(("pathlib", p) for p in _PATHS),
        *(("pathlib._local", p) for p in _PATHS),
        *(("builtins", b) for b in ("set", "frozenset", "bytearray")),
    }
)


def _units(value: Any) -> int:
    """What a constructor may build from ``value``: its length (its value, for the
    size ``bytearray(n)`` takes), at least 1."""
    if type(value) is int:
        return max(value, 1)
    try:
        return max(len(value), 1)
    except TypeError:
        return 1


def _count(n: int) -> str:
    return f"{n:,} bytes" if n != 1 else "1 byte"


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` (everything, when
    ``allow_pickle``); ``path`` is named in the error. With ``limit`` (the size of
    the pickle), the :data:`SIZED_CONSTRUCTORS` together may build at most that many
    bytes or items: a legitimate pickle spells out every item it passes them, so a
    call that asks for more (``bytearray(3 GiB)`` from 34 bytes, one list copied a
    thousand times) is a FormatError before anything is allocated."""

    def __init__(
        self, file: io.BufferedIOBase, *, path: str, allow_pickle: bool = False, limit: int | None = None
    ) -> None:
        super().__init__(file)
        self.path = path
        self.allow_pickle = allow_pickle
        self.limit = limit
        self.spent = 0

    def find_class(self, module: str, name: str) -> Any:
        if not self.allow_pickle and not is_allowed(module, name):
            raise PickleNotAllowedError(
                f"{self.path}: refusing to unpickle global {module + '.' + name!r}, which is not one of DCP's "
                "metadata types; pass allow_pickle=True (bcp convert --allow-pickle) only if you trust "
                "whoever wrote this checkpoint: unpickling can run any code"
            )
        found = super().find_class(module, name)
        if self.limit is not None and (module, name) in SIZED_CONSTRUCTORS:
            return self._bounded(found, f"{module}.{name}")
        return found

    def _bounded(self, constructor: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            units = sum(_units(a) for a in args) + 1
            assert self.limit is not None  # only wrapped with a limit
            if self.spent + units > self.limit:
                raise FormatError(
                    f"{self.path}: the pickle calls {name} for {_count(units)} after {_count(self.spent)} of "
                    f"such calls, more than its {_count(self.limit)} can describe: not DCP metadata"
                )
            self.spent += units
            return constructor(*args)

        return call

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self.path}: DCP metadata holds a persistent id, which DCP never writes")


def read_metadata(checkpoint_dir: str, *, allow_pickle: bool = False) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in ``checkpoint_dir``, unpickled by
    :class:`MetadataUnpickler`."""
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    with open_regular(path, follow_links=False) as f:  # as the data files: no link out, no FIFO waited on
        return parse_metadata(f, where=path, allow_pickle=allow_pickle)


def parse_metadata(stream: io.BufferedIOBase | BinaryIO, *, where: str, allow_pickle: bool = False) -> Metadata:
    """DCP ``Metadata`` from the pickled ``.metadata`` bytes in ``stream`` (from any
    storage), unpickled by :class:`MetadataUnpickler` after :func:`check_pickle`, with
    the stream's size as its budget; anything else raises an error naming ``where``."""
    data = stream.read()
    check_pickle(data, where=where)
    try:
        unpickler = MetadataUnpickler(io.BytesIO(data), path=where, allow_pickle=allow_pickle, limit=len(data))
        metadata = unpickler.load()
    except (PickleNotAllowedError, FormatError):
        raise
    except Exception as e:  # truncated, not a pickle, a constructor refusing its arguments, ...
        raise FormatError(f"{where}: not a readable DCP metadata pickle: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise FormatError(f"{where}: DCP Metadata without a state_dict_metadata mapping")
    for fqn, meta in metadata.state_dict_metadata.items():
        _check_entry(fqn, meta, where)
    return metadata


def _shape(value: Any) -> bool:
    """Up to 64 non-negative ints below 2**63 (what int64 arithmetic on them needs)."""
    return isinstance(value, tuple) and len(value) <= 64 and all(type(d) is int and 0 <= d < 2**63 for d in value)


def _check_entry(fqn: Any, meta: Any, where: str) -> None:
    """FormatError naming ``where`` and ``fqn`` unless ``meta`` is a DCP entry with the
    fields DCP and bcp read: a crafted pickle can build a dataclass without them."""
    if type(fqn) is not str:
        raise FormatError(f"{where}: DCP metadata has the key {reprlib.repr(fqn)}, not a string")
    if isinstance(meta, BytesStorageMetadata):
        return
    if not isinstance(meta, TensorStorageMetadata):
        raise FormatError(f"{where}: DCP metadata for {fqn!r} is a {type(meta).__name__}, not a tensor or bytes entry")
    tensor_nbytes(fqn, meta, where=where)
    chunks = getattr(meta, "chunks", None)
    size = meta.size
    if not isinstance(chunks, list) or not all(
        isinstance(c, ChunkStorageMetadata)
        and _shape(getattr(c, "offsets", None))
        and _shape(getattr(c, "sizes", None))
        and len(c.offsets) == len(c.sizes) == len(size)
        and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, size, strict=True))
        for c in chunks
    ):
        raise FormatError(f"{where}: DCP metadata for {fqn!r} has chunks that do not lie inside its size {tuple(size)}")
    if math.prod(size) and chunks:  # elements no chunk covers would be returned unread
        offsets = np.array([list(c.offsets) for c in chunks], np.int64).reshape(len(chunks), len(size))
        lengths = np.array([list(c.sizes) for c in chunks], np.int64).reshape(len(chunks), len(size))
        problem = tiling_problem(tuple(size), offsets, lengths)
        if problem is not None:
            raise FormatError(
                f"{where}: DCP metadata for {fqn!r}: its chunks do not tile its size {tuple(size)}: {problem}"
            )
    elif math.prod(size):
        raise FormatError(f"{where}: DCP metadata for {fqn!r} has no chunk for its {math.prod(size)} elements")


def _plain_name(name: Any) -> bool:
    """Whether a data file's ``relative_path`` stays inside the checkpoint."""
    if type(name) is not str or not name or "\x00" in name or "\\" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def tensor_nbytes(fqn: str, meta: TensorStorageMetadata, *, where: str) -> int:
    """The bytes of the tensor ``meta`` declares; FormatError naming ``where`` and
    ``fqn`` for a size that is not non-negative ints or a dtype that is not one."""
    size, dtype = getattr(meta, "size", None), getattr(getattr(meta, "properties", None), "dtype", None)
    if not _shape(size):
        raise FormatError(f"{where}: DCP metadata gives {fqn!r} the size {reprlib.repr(size)}, not a tensor shape")
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: DCP metadata gives {fqn!r} the dtype {reprlib.repr(dtype)}, not a torch dtype")
    assert isinstance(size, tuple)  # _shape
    if math.prod(d for d in size if d) * max(dtype.itemsize, 1) >= 2**63:  # also an empty tensor's strides
        raise FormatError(f"{where}: DCP metadata gives {fqn!r} the size {size}, past what a tensor can hold")
    return math.prod(size) * dtype.itemsize


def check_storage(metadata: Metadata, *, size_of: Callable[[str], int], where: Callable[[str], str]) -> dict[str, int]:
    """The real size of every data file ``metadata`` names (``size_of(name)``), once
    every item's ``offset``/``length`` was checked to lie inside its file and every
    tensor's declared bytes against the bytes stored for it, before anything is
    allocated or read. A name that leaves the checkpoint (``../x``) or a field of the
    wrong type: FormatError; an item past the end of its file, a missing file or a
    tensor larger than its stored bytes: CorruptCheckpointError naming the file, the
    key and the offset. ``where(name)`` is how a file is named in errors. A compressed
    entry (DCP's stream transforms): FormatError, its size unknown until it inflates."""
    md = where(DCP_METADATA_FILE)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise FormatError(f"{md}: DCP metadata without a storage_data mapping")
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if type(fqn) is not str or not _plain_name(name) or type(offset) is not int or type(length) is not int:
            raise FormatError(
                f"{md}: DCP storage_data for {reprlib.repr(fqn)} is not a data file in the checkpoint with an "
                f"offset and a length: {reprlib.repr(info)}"
            )
        assert isinstance(name, str) and isinstance(offset, int) and isinstance(length, int)  # checked above
        if name not in sizes:
            try:
                sizes[name] = size_of(name)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    f"{where(name)}: missing, but DCP metadata stores {fqn!r} in it", fqn=fqn, file=name
                ) from e
        if offset < 0 or length < 0 or offset + length > sizes[name]:
            raise CorruptCheckpointError(
                f"{where(name)}: DCP metadata stores {fqn!r} at bytes {offset}..{offset + length}, but the file has "
                f"{_count(sizes[name])}: it is truncated or the metadata is corrupt",
                fqn=fqn,
                file=name,
                offset=offset,
            )
        stored[fqn] = stored.get(fqn, 0) + length
        if transforms := getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"{where(name)}: {fqn!r} is stored through DCP's stream transforms {reprlib.repr(transforms)} "
                "(compressed), which bcp does not read: its declared size cannot be checked before it inflates; "
                "load it with DCP and save it again without _extensions first"
            )
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        nbytes = tensor_nbytes(fqn, meta, where=md)
        if nbytes > stored.get(fqn, 0):
            raise CorruptCheckpointError(
                f"{md}: {fqn!r} is declared as {_count(nbytes)}, but the data files hold "
                f"{_count(stored.get(fqn, 0))} of it",
                fqn=fqn,
                file=DCP_METADATA_FILE,
            )
    return sizes


class DCPReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata was already read safely (torch's own
    ``read_metadata`` would unpickle ``.metadata`` with plain ``pickle.load``)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._safe_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._safe_metadata
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # as torch's read_metadata does
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeBytesPlanner(DefaultLoadPlanner):
    """Loads DCP's non-tensor entries (``torch.save``\\ d bytes) with
    ``weights_only=True`` unless ``allow_pickle``; collects them in ``loaded`` and
    the ones that need a full unpickle in ``refused`` (fqn -> reason), instead of
    putting them into the state (DCP's own planner unpickles them without limits)."""

    def __init__(self, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.loaded: dict[str, Any] = {}
        self.refused: dict[str, str] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.loaded[fqn] = torch.load(value, map_location="cpu", weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:
            lines = str(e).splitlines() or [type(e).__name__]
            self.refused[fqn] = next((line.strip() for line in lines if "Unsupported global" in line), lines[0])
        except Exception as e:  # truncated or not torch.save's bytes at all: EOFError, RuntimeError, ...
            first = str(e).splitlines()[0] if str(e) else ""
            raise FormatError(f"DCP entry {fqn!r}: not readable torch.save bytes: {type(e).__name__}: {first}") from e


# -- nesting -----------------------------------------------------------------------------------------

#: A list index in DCP's planner_data above this is refused: a crafted ``.metadata``
#: could otherwise make the rebuilt state allocate a huge list.
MAX_LIST_INDEX = 1 << 24


def key_paths(metadata: Metadata, *, where: str) -> dict[str, KeyPath]:
    """fqn -> bcp key path for every entry of ``metadata``, rebuilt from DCP's
    ``planner_data`` (fqn -> the keys and list indices that led to the value in the
    saved state: DCP writes dict keys as ``str`` and list indices as ``int``). An entry
    without one (a checkpoint saved with ``flatten_state_dict=False``) stays a top-level
    key. FormatError naming ``where`` and the key for a path that does not spell its key."""
    recorded = getattr(metadata, "planner_data", None)
    if recorded is not None and not isinstance(recorded, dict):
        raise FormatError(f"{where}: DCP planner_data is a {type(recorded).__name__}, not a mapping")
    recorded = recorded or {}
    out: dict[str, KeyPath] = {}
    for fqn in metadata.state_dict_metadata:
        dcp_path = recorded.get(fqn)
        out[fqn] = (("d", fqn),) if dcp_path is None else _key_path(fqn, dcp_path, where)
    return out


def _key_path(fqn: str, dcp_path: Any, where: str) -> KeyPath:
    ok = isinstance(dcp_path, (tuple, list)) and len(dcp_path) > 0 and isinstance(dcp_path[0], str)
    path: list[PathElem] = []
    for step in dcp_path if ok else ():
        if type(step) is str:
            path.append(("d", step))
        elif type(step) is int and 0 <= step <= MAX_LIST_INDEX:
            path.append(("l", step))
        else:
            ok = False
            break
    if not ok or fqn_of(tuple(path)) != fqn:
        raise FormatError(
            f"{where}: DCP planner_data for {fqn!r} is not a path of keys and list indices that spells it: "
            f"{reprlib.repr(dcp_path)}"  # bounded: the path may be a list nested a million deep
        )
    return tuple(path)
