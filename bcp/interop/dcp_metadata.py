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

Torch private names (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``_get_layout``) are
only named here, as strings: they are what torch writes into the pickle.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import FormatError, PickleNotAllowedError
from ..state import KeyPath, PathElem, fqn_of
from .formats import DCP_METADATA_FILE

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


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` (everything, when
    ``allow_pickle``); ``path`` is named in the error."""

    def __init__(self, file: io.BufferedIOBase, *, path: str, allow_pickle: bool = False) -> None:
        super().__init__(file)
        self.path = path
        self.allow_pickle = allow_pickle

    def find_class(self, module: str, name: str) -> Any:
        if not self.allow_pickle and not is_allowed(module, name):
            raise PickleNotAllowedError(
                f"{self.path}: refusing to unpickle global {module + '.' + name!r}, which is not one of DCP's "
                "metadata types; pass allow_pickle=True (bcp convert --allow-pickle) only if you trust "
                "whoever wrote this checkpoint: unpickling can run any code"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self.path}: DCP metadata holds a persistent id, which DCP never writes")


def read_metadata(checkpoint_dir: str, *, allow_pickle: bool = False) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in ``checkpoint_dir``, unpickled by
    :class:`MetadataUnpickler`."""
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    with open(path, "rb") as f:
        return parse_metadata(f, where=path, allow_pickle=allow_pickle)


def parse_metadata(stream: io.BufferedIOBase, *, where: str, allow_pickle: bool = False) -> Metadata:
    """DCP ``Metadata`` from the pickled ``.metadata`` bytes in ``stream`` (from any
    storage), unpickled by :class:`MetadataUnpickler`; anything else raises an error
    naming ``where``."""
    try:
        metadata = MetadataUnpickler(stream, path=where, allow_pickle=allow_pickle).load()
    except (PickleNotAllowedError, FormatError):
        raise
    except Exception as e:  # truncated, not a pickle, a constructor refusing its arguments, ...
        raise FormatError(f"{where}: not a readable DCP metadata pickle: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise FormatError(f"{where}: DCP Metadata without a state_dict_metadata mapping")
    return metadata


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
            lines = str(e).splitlines()
            self.refused[fqn] = next((line.strip() for line in lines if "Unsupported global" in line), lines[0])


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
        text = repr(dcp_path)
        raise FormatError(
            f"{where}: DCP planner_data for {fqn!r} is not a path of keys and list indices that spells it: "
            f"{text if len(text) <= 120 else text[:117] + '...'}"
        )
    return tuple(path)
