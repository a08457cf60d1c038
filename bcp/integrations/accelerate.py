"""Accelerate's ``save_state`` / ``load_state`` through bcp: ``enable(accelerator, uri)``.

Accelerate's own ``save_state`` writes a folder of files (safetensors for the
weights, pickles for the rest) and its hooks (``register_save_state_pre_hook``) run
*before* those writes and can only filter the weights: no public hook replaces the
writing. So :func:`enable` gives that one ``Accelerator`` object its own
``save_state`` and ``load_state`` (instance attributes; the class is untouched),
which save one bcp checkpoint holding everything accelerate saves for plain and DDP
training: every prepared model (unwrapped: names without ``module.``), optimizer and
scheduler, the dataloaders' state (stateful dataloaders; the seedable sampler of an
iterable dataset), the gradient scaler, each rank's RNG states (Python, NumPy,
torch, CUDA) and step counter, and every object registered with
``register_for_checkpointing``. ``ProjectConfiguration(automatic_checkpoint_naming=
True)`` names checkpoints ``<uri>/checkpoints/checkpoint_<iteration>`` and
``total_limit`` deletes the oldest with :func:`bcp.delete`.

``save_state`` is collective, like accelerate's (every process calls it);
``load_state`` reads on each process by itself. FSDP, DeepSpeed and Megatron-LM keep
their own checkpoint code in accelerate: enabling bcp for them is refused.

What differs between processes is saved as accelerate saves it: the models' buffers
(BatchNorm's running statistics, updated by each process's forward until DDP
broadcasts the main process's at the next one) and the registered objects are the
main process's; the dataloaders' state and the RNG states are each process's own,
given back to the same process (at another number of processes: the main process's
dataloader state to every process, an RNG state only to a process that saved one).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from bcp.backends import join_uri
from bcp.deletion import delete, exists
from bcp.extras import needs_extra
from bcp.reader import open_checkpoint
from bcp.saver import save
from bcp.shards import PerRank
from bcp.target import resolve_backend
from bcp.training import rng_state, set_rng_state

with needs_extra("accelerate", "bcp.integrations.accelerate"):
    from accelerate import Accelerator
    from accelerate.utils import broadcast, broadcast_object_list

log = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoints/checkpoint_(\d+)/manifest\.json$")
_OWN_CHECKPOINTING = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def checkpoint_uri(root: str, iteration: int) -> str:
    """Where automatic naming puts checkpoint ``iteration`` under ``root``."""
    return join_uri(root, f"checkpoints/checkpoint_{iteration}")


def saved_iterations(root: str, storage_options: Mapping[str, Any] | None = None) -> list[int]:
    """The iterations of the committed checkpoints under ``root``, oldest first."""
    backend = resolve_backend(root, storage_options)
    found = (_NAME.match(key) for key in backend.list("checkpoints/"))
    return sorted(int(m.group(1)) for m in found if m)


class BcpState:
    """The bcp-backed ``save_state`` / ``load_state`` of one Accelerator (:func:`enable`)."""

    def __init__(
        self,
        accelerator: Accelerator,
        uri: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
    ) -> None:
        kind = accelerator.distributed_type
        if kind.name in _OWN_CHECKPOINTING:
            raise NotImplementedError(
                f"bcp.integrations.accelerate: {kind} keeps its own checkpoint code in accelerate; "
                "bcp supports single-process and multi-process (DDP) training"
            )
        self.accelerator, self.uri = accelerator, str(uri)
        self.storage_options = dict(storage_options or {}) or None
        self.allow_pickle = allow_pickle

    # -- where -----------------------------------------------------------------------

    def _target(self, given: Any, *, saving: bool) -> str:
        config = self.accelerator.project_configuration
        if config.automatic_checkpoint_naming:
            if not saving and given is not None:
                return str(given)
            if saving:
                return checkpoint_uri(self.uri, config.iteration)
            done = saved_iterations(self.uri, self.storage_options)
            if not done:
                raise FileNotFoundError(f"no checkpoint under {self.uri}/checkpoints to load")
            return checkpoint_uri(self.uri, done[-1])
        if given is None:
            raise ValueError("No output/input URI given and automatic_checkpoint_naming is disabled.")
        return str(given)

    def _prune(self) -> None:
        """Delete the oldest checkpoints so that one more stays within ``total_limit``."""
        limit = self.accelerator.project_configuration.total_limit
        if limit is None or not self.accelerator.is_main_process:
            return
        done = saved_iterations(self.uri, self.storage_options)
        for iteration in done[: max(0, len(done) + 1 - limit)]:
            log.info("total_limit=%d: deleting checkpoint_%d", limit, iteration)
            delete(checkpoint_uri(self.uri, iteration), storage_options=self.storage_options)

    # -- what ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything accelerate's save_state saves, as one bcp state."""
        acc = self.accelerator
        models = [acc.unwrap_model(m) for m in acc._models]
        custom = [o.state_dict() for o in acc._custom_objects]
        many = acc.num_processes > 1
        if custom and many:  # where processes differ: the main process's, as accelerate saves
            custom = broadcast_object_list(custom, from_process=0)
        state: dict[str, Any] = {
            "models": {str(i): _main_process_buffers(m) if many else m.state_dict() for i, m in enumerate(models)},
            "optimizers": {str(i): o.state_dict() for i, o in enumerate(acc._optimizers)},
            "schedulers": {str(i): s.state_dict() for i, s in enumerate(acc._schedulers)},
            "dataloaders": PerRank({str(i): _loader_state(d) for i, d in enumerate(acc._dataloaders)}),
            "custom": {str(i): value for i, value in enumerate(custom)},
            "rng": PerRank({"step": acc.step, **rng_state()}),
            "iteration": acc.project_configuration.iteration,
        }
        if acc.scaler is not None:
            state["scaler"] = acc.scaler.state_dict()
        return state

    def save_state(self, output_dir: Any = None, **_ignored: Any) -> str:
        """``Accelerator.save_state`` through bcp: returns the checkpoint's URI."""
        acc = self.accelerator
        target = self._target(output_dir, saving=True)
        if acc.project_configuration.automatic_checkpoint_naming:
            self._prune()
            if exists(target, storage_options=self.storage_options):
                raise ValueError(
                    f"Checkpoint {target} ({acc.save_iteration}) already exists. "
                    "Please manually override `self.save_iteration` with what iteration to start with."
                )
        acc.wait_for_everyone()
        save(
            self.state(),
            target,
            overwrite=True,
            storage_options=self.storage_options,
            metadata={"integration": "accelerate"},
            allow_pickle=self.allow_pickle,
        )
        acc.project_configuration.iteration += 1
        log.info("saved the accelerate state to %s", target)
        return target

    def load_state(self, input_dir: Any = None, **_ignored: Any) -> str:
        """``Accelerator.load_state`` through bcp: returns the checkpoint's URI."""
        acc = self.accelerator
        source = self._target(input_dir, saving=False)
        rank = acc.process_index
        with open_checkpoint(source, storage_options=self.storage_options, allow_pickle=self.allow_pickle) as reader:
            saved_by = reader.manifest.world_size
            # each process's own dataloader state; at another number of processes the main process's
            saved = reader.state(per_rank=rank if saved_by == acc.num_processes else 0)
            rng = reader.read_object("rng", rank) if reader.is_per_rank("rng") and rank < saved_by else None
            rng = saved.get("rng") if saved_by == 1 and rank == 0 else rng  # one process: stored job-wide
        for section, objects in (("models", [acc.unwrap_model(m) for m in acc._models]),
                                 ("optimizers", acc._optimizers), ("schedulers", acc._schedulers),
                                 ("custom", acc._custom_objects)):  # fmt: skip
            if len(saved.get(section, {})) != len(objects):
                raise RuntimeError(
                    f"{source} holds {len(saved.get(section, {}))} {section} but {len(objects)} are prepared "
                    "or registered: load into the same set of objects that saved it"
                )
            for i, obj in enumerate(objects):
                obj.load_state_dict(saved[section][str(i)])
        for i, loader in enumerate(acc._dataloaders):
            _load_loader_state(loader, saved.get("dataloaders", {}).get(str(i)))
        if acc.scaler is not None and "scaler" in saved:
            acc.scaler.load_state_dict(saved["scaler"])
        if rng is None:
            log.warning("no RNG state saved for process %d in %s: RNG states not restored", rank, source)
        else:
            set_rng_state(rng)
            acc.step = int(rng["step"])
        if acc.project_configuration.automatic_checkpoint_naming and isinstance(saved.get("iteration"), int):
            acc.project_configuration.iteration = saved["iteration"] + 1  # the next save_state does not collide
        log.info("loaded the accelerate state from %s", source)
        return source


