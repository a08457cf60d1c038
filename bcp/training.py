"""One-call save and resume of a training job: model, optimizer, scheduler,
dataloader, RNG and your own values, for plain, DDP, FSDP2 and TP models alike.

:class:`TrainingState` is a Stateful (``state_dict()`` / ``load_state_dict()``):
``bcp.save({"train": ts}, uri)`` and ``bcp.load({"train": ts}, uri)`` work, and so
do its shortcuts ``ts.save(uri)`` / ``ts.load(uri)``, which also pass
:func:`reshard_per_rank` as the ``reshard_objects`` hook so that a checkpoint saved
by N ranks resumes on M. Model and optimizer go through
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``):
FQN-keyed, DTensor-aware, the DDP ``module.`` and ``torch.compile`` ``_orig_mod.``
prefixes removed, so one checkpoint fits every wrapping.

RNG (saved per rank): torch CPU, CUDA of the rank's current device (restored on
the current device of the rank that resumes, whatever its index), numpy's global
generator and python's ``random``. Resumed at another world size, rank ``r`` takes
saved rank ``r``'s state when there was one; each rank beyond the saved count gets a
fresh state seeded from a SHA-256 of every saved rank's torch state and its own rank:
deterministic, and different from every other rank's.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, Unpack, cast

import numpy as np
import torch
import torch.distributed as dist

from bcp.dataloader import is_dataloader_state, is_sampler_state, reshard_dataloader_states
from bcp.errors import UnsupportedStateError
from bcp.extras import missing_extra
from bcp.loader import LoadInfo, load_with_info
from bcp.options import LoadOptionsKwargs, SaveOptionsKwargs
from bcp.saver import SaveInfo, save
from bcp.shards import LowestRankCopy, PerRank, is_dtensor
from bcp.state import is_stateful, taken_for_save, taking_for_save
from bcp.target import Target

log = logging.getLogger(__name__)

#: marks an RNG state captured by :func:`rng_state`
RNG_MARK = "bcp_rng"
#: a key in each saved param group of an optimizer that had not stepped yet (no state)
UNSTEPPED_MARK = "bcp_unstepped"


class CudaRng:
    """The CUDA RNG calls bcp makes (tests replace :data:`cuda_rng`)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def get_state(self, device: int) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_state(self, state: torch.Tensor, device: int) -> None:
        torch.cuda.set_rng_state(state, device)

    def seeded_state(self, seed: int) -> torch.Tensor:
        """A state in the CUDA generator's own format (not the CPU generator's 5,056
        bytes, which ``set_state`` refuses), seeded with ``seed``."""
        return torch.Generator(device="cuda").manual_seed(seed).get_state()


#: The seam tests replace with a fake.
cuda_rng = CudaRng()


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA of the current device (the one this
    rank uses: ``cuda_device``, None without CUDA), numpy, python."""
    cuda_device = cuda_rng.get_state(cuda_rng.current_device()) if cuda_rng.available() else None
    return {
        RNG_MARK: 1,
        "torch": torch.get_rng_state(),
        "cuda_device": cuda_device,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured. The saved current device's CUDA state
    goes to this process's current device, whatever its index (a resume on another
    host layout keeps each rank's stream of random numbers). A state saved by an
    older bcp (``cuda``: one state per visible device) goes to the devices by index;
    a count that differs is logged."""
    torch.set_rng_state(state["torch"])
    available = cuda_rng.available()
    if "cuda_device" in state:
        if state["cuda_device"] is not None:
            if available:
                cuda_rng.set_state(state["cuda_device"], cuda_rng.current_device())
            else:
                log.warning("RNG state saved with a CUDA device restored without one: its CUDA state is dropped")
    else:
        cuda = list(state.get("cuda", []))
        visible = cuda_rng.device_count() if available else 0
        if len(cuda) != visible:
            log.warning("RNG state saved with %d CUDA devices restored on %d", len(cuda), visible)
        for i, device_state in enumerate(cuda[:visible]):
            cuda_rng.set_state(device_state, i)
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _had_cuda(saved: Mapping[str, Any]) -> bool:
    return saved.get("cuda_device") is not None or bool(saved.get("cuda"))


