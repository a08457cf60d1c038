"""Lightning's checkpoints through bcp: ``Trainer(plugins=[BcpCheckpointIO()])``.

Lightning hands a ``CheckpointIO`` one finished dict (weights, optimizer and
scheduler states, loop progress, callback states, hyper-parameters) and calls
``save_checkpoint`` on global rank 0 only (``Strategy.save_checkpoint``), while every
rank waits at a barrier. ``bcp.save`` is collective by default, so the plugin saves
with ``process_group=bcp.LOCAL``: rank 0 writes the whole checkpoint alone and never
waits on the others. ``load_checkpoint`` runs on every rank; each reads the
checkpoint on its own (``bcp.open``, not collective). ``remove_checkpoint`` (rank 0,
from ``ModelCheckpoint``) is :func:`bcp.delete`.

The dict is stored as it is: ``bcp.open(path).state()["state_dict"]`` holds the
weights under their names. bcp rebuilds containers as plain dicts in its own key
order, so the plugin also stores the containers' types and order (``LAYOUT_KEY``) and
``load_checkpoint`` returns a dict equal to the one saved, ``OrderedDict`` s, tuples
and key order included. Values with no safe encoding (a user's class among the
hyper-parameters) are refused naming their key unless ``allow_pickle=True``.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..deletion import delete
from ..errors import CheckpointError
from ..extras import needs_extra
from ..lanes import LOCAL
from ..reader import open_checkpoint
from ..saver import save

with needs_extra("lightning", "bcp.integrations.lightning"):
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

log = logging.getLogger(__name__)

#: the top-level key holding the containers' layout (Lightning never uses it)
LAYOUT_KEY = "bcp.lightning.layout"

_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def layout_of(value: Any) -> Any:
    """The containers of ``value`` (dict, OrderedDict, list, tuple), their order and
    types, with every leaf replaced by None: what bcp's own rebuild does not keep."""
    t = type(value)
    if t is dict or t is collections.OrderedDict:
        return t((k, layout_of(v)) for k, v in value.items())
    if t is list or t is tuple:
        return t(layout_of(v) for v in value)
    return None


def apply_layout(layout: Any, value: Any) -> Any:
    """``value`` (as bcp rebuilt it) with the containers of ``layout`` put back."""
    t = type(layout)
    if (t is dict or t is collections.OrderedDict) and isinstance(value, Mapping):
        return t((k, apply_layout(sub, value[k])) for k, sub in layout.items())
    if (t is list or t is tuple) and isinstance(value, list | tuple) and len(value) == len(layout):
        return t(apply_layout(sub, v) for sub, v in zip(layout, value, strict=True))
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict) and type(value) in _CONTAINERS:
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    if isinstance(value, list | tuple) and type(value) in _CONTAINERS:
        return type(value)(_to_device(v, device) for v in value)
    return value


class BcpCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves, loads and removes checkpoints with bcp.

    Each checkpoint path (``epoch=3-step=400.ckpt``) becomes a bcp checkpoint
    directory (or prefix, on an object store: ``ModelCheckpoint(dirpath="s3://...")``).
    ``storage_options``: bcp storage options for every URI (credentials, endpoints);
    ``allow_pickle``: store values bcp cannot encode safely by pickle (loading then
    runs code from the checkpoint; off by default)."""

    def __init__(self, *, storage_options: Mapping[str, Any] | None = None, allow_pickle: bool = False) -> None:
        self.storage_options = dict(storage_options or {})
        self.allow_pickle = allow_pickle

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path`` from this process alone (Lightning calls it on
        rank 0 only), replacing a checkpoint already there atomically."""
        if LAYOUT_KEY in checkpoint:
            raise ValueError(f"the checkpoint dict has a key {LAYOUT_KEY!r}, which BcpCheckpointIO reserves")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping of bcp storage options, not {storage_options!r}")
        state = {**checkpoint, LAYOUT_KEY: layout_of(checkpoint)}
        info = save(
            state,
            os.fspath(path),
            process_group=LOCAL,
            overwrite=True,
            allow_pickle=self.allow_pickle,
            storage_options={**self.storage_options, **(storage_options or {})} or None,
            metadata={"integration": "lightning"},
        )
        log.debug("saved Lightning checkpoint %s (%s)", path, info)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The dict saved at ``path`` (tensors on CPU, or on ``map_location``: a device
        or its name). bcp never unpickles unless the plugin was built with
        ``allow_pickle=True``; ``weights_only=True`` refuses pickles even then."""
        if map_location is not None and not isinstance(map_location, str | torch.device):
            raise TypeError(
                f"BcpCheckpointIO.load_checkpoint: map_location must be a device or None, not {map_location!r}"
            )
        with open_checkpoint(
            os.fspath(path),
            allow_pickle=self.allow_pickle and weights_only is not True,
            storage_options=self.storage_options or None,
        ) as reader:
            state = reader.state(per_rank=0)
        layout = state.pop(LAYOUT_KEY, None)
        checkpoint = apply_layout(layout, state) if layout is not None else state
        if map_location is not None:
            checkpoint = _to_device(checkpoint, torch.device(map_location))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` with :func:`bcp.delete` (its objects only;
        nothing when it is not there). What is not a bcp checkpoint is left, with a
        warning, as ``bcp.delete`` refuses it."""
        try:
            delete(os.fspath(path), missing_ok=True, storage_options=self.storage_options or None)
        except CheckpointError as e:  # not bcp's (a torch.save file, a symbolic link): left, training goes on
            log.warning("BcpCheckpointIO.remove_checkpoint left %s: %s", path, e)
