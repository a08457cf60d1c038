"""The load path: match a template state against a checkpoint, then fill it.

Tensors are filled in place (their memory, device and dtype stay the caller's);
objects are replaced. A template object that is a container where the checkpoint
holds a subtree (an optimizer's empty ``state`` before its first step) is replaced by
that subtree, tensors allocated on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .errors import StateMismatchError
from .reader import CheckpointReader, open_checkpoint
from .state import KeyPath, Leaf, build_nested, flatten_state, replace_at

log = logging.getLogger(__name__)


def _keys(path: KeyPath) -> tuple:
    return tuple(k for _kind, k in path)


def load(
    state: Mapping[str, Any],
    uri: str,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Mapping[str, Any]:
    """Fill ``state`` from the checkpoint at ``uri`` and return it.

    strict=True: any missing key, unexpected key, shape or dtype mismatch raises one
    StateMismatchError listing them all, before anything is read. strict=False: keys
    on one side only are skipped, dtypes are cast; shapes must still match.
    """
    with open_checkpoint(uri, allow_pickle=allow_pickle, storage_options=dict(storage_options or {})) as reader:
        return _load_with(reader, state, strict=strict)


def _load_with(reader: CheckpointReader, state: Mapping[str, Any], *, strict: bool) -> Mapping[str, Any]:
    leaves = flatten_state(state)
    stored_tensors = reader.catalog.tensors
    stored_objects = reader.manifest.objects
    stored_paths = {fqn: _keys(reader.key_path(fqn)) for fqn in reader.keys()}

    tensor_loads: list[Leaf] = []
    object_loads: list[Leaf] = []
    subtree_loads: list[tuple[Leaf, list[str]]] = []
    consumed: set[str] = set()
    missing, shape_mm, dtype_mm, kind_mm = [], [], [], []

    for leaf in leaves.values():
        fqn = leaf.fqn
        if leaf.is_tensor:
            if fqn in stored_tensors:
                consumed.add(fqn)
                meta = reader.meta(fqn)
                if tuple(leaf.value.shape) != tuple(meta.shape):
                    shape_mm.append((fqn, tuple(leaf.value.shape), tuple(meta.shape)))
                elif leaf.value.dtype != meta.dtype:
                    dtype_mm.append((fqn, str(leaf.value.dtype).removeprefix("torch."), str(meta.dtype).removeprefix("torch.")))
                    tensor_loads.append(leaf)
                else:
                    tensor_loads.append(leaf)
            elif fqn in stored_objects:
                consumed.add(fqn)
                kind_mm.append((fqn, "a tensor", "an object"))
            else:
                missing.append(fqn)
            continue
        if fqn in stored_objects:
            consumed.add(fqn)
            object_loads.append(leaf)
        elif fqn in stored_tensors:
            consumed.add(fqn)
            kind_mm.append((fqn, "an object", "a tensor"))
        else:
            prefix = _keys(leaf.path)
            below = [f for f, p in stored_paths.items() if len(p) > len(prefix) and p[: len(prefix)] == prefix]
            if below and isinstance(leaf.value, (Mapping, list, tuple)):
                consumed.update(below)
                subtree_loads.append((leaf, below))
            else:
                missing.append(fqn)
    unexpected = [f for f in reader.keys() if f not in consumed]

    if strict and (missing or unexpected or shape_mm or dtype_mm or kind_mm):
        raise StateMismatchError(
            reader.uri, missing=missing, unexpected=unexpected,
            shape_mismatch=shape_mm, dtype_mismatch=dtype_mm, kind_mismatch=kind_mm,
        )
    if shape_mm:
        raise StateMismatchError(
            reader.uri, missing=[], unexpected=[], shape_mismatch=shape_mm, dtype_mismatch=[], kind_mismatch=[]
        )
    if missing or unexpected or dtype_mm or kind_mm:
        log.info(
            "non-strict load from %s: %d missing, %d unexpected, %d cast, %d kind mismatches skipped",
            reader.uri, len(missing), len(unexpected), len(dtype_mm), len(kind_mm),
        )

    for leaf in tensor_loads:
        reader.read_into(leaf.fqn, leaf.value)
    for leaf in object_loads:
        state = replace_at(state, leaf.path, reader.read_object(leaf.fqn))
    for leaf, below in subtree_loads:
        depth = len(leaf.path)
        subtree = build_nested((reader.key_path(f)[depth:], reader.read(f)) for f in below)
        state = replace_at(state, leaf.path, subtree)
    return state


__all__ = ["load"]