def derived_rng_state(values: Mapping[int, Mapping[str, Any]], rank: int) -> dict[str, Any]:
    """A fresh RNG state for ``rank``, which no saved rank had: seeded from a digest
    of every saved rank's torch state and ``rank``. Its CUDA state (when the saved
    ranks had one and this process has CUDA) is made by a CUDA generator, in that
    generator's format."""
    digest = hashlib.sha256()
    for saved in sorted(values):
        digest.update(bytes(values[saved]["torch"].numpy()))
    digest.update(b"rank" + rank.to_bytes(8, "little"))
    seed = int.from_bytes(digest.digest()[:8], "little")
    with_cuda = any(_had_cuda(v) for v in values.values()) and cuda_rng.available()
    return {
        RNG_MARK: 1,
        "torch": torch.Generator().manual_seed(seed).get_state(),
        "cuda_device": cuda_rng.seeded_state((seed + 1) % 2**64) if with_cuda else None,
        "numpy": np.random.RandomState(seed % 2**32).get_state(),
        "python": random.Random(seed).getstate(),
    }


def is_rng_state(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get(RNG_MARK) == 1


def reshard_rng_states(values: Mapping[int, Mapping[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG state in a world of ``world_size``: saved rank ``rank``'s
    when it existed (a shrinking world drops the rest), else a derived fresh one."""
    del world_size  # every rank decides alone; the rule needs only its own rank
    return dict(values[rank]) if rank in values else derived_rng_state(values, rank)


def reshard_per_rank(fqn: str, values: dict[int, Any], rank: int, world_size: int) -> Any:
    """The ``reshard_objects`` hook :class:`TrainingState` loads with: RNG states
    (:func:`reshard_rng_states`), ShardedSampler and StatefulDataLoader states
    (:func:`bcp.dataloader.reshard_dataloader_states`); any other per-rank object is
    refused naming its key, never copied from one rank to all."""
    if not values:
        raise UnsupportedStateError(f"per-rank object {fqn!r} has no saved values")
    if all(is_rng_state(v) for v in values.values()):
        return reshard_rng_states(values, rank, world_size)
    if all(is_sampler_state(v) or is_dataloader_state(v) for v in values.values()):
        return reshard_dataloader_states(values, rank, world_size, fqn=fqn)
    raise UnsupportedStateError(
        f"per-rank object {fqn!r} was saved by {len(values)} ranks and bcp cannot tell what rank {rank} of "
        f"{world_size} should get: pass your own reshard_objects hook (see docs/distributed.md)"
    )


def _check_dataloader(dataloader: Any) -> None:
    """TypeError at construction, not at the first save, for a dataloader whose position
    cannot be saved (torch's own DataLoader), naming the one that can and its extra."""
    if callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None)):
        return
    hint = missing_extra("dataloader", "StatefulDataLoader")
    raise TypeError(
        f"TrainingState(dataloader=...) needs a dataloader with state_dict() and load_state_dict(), so that its "
        f"position is saved and restored; {type(dataloader).__qualname__} does not have both. Use torchdata's "
        "StatefulDataLoader (from torchdata.stateful_dataloader import StatefulDataLoader; it takes the same "
        f"arguments as torch.utils.data.DataLoader){'. ' + hint if hint else ''}"
    )


class TrainingState:
    """Everything a training job resumes from, as one Stateful.

    ``model`` (a module, possibly DDP, FSDP2 ``fully_shard`` or TP), ``optimizer``
    (one or a sequence), ``scheduler`` (anything with state_dict/load_state_dict),
    ``dataloader`` (saved per rank: a torchdata ``StatefulDataLoader`` or anything
    with state_dict/load_state_dict), ``extra`` (a dict of your own values, updated
    in place on load; one with load_state_dict, a GradScaler, loads into itself),
    ``rng`` (save and restore the RNG states, per rank)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        dataloader: Any = None,
        extra: MutableMapping[str, Any] | None = None,
        *,
        rng: bool = True,
    ) -> None:
        if dataloader is not None:
            _check_dataloader(dataloader)
        self.model, self.scheduler, self.dataloader, self.rng = model, scheduler, dataloader, rng
        if optimizer is None:
            self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = (optimizer,)
        else:
            self.optimizers = tuple(optimizer)
        self.extra: MutableMapping[str, Any] = {} if extra is None else extra
        self._cache: _StateDictCache | None = None
        #: the optimizers' parameter groups (FQN sets) of the last load template (:func:`_group_names`)
        self._groups: list[frozenset[str]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The job's state as bcp saves it; with a fresh optimizer, the template a load
        fills (get_state_dict gives its state already in the current layout).

        ``get_state_dict`` fills an optimizer that has no state yet by a dummy step at
        learning rate 0 (so that its state has keys and shapes): that state is dropped
        again here, so that asking for the state (a save, a load's template, a fresh
        run's ``load_latest``) leaves such an optimizer as it was; its saved param
        groups carry :data:`UNSTEPPED_MARK` when bcp saves them (not in a load's template:
        ``bcp.state.taken_for_save``), and a load of them leaves it without state.

        After the first call with stepped optimizers, get_state_dict's FQN mapping is
        reused (:class:`_StateDictCache`): the same result, read live from
        ``model.state_dict()`` and ``optimizer.state_dict()``, at about their cost."""
        unstepped = [not optim.state for optim in self.optimizers]
        model_sd, optim_sd = self._model_and_optim(unstepped)
        if taken_for_save():
            model_sd = lowest_rank_buffers(self.model, model_sd)
        state: dict[str, Any] = {"model": model_sd}
        if self.optimizers:
            # marked only in what bcp saves: in a load's template the mark would be a key a
            # strict load (DCP's) finds missing from a checkpoint of a stepped optimizer
            marked = taken_for_save() and any(unstepped)
            state["optim"] = _mark_unstepped_groups(optim_sd, self.optimizers, unstepped) if marked else optim_sd
            if not taken_for_save():  # a load's template: the groups a load must find in the checkpoint
                self._groups = _group_names(optim_sd)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.dataloader is not None:
            state["dataloader"] = PerRank(self.dataloader.state_dict())
        if self.rng:
            state["rng"] = PerRank(rng_state())
        state["extra"] = dict(self.extra)
        return state

    def _model_and_optim(self, unstepped: Sequence[bool]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``get_state_dict(model, optimizers)``; after the first call, the same result from
        ``model.state_dict()`` and each ``optimizer.state_dict()`` renamed through the FQN
        mapping the first call learned (:class:`_StateDictCache`), while the model's keys
        and parameters and the optimizers' parameters are the ones it learned them from
        and every optimizer has stepped (else the full path, which learns again)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not any(unstepped) and self._cache is not None:
            fast = self._cache.state_dicts(self.model, self.optimizers)
            if fast is not None:
                return fast
        cache = _StateDictCache.before(self.model, self.optimizers) if not any(unstepped) else None
        # torch skips its dummy step when any parameter has a gradient (a save between backward() and the
        # first step()): the state would then take another form than a fresh template's. Set aside meanwhile.
        grads = [
            (p, p.grad)
            for o, fresh in zip(self.optimizers, unstepped, strict=True)
            if fresh
            for g in o.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        for p, _grad in grads:
            p.grad = None
        # a load's template also has state for the fresh optimizers' frozen parameters (the dummy step skips those
        # not requiring a gradient): a checkpoint of a run that unfroze them later holds some (fit_template keeps
        # only what it holds)
        frozen = [] if taken_for_save() else _frozen_params(self.optimizers, unstepped)
        for p in frozen:
            p.requires_grad_(True)
        try:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        finally:
            for p, grad in grads:
                p.grad = grad
            for p in frozen:
                p.requires_grad_(False)
        for optim, fresh in zip(self.optimizers, unstepped, strict=True):
            if fresh:
                optim.state.clear()  # the dummy step's state; its lr 0 changed no parameter
        self._cache = cache.learn(model_sd) if cache is not None else None
        return model_sd, optim_sd

    def fit_template(self, template: dict[str, Any], stored: Callable[[str], bool]) -> dict[str, Any]:
        """``template`` (this object's ``state_dict()`` for a load) fitted to a checkpoint
        holding the keys below it that ``stored`` says: with fresh optimizers (their state
        a dummy step's, for every parameter that requires a gradient), state only for the
        parameters the checkpoint holds some for, or the optimizer as the one object a save
        between backward() and the first step() made. The load calls it for a TrainingState
        anywhere in its state (:meth:`load`, ``bcp.load``, ``load_latest``)."""
        if "optim" not in template or any(o.state for o in self.optimizers):
            return template
        if stored("optim"):
            return {**template, "optim": None}
        state = template["optim"].get("state", {})
        kept = {fqn: v for fqn, v in state.items() if any(stored(f"optim.state.{fqn}.{k}") for k in v)}
        return template if len(kept) == len(state) else {**template, "optim": {**template["optim"], "state": kept}}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Put a loaded state back into model, optimizer, scheduler, dataloader, RNG and extra.
        ``strict=False``: the model's keys are not checked either (``load`` matched them).
        A parameter may lack optimizer state either way: Adam keeps none for one that never
        had a gradient, and torch's strict check refuses its own ``get_state_dict`` of it
        (a rollback into a stepped optimizer failed with the weights already loaded)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.optimizers:  # first, as set_state_dict does
            _check_groups(_group_names(state["optim"]), self._groups)
            lenient = StateDictOptions(strict=False)
            # torch leaves out the state of a parameter not requiring a gradient: one frozen now may have some
            frozen = _frozen_params(self.optimizers, [True] * len(self.optimizers))
            for p in frozen:
                p.requires_grad_(True)
            try:
                set_optimizer_state_dict(self.model, self.optimizers, state["optim"], options=lenient)
            finally:
                for p in frozen:
                    p.requires_grad_(False)
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=strict))
        for optim in self.optimizers:
            marked = [group.pop(UNSTEPPED_MARK, False) for group in optim.param_groups]
            if marked and all(marked):  # saved before its first step: no state, as then
                optim.state.clear()
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.dataloader is not None:
            self.dataloader.load_state_dict(_unwrap(state["dataloader"]))
            # a StatefulDataLoader's state_dict() makes the resumed iterator now, which the next iter() returns:
            # its draw from the global RNG (the base seed) comes before the RNG is put back, not after
            self.dataloader.state_dict()
        if self.rng:
            set_rng_state(_unwrap(state["rng"]))
        for key, value in state.get("extra", {}).items():  # a Stateful of yours (a GradScaler) loads in place
            mine = self.extra.get(key)
            if mine is not None and is_stateful(mine) and isinstance(value, Mapping):
                mine.load_state_dict(value)
            else:
                self.extra[key] = value

    def save(self, uri: Target, **options: Unpack[SaveOptionsKwargs]) -> SaveInfo:
        """``bcp.save`` of this state (collective when torch.distributed is initialised)."""
        with taking_for_save():
            state = self.state_dict()
        return save(state, uri, **options)

    def load(self, uri: Target, **options: Unpack[LoadOptionsKwargs]) -> LoadInfo:
        """``bcp.load`` into this state, resharding per-rank objects with
        :func:`reshard_per_rank` unless ``reshard_objects`` is given."""
        options.setdefault("reshard_objects", reshard_per_rank)
        # this object as the whole state: the load asks it for its template, fits that to the
        # checkpoint (fit_template) and hands it what was loaded, as for one anywhere in a state
        return load_with_info(cast(Mapping[str, Any], self), uri, **options)


def lowest_rank_buffers(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the model's state dict, any FQNs) with each of the model's buffers that
    is a plain tensor wrapped in :class:`~bcp.shards.LowestRankCopy`, when several ranks
    run: found by the memory they share. Ranks update BatchNorm's running statistics on
    their own batches, so the copies differ at a save; DDP broadcasts rank 0's at the next
    forward and FSDP2 never syncs them, so each is stored from its lowest-ranked holder
    (rank 0 of its data-parallel group) instead of failing the replica check. Changed in
    place (``state`` is the caller's own new dict) and returned."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return state
    held = {(b.data_ptr(), b.dtype, b.shape) for b in model.buffers() if b.numel() and not is_dtensor(b)}
    if held:
        for key, value in state.items():
            if type(value) is torch.Tensor and (value.data_ptr(), value.dtype, value.shape) in held:
                state[key] = LowestRankCopy(value)
    return state


def _group_names(optim_sd: Any) -> list[frozenset[str]] | None:
    """Each parameter group's FQNs in ``get_state_dict``'s optimizer state (None: not one)."""
    groups = optim_sd.get("param_groups") if isinstance(optim_sd, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        return None
    return [frozenset(map(str, g["params"])) for g in groups]


def _check_groups(saved: list[frozenset[str]] | None, live: list[frozenset[str]] | None) -> None:
    """UnsupportedStateError when the checkpoint's optimizer holds the same parameters as
    this one's in other groups (merged, split or moved): torch's set_optimizer_state_dict
    takes them, giving parameters the other group's learning rate and weight decay. A
    set of parameters that differs (a head added, loaded non-strictly) is not compared."""
    if saved is None or live is None or saved == live or frozenset().union(*saved) != frozenset().union(*live):
        return
    raise UnsupportedStateError(
        f"the optimizer's parameter groups differ from the checkpoint's: it saved {len(saved)} group(s) of "
        f"{[len(g) for g in saved]} parameters, this one has {len(live)} of {[len(g) for g in live]}; loading would "
        "give parameters another group's hyperparameters. Build the optimizer with the saved groups"
    )


def _frozen_params(optimizers: Sequence[torch.optim.Optimizer], unstepped: Sequence[bool]) -> list[torch.Tensor]:
    """The parameters of the optimizers marked ``unstepped`` that require no gradient now."""
    return [
        p
        for optim, fresh in zip(optimizers, unstepped, strict=True)
        if fresh
        for group in optim.param_groups
        for p in group["params"]
        if not p.requires_grad
    ]


class _StateDictCache:
    """What ``get_state_dict`` computes that does not change between saves: the model's
    state_dict keys and their renames to canonical FQNs (DDP's ``module.``, compile's
    ``_orig_mod.``), and each optimizer's parameter index -> FQN.

    Valid while the model's state_dict has the same keys with the same parameter objects
    under them, and each optimizer holds the same parameter objects in the same order
    (the cache holds them, so their ids stay theirs); values are always the live ones,
    read at the call by one ``model.state_dict(keep_vars=True)`` (detached here, as
    ``model.state_dict()`` detaches them) and each ``optimizer.state_dict()``, as the
    full path reads them. FSDP1 (``FullyShardedDataParallel`` wrappers) is never
    cached: its state dicts go through FSDP's own context."""

    def __init__(self, live: dict[str, Any], optim_params: list[list[torch.Tensor]]) -> None:
        self.keys = list(live)
        self.params = [(k, v) for k, v in live.items() if isinstance(v, torch.nn.Parameter)]  # held: ids stay theirs
        self.param_ids = [(k, id(v)) for k, v in self.params]
        self.optim_params = optim_params
        self.optim_ids = [[id(p) for p in ps] for ps in optim_params]
        self.renames: list[tuple[str, str]] = []
        self.pid_fqns: list[list[str | None]] = []

    @classmethod
    def before(cls, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> _StateDictCache | None:
        """The structure to learn from, taken before the full path (None for FSDP1, or a
        parameter the state dict does not hold under its name)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if FullyShardedDataParallel.fsdp_modules(model):
            return None
        live = model.state_dict(keep_vars=True)
        if any(live.get(name) is not param for name, param in model.named_parameters()):
            return None
        return cls(live, [_optim_params(o) for o in optimizers])

    def learn(self, model_sd: Mapping[str, Any]) -> _StateDictCache | None:
        """The renames that take the model's state_dict keys to ``model_sd``'s (the full
        path's result), found as get_model_state_dict makes them: kept keys stay in
        place, renamed ones move to the end in order; None when that does not explain
        ``model_sd`` (nothing cached). Optimizer indices map through the names of their
        parameters (the first key holding each: named_parameters' order), renamed the
        same way."""
        raw, out = self.keys, list(model_sd)
        if len(raw) != len(out) or len(set(out)) != len(out):
            return None
        out_set = set(out)
        kept = [k for k in raw if k in out_set]
        moved = [k for k in raw if k not in out_set]
        if out[: len(kept)] != kept or not all(
            _is_wrapper_rename(k, fqn) for k, fqn in zip(moved, out[len(kept) :], strict=True)
        ):
            return None
        rename = dict(zip(moved, out[len(kept) :], strict=True))
        fqn_of: dict[int, str] = {}
        for key, param in self.params:
            fqn_of.setdefault(id(param), rename.get(key, key))
        self.renames = list(rename.items())
        self.pid_fqns = [[fqn_of.get(i) for i in ids] for ids in self.optim_ids]
        return self

    def state_dicts(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """What ``get_state_dict`` gives now, or None when the cache does not fit."""
        live = model.state_dict(keep_vars=True)
        if list(live) != self.keys or any(id(live[k]) != i for k, i in self.param_ids):
            return None
        if len(optimizers) != len(self.optim_ids):
            return None
        if any([id(p) for p in _optim_params(o)] != ids for o, ids in zip(optimizers, self.optim_ids, strict=True)):
            return None
        model_sd = live  # model.state_dict()'s own dict (its type and version metadata), detached in place
        for k, v in live.items():
            if isinstance(v, torch.Tensor):
                model_sd[k] = v.detach()
        for key, fqn in self.renames:
            model_sd[fqn] = model_sd.pop(key)
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for optim, fqns in zip(optimizers, self.pid_fqns, strict=True):
            osd = optim.state_dict()
            for pid, value in osd["state"].items():
                name = fqns[pid] if isinstance(pid, int) and 0 <= pid < len(fqns) else None
                if name is None:
                    return None  # the full path raises for it
                state[name] = value
            for group in osd["param_groups"]:
                names = [fqns[pid] for pid in group["params"]]
                if None in names:
                    return None
                group["params"] = names
                groups.append(group)
        return model_sd, {"state": state, "param_groups": groups}


def _optim_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _is_wrapper_rename(key: str, fqn: str) -> bool:
    """Whether ``fqn`` is ``key`` without some wrapper segments (``module``,
    ``_orig_mod``, activation checkpointing's ``_checkpoint_wrapped_module``): the only
    renames get_model_state_dict makes."""
    parts = iter(key.split("."))
    for name in fqn.split("."):
        for seg in parts:
            if seg == name:
                break
            if seg not in ("module", "_orig_mod", "_checkpoint_wrapped_module"):
                return False
        else:
            return False
    return all(seg in ("module", "_orig_mod", "_checkpoint_wrapped_module") for seg in parts)


def _mark_unstepped_groups(
    optim_sd: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], unstepped: Sequence[bool]
) -> dict[str, Any]:
    """``optim_sd`` with :data:`UNSTEPPED_MARK` in the param groups of the optimizers that
    had not stepped (get_state_dict lists every optimizer's groups in order)."""
    if not any(unstepped):
        return optim_sd
    marks = [fresh for optim, fresh in zip(optimizers, unstepped, strict=True) for _group in optim.param_groups]
    groups = optim_sd["param_groups"]
    if len(groups) != len(marks):
        log.warning("get_state_dict gave %d param groups for %d: none marked unstepped", len(groups), len(marks))
        return optim_sd
    marked = [{**group, UNSTEPPED_MARK: True} if mark else group for group, mark in zip(groups, marks, strict=True)]
    return {**optim_sd, "param_groups": marked}


def _unwrap(value: Any) -> Any:
    """A template value a non-strict load left in place is still wrapped."""
    return value.value if isinstance(value, PerRank) else value
