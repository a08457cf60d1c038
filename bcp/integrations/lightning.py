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

Lightning's FSDP and model-parallel strategies never hand sharded checkpoints to a
``CheckpointIO``, so for them the strategy itself is replaced:
``Trainer(strategy=BcpModelParallelStrategy(...))`` (FSDP2 and tensor parallelism) or
``BcpFSDPStrategy(...)`` (FSDP1). Every rank then calls ``bcp.save`` with its DTensor
shards of the weights and optimizer states (no gather) beside rank 0's rest of the
dict, and ``bcp.load`` into the state dicts of the current layout (any number of
ranks, any mesh); ``ModelCheckpoint``'s removals are :func:`bcp.delete` from rank 0.
"""

from __future__ import annotations

import collections
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from bcp.backends import registered_backends
from bcp.coordination.lanes import LOCAL
from bcp.deletion import delete
from bcp.errors import CheckpointError, StateMismatchError
from bcp.extras import needs_extra
from bcp.loader import load_with_info
from bcp.reader import CheckpointReader, open_checkpoint
from bcp.saver import save
from bcp.training import lowest_rank_buffers

with needs_extra("lightning", "bcp.integrations.lightning"):
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, ParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)

#: the top-level key holding the containers' layout (Lightning never uses it)
LAYOUT_KEY = "bcp.lightning.layout"

_CONTAINERS = (dict, collections.OrderedDict, list, tuple)

#: the keys of Lightning's checkpoint dict that hold the sharded state (weights and
#: optimizer states): every rank saves its shards, and loads them in place
SHARDED_KEYS = ("state_dict", "optimizer_states")

#: ``memory:/store/x``: what ``pathlib.Path("memory://store/x")`` prints
_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")


def checkpoint_uri(path: Any) -> str:
    """``path`` (a string or a path object) as a bcp URI. ``Path("memory://a/b")`` is
    ``memory:/a/b``: a path object whose text is a bcp scheme (not ``file``, whose
    one-slash form is a valid URI) and one slash gets its second slash back."""
    text = os.fspath(path)
    if not isinstance(path, str) and (m := _ONE_SLASH.match(text)):
        scheme = m.group(1).lower()
        if scheme != "file" and scheme in registered_backends():
            return f"{m.group(1)}://{text[m.end() :]}"
    return text


def remove_checkpoint_at(uri: str, storage_options: Mapping[str, Any] | None) -> None:
    """:func:`bcp.delete` of the checkpoint at ``uri`` (nothing when it is not there);
    what is not a bcp checkpoint is left, with a warning, and training goes on."""
    try:
        delete(uri, missing_ok=True, storage_options=storage_options or None)
    except CheckpointError as e:  # not bcp's (a torch.save file, a symbolic link): left, training goes on
        log.warning("Lightning's checkpoint removal left %s: %s", uri, e)


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
            checkpoint_uri(path),
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
            checkpoint_uri(path),
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
        remove_checkpoint_at(checkpoint_uri(path), self.storage_options)


# -- sharded strategies: every rank saves and loads its shards -----------------------


def _placeholder(reader: CheckpointReader, key: Any) -> Any:
    """What the load template holds for the stored top-level entry ``key``: None for an
    object, an empty tensor for a tensor (bcp fills both), an empty dict for a subtree
    (bcp replaces it by what is stored below it)."""
    fqn = str(key)
    if fqn in reader and len(reader.key_path(fqn)) == 1:
        return None if fqn in reader.object_keys() else reader.empty(fqn)
    return {}


class _ShardedBcp(ParallelStrategy):
    """``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` through bcp
    for a strategy whose model and optimizer states are DTensors: the strategies below."""

    storage_options: dict[str, Any]
    allow_pickle: bool

    def _bcp_setup(self, storage_options: Mapping[str, Any] | None, allow_pickle: bool) -> None:
        self.storage_options = dict(storage_options or {})
        self.allow_pickle = allow_pickle

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the weights (DTensors, keyed by parameter name): no gather."""
        assert self.model is not None
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards of ``optimizer``'s state, keyed by parameter name."""
        assert self.model is not None
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return get_optimizer_state_dict(self.model, inner)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at rank 0's ``filepath`` with every rank (``bcp.save`` is
        collective: each rank writes its shards of the weights and optimizer states;
        the rest, rank 0's, is stored once), replacing a checkpoint already there."""
        if LAYOUT_KEY in checkpoint:
            raise ValueError(f"the checkpoint dict has a key {LAYOUT_KEY!r}, which {type(self).__name__} reserves")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping of bcp storage options, not {storage_options!r}")
        uri = self.broadcast(checkpoint_uri(filepath))
        rest = {k: _to_device(v, torch.device("cpu")) for k, v in checkpoint.items() if k not in SHARDED_KEYS}
        # rank 0's, as Lightning saves it: a value that differs on another rank would be stored per rank
        rest, layout = self.broadcast((rest, layout_of(checkpoint)))
        state = {k: checkpoint[k] if k in SHARDED_KEYS else rest[k] for k in layout}
        if isinstance(state.get("state_dict"), dict) and self.model is not None:  # BatchNorm's: rank 0's, not a mix
            state["state_dict"] = lowest_rank_buffers(self.model, dict(state["state_dict"]))
        state[LAYOUT_KEY] = layout
        info = save(
            state,
            uri,
            overwrite=True,
            allow_pickle=self.allow_pickle,
            storage_options={**self.storage_options, **(storage_options or {})} or None,
            metadata={"integration": "lightning", "strategy": type(self).__name__},
        )
        log.debug("saved Lightning checkpoint %s (%s)", uri, info)

    def _read_head(
        self, uri: str, allow_pickle: bool, options: dict[str, Any] | None
    ) -> tuple[Any, dict[Any, Any]] | BaseException:
        """(global rank 0) The stored layout and the load template's top-level entries
        (tensors on the meta device: only their shapes travel), or the error to raise on
        every rank."""
        try:
            with open_checkpoint(uri, allow_pickle=allow_pickle, storage_options=options) as reader:
                if LAYOUT_KEY not in reader.object_keys():
                    raise CheckpointError(
                        f"{uri} holds no {LAYOUT_KEY!r}: it was not saved by {type(self).__name__} or BcpCheckpointIO"
                    )
                layout = reader.read_object(LAYOUT_KEY)
                if "state_dict" not in layout:
                    raise KeyError(f"{uri} holds no 'state_dict' (the weights) to load")
                shapes = {k: _placeholder(reader, k) for k in layout if k not in SHARDED_KEYS}
        except Exception as e:  # noqa: BLE001 - broadcast, then raised on every rank
            return e
        return layout, {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in shapes.items()}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load rank 0's ``checkpoint_path`` on every rank: the weights (and, when fitting,
        the optimizer states) in place, resharded from whatever layout and number of
        ranks saved them; returns the rest of the dict (loops, callbacks, schedulers...)."""
        uri = self.broadcast(checkpoint_uri(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        allow_pickle = self.allow_pickle and weights_only is not True
        options = self.storage_options or None
        # rank 0 reads the layout and the catalog; the load below fetches the metadata once
        # for every rank too, so no rank reads it on its own
        head = self.broadcast(self._read_head(uri, allow_pickle, options) if self.global_rank == 0 else None)
        if isinstance(head, BaseException):
            raise head  # on every rank
        assert head is not None, "rank 0 broadcast the head"
        layout, shapes = head
        template: dict[Any, Any] = {
            k: torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v for k, v in shapes.items()
        }
        template[LAYOUT_KEY] = None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []
        template["state_dict"] = get_model_state_dict(self.model)
        if optimizers:
            stored = layout.get("optimizer_states")
            if stored is None:
                raise KeyError(
                    f"{uri} holds no 'optimizer_states' (saved with weights only?): training cannot resume from it"
                )
            if len(stored) != len(optimizers):
                raise RuntimeError(
                    f"{len(optimizers)} optimizers are configured but {uri} holds the states of {len(stored)}"
                )
            template["optimizer_states"] = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        strict = self.lightning_module.strict_loading
        skipped = "optimizer_states" in layout and not optimizers  # not fitting: the weights only
        info = load_with_info(
            template, uri, strict=strict and not skipped, allow_pickle=allow_pickle, storage_options=options
        )
        if strict and skipped:  # what a strict load refuses, but for the optimizer states left out
            unexpected = [k for k in info.unexpected if not k.startswith("optimizer_states.")]
            if info.missing or unexpected or info.kind_mismatch:
                raise StateMismatchError(
                    uri,
                    missing=list(info.missing),
                    unexpected=unexpected,
                    shape_mismatch=[],
                    dtype_mismatch=[],
                    kind_mismatch=[(k, "one kind", "the other") for k in info.kind_mismatch],
                )
        loaded = info.state
        set_model_state_dict(self.model, loaded["state_dict"], options=StateDictOptions(strict=strict))
        for optimizer, state in zip(optimizers, loaded.get("optimizer_states", []), strict=False):
            set_optimizer_state_dict(self.model, optimizer, state)
        return {k: apply_layout(layout[k], loaded[k]) for k in layout if k not in SHARDED_KEYS}

    def remove_checkpoint(self, filepath: Any) -> None:
        """:func:`bcp.delete` the checkpoint at ``filepath``, from global rank 0 (what is
        not a bcp checkpoint is left, with a warning)."""
        if self.is_global_zero:
            remove_checkpoint_at(checkpoint_uri(filepath), self.storage_options)


class BcpModelParallelStrategy(_ShardedBcp, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism, applied in
    ``configure_model``) with checkpoints saved, loaded and removed through bcp:
    ``Trainer(strategy=BcpModelParallelStrategy())``. Each rank saves its own shards
    (never gathered), and a checkpoint loads on any number of ranks and any mesh.
    ``storage_options`` and ``allow_pickle`` are :class:`BcpCheckpointIO`'s; the other
    arguments are ``ModelParallelStrategy``'s (its ``save_distributed_checkpoint``
    must stay True: a bcp checkpoint is always sharded)."""

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        *,
        storage_options: Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("save_distributed_checkpoint", True) is not True:
            raise ValueError(f"{type(self).__name__} saves sharded checkpoints only: save_distributed_checkpoint=True")
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint=True, **kwargs)
        self._bcp_setup(storage_options, allow_pickle)


class BcpFSDPStrategy(_ShardedBcp, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) with checkpoints saved, loaded and removed
    through bcp, sharded: ``Trainer(strategy=BcpFSDPStrategy(...))``. Without a
    ``device_mesh`` argument it gives FSDP a 1-D mesh of every rank, so that FSDP's
    sharded state dicts are DTensors (bcp refuses the legacy ShardedTensors).
    ``state_dict_type`` must stay "sharded". Not run on a GPU in this project's tests yet."""

    def __init__(
        self, *args: Any, storage_options: Mapping[str, Any] | None = None, allow_pickle: bool = False, **kwargs: Any
    ) -> None:
        if kwargs.setdefault("state_dict_type", "sharded") != "sharded":
            raise ValueError(f"{type(self).__name__} saves sharded checkpoints only: state_dict_type='sharded'")
        super().__init__(*args, **kwargs)
        self._bcp_setup(storage_options, allow_pickle)

    def setup_environment(self) -> None:
        super().setup_environment()
        if "device_mesh" not in self.kwargs and "process_group" not in self.kwargs:
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))