def _main_process_buffers(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` with its buffers as the main process holds them (called on
    every process of several): DDP broadcasts them from there at the next forward, and
    accelerate saves the main process's. Copies: the model's own buffers stay as they are."""
    state = model.state_dict()
    buffers = {name for name, _b in model.named_buffers()}
    for key, value in state.items():  # one order on every process: the state_dict's
        if key in buffers:
            state[key] = broadcast(value.detach().clone(), from_process=0)
    return state


def _loader_state(loader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(loader, "use_stateful_dataloader", False):
        out["state_dict"] = loader.state_dict()
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
        out["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
    return out


def _load_loader_state(loader: Any, state: Mapping[str, Any] | None) -> None:
    if not state:
        return
    if "state_dict" in state and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(state["state_dict"])
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if "sampler" in state and sampler is not None:
        sampler.epoch, sampler.initial_seed = state["sampler"]["epoch"], state["sampler"]["initial_seed"]


def enable(
    accelerator: Accelerator,
    uri: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
) -> BcpState:
    """Send ``accelerator.save_state()`` / ``load_state()`` through bcp. ``uri``: where
    automatic checkpoint naming puts ``checkpoints/checkpoint_<n>`` (any bcp URI);
    without automatic naming, ``save_state(uri)`` / ``load_state(uri)`` name each
    checkpoint. ``allow_pickle``: save and load what bcp cannot store as data (a
    ``deque`` in a registered object), pickled, as ``bcp.save`` and ``bcp.open`` do.
    Returns the :class:`BcpState`; :func:`disable` undoes it."""
    bcp_state = BcpState(accelerator, uri, storage_options, allow_pickle=allow_pickle)
    accelerator.save_state = bcp_state.save_state
    accelerator.load_state = bcp_state.load_state
    return bcp_state


def disable(accelerator: Accelerator) -> None:
    """Give ``accelerator`` back accelerate's own ``save_state`` / ``load_state``."""
    for name in ("save_state", "load_state"):
        accelerator.__dict__.pop(name, None)
