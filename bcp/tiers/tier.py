"""The local tier of one CheckpointManager: when to save locally, when to drain.

``CheckpointManager(root, tier=LocalTier(...))`` builds one :class:`Tier`. Its
``save`` runs on every rank for every ``manager.save`` call:

* a step that is a multiple of ``every``: the room check, then an async bcp save in
  which each rank writes to its own host's local root; once it commits, its
  background thread spreads the metadata, records the holdings, replicates, starts
  the drain when the step is a multiple of ``persist_every``, and applies local
  retention (``local_save.py``, ``drain.py``, ``local_retention.py``);
* a step due for draining that the local tier did not save (not a multiple of
  ``every``, or no room on some host): the manager saves it to persistent storage
  as it would without a tier.

Collectives run in a fixed order on every rank: the main thread's on the
caller's lane of bcp's groups, a save's commit and replication on the background
lane, a drain's on a lane of its own ("drain"), all created with the manager
(``bcp.coordination.lanes.ready``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from bcp.async_save import AfterCommit, AsyncSaveHandle, async_save
from bcp.backends import join_uri
from bcp.coordination.collectives import decide, run_phase
from bcp.coordination.lanes import Lanes
from bcp.metadata.keys import MANIFEST_KEY, step_name
from bcp.options import SaveOptions
from bcp.planning.cache import plan_cache_for
from bcp.save_phases import SaveInfo, SaveJob
from bcp.target import resolve_backend
from bcp.tiers.config import LocalTier
from bcp.tiers.drain import Drain, drain_step
from bcp.tiers.fast_save import Verdict, save_fast
from bcp.tiers.hosts import HostMap, warn_if_short
from bcp.tiers.job import job_identity, make_step_dir, stamp
from bcp.tiers.local_retention import apply_retention, remove_stale, remove_step
from bcp.tiers.local_save import LocalStep, after_commit, holds_own_files
from bcp.tiers.paths import check_apart, local_root, make_private_root, step_backend, step_dir
from bcp.tiers.room import Statvfs, check_room, own_record, state_bytes

log = logging.getLogger(__name__)


Route = Literal["local", "persistent", "none"]


class Tier:
    """The local tier's state in one process (one per manager)."""

    def __init__(
        self,
        config: LocalTier,
        root_uri: str,
        *,
        storage_options: Mapping[str, Any] | None,
        process_group: Any,
        lanes: Lanes,
        housekeeping: Callable[[list[int] | None], None],
    ) -> None:
        """(all ranks, collective) Learn the hosts. ``lanes``: the manager's groups,
        ready (``bcp.coordination.lanes.ready``), a "drain" lane among them."""
        coord = lanes.caller
        self.config = config
        self.root_uri = root_uri
        self.storage_options = dict(storage_options or {})
        self.coord = coord
        self.housekeeping = housekeeping
        self.root = local_root(config.dir, root_uri)
        check_apart(self.root, root_uri)

        def private_root() -> str:
            # the user's own dir, possibly a link (/local -> /mnt/nvme); check_trusted_dir (below, in
            # make_private_root) then refuses it unless every directory to its target is root's or the user's
            os.makedirs(config.dir, mode=0o700, exist_ok=True)  # link-ok: see above
            return make_private_root(config.dir, root_uri)

        # a refusal on one host raises on every rank (the others would wait in the next collective)
        self.root = run_phase(coord, "creating the local tier's directory", private_root)
        self.hosts = HostMap.gather(coord)
        #: this job's id (job.py): the persistent root's, read or created by the coordinator
        self.job: str = decide(
            coord,
            "reading the local tier's job id",
            lambda: job_identity(resolve_backend(root_uri, self.storage_options)),
        )
        if self.is_host_first:  # every rank agrees that every host's first rank stamped its root
            run_phase(coord, "binding the local root to the job", stamp, self.root, self.job)
        else:
            run_phase(coord, "binding the local root to the job", lambda: None)
        if coord.is_coordinator:
            warn_if_short(self.hosts, config.replicas)
        #: the drain's lane, created with the manager's: groups are created collectively, in one order
        self.drain_coord = lanes.lane("drain")
        #: an async local save's commit and replication (the fast path hands it over itself)
        self.background_coord = lanes.background
        #: how free space is read (tests replace it)
        self.statvfs: Statvfs = os.statvfs
        self._local: tuple[AsyncSaveHandle, int] | None = None
        self._drain: Drain | None = None
        #: this rank's data file size at the last local save (the room check's estimate)
        self._last_bytes: int | None = None
        self._pinned: set[int] = set()
        #: perf_counter seconds when the last local save was complete: committed, spread and replicated
        self.done_at = 0.0
        self._pin_lock = threading.Lock()
        #: (the same on every rank) whether the next local save takes the fast path
        #: (``fast_save.py``): the previous one committed, planned and fitted in staging
        self._fast = False
        #: (set by the save's thread, read after it) whether every rank's staging fitted
        self._fits = False
        #: this rank's writes of the last plan made on the caller's thread: (plan key, indices)
        self._reuse: tuple[bytes, np.ndarray] | None = None
        #: whether the last local save started took the fast path (tests, logs)
        self.last_fast = False
        #: (the same on every rank) the newest local step this tier committed: an incremental
        #: local save's base (None: the next one writes every byte; ``config.incremental``)
        self._base: int | None = None

    @property
    def is_host_first(self) -> bool:
        return self.hosts.is_first(self.coord.rank)

    # -- the main thread -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        opts: SaveOptions,
        overlap: Any,
        *,
        due: tuple[bool, bool] | None = None,
    ) -> Route:
        """(all ranks) Save ``step`` locally when due and there is room. Returns
        "local", "persistent" (the manager must save it to persistent storage) or
        "none" (nothing is due at this step). The caller waited for the previous save.
        ``due``: (local, drain) instead of ``every`` and ``persist_every`` (a
        preemption save: local, not drained)."""
        cfg = self.config
        local_due, drain = due if due is not None else (cfg.local_due(step), cfg.drain_due(step))
        if drain:
            self.wait_drain()  # one drain at a time; a failed one raises here, on every rank
        if not local_due:
            return "persistent" if drain else "none"
        own = self._last_bytes if self._last_bytes is not None else state_bytes(state)
        base = self._agreed_base(step) if cfg.incremental else None
        local_opts = dataclasses.replace(
            opts,
            storage_options=None,
            overwrite=False,
            incremental=cfg.incremental,
            base=None if base is None else step_dir(self.root, base),
        )
        hook = AfterCommit(
            run=lambda job, info: self._after_commit(job, info, step, drain, base),
            visible_ranks=frozenset(self.hosts.ranks[self.hosts.host_of(0)]),
        )
        # the same on every rank; an incremental save digests and matches its pieces: never the fast path
        self.last_fast = self._fast and not drain and opts.trace is None and not cfg.incremental
        if self.last_fast:
            key, writes = self._reuse if self._reuse is not None else (b"", None)
            handle = save_fast(
                state,
                step_backend(self.root, step),
                local_opts,
                self.background_coord,
                self.hosts,
                key=key,
                writes=writes,
                room=lambda: own_record(self.root, own, cfg.replicas, cfg.keep_free, self.statvfs),
                before_plan=lambda: self._remove_stale(step),
                on_skip=lambda verdict: self._skipped(verdict, step),
                overlap=overlap,
                after_commit=hook,
            )
            self._local = (handle, step)
            return "local"
        short = check_room(self.coord, self.hosts, self.root, own, cfg.replicas, cfg.keep_free, self.statvfs)
        if short:
            return "persistent" if drain else "none"
        self._remove_stale(step)
        handle = async_save(state, step_backend(self.root, step), local_opts, overlap=overlap, after_commit=hook)
        held = plan_cache_for(self.coord.cache_key).held()
        self._reuse = list(held.items())[-1] if held else None  # the plan just made: newest
        self._local = (handle, step)
        return "local"

    def _agreed_base(self, step: int) -> int | None:
        """(all ranks, collective) The base of an incremental local save of ``step``: the
        previous local step this tier committed, when every host still holds its manifest
        (each rank reads the base's catalog on its own host); else None (a full save)."""
        prev = self._base
        if prev is None or prev >= step:
            return None
        here = os.path.isfile(os.path.join(step_dir(self.root, prev), MANIFEST_KEY))
        return None if self.coord.any_failed(not here) else prev

    def _remove_stale(self, step: int) -> None:
        """(the host's first rank) Its copies of ``step`` and later ones, left by an earlier
        run, go; the step's directory is made and stamped with the job id before any data."""
        if self.is_host_first:
            with self._pin_lock:
                remove_stale(self.root, step, self._pinned, self.job)
            try:
                make_step_dir(step_dir(self.root, step), self.job)
            except OSError as e:  # this host's copy is then never loaded (no job id); never an error here
                log.warning("local tier: cannot stamp step %d under %s with the job id: %s", step, self.root, e)

    def _skipped(self, verdict: Verdict, step: int) -> None:
        """(the save's thread, every rank) A fast local save was skipped: a WARNING where
        the room check's would be (the coordinator's is logged already), or for a new plan
        on the coordinator; after a new plan, the next local save plans on the caller's thread.
        The step's directory, made and stamped by ``_remove_stale`` and empty of data, goes."""
        if self.is_host_first:
            with self._pin_lock:
                remove_step(self.root, step, self.job)
        if verdict.short:
            mine = self.hosts.hosts[self.hosts.host_of(self.coord.rank)]
            if self.is_host_first and mine in verdict.short and not self.coord.is_coordinator:
                log.warning("local tier: not enough room on this host, this step is not saved locally: %s", verdict.why)
            return
        self._fits = False
        if self.coord.is_coordinator:
            log.warning("local tier: this step is not saved locally: %s; the next local save plans anew", verdict.why)

    def wait_local(self) -> SaveInfo | None:
        """(all ranks) Finish the local save in flight (with its replication)."""
        if self._local is None:
            return None
        handle, _step = self._local
        self._local = None
        try:
            info = handle.wait_or_skipped()
        except BaseException:
            self._fast = False  # an error raises on every rank: the next save plans anew everywhere
            self._base = None  # and the next incremental save writes every byte
            raise
        self._fast = self._fits
        if info is not None:
            self._last_bytes = info.rank_bytes_written
            self._base = _step
        return info

    def wait_drain(self) -> None:
        """(all ranks) Finish the drain in flight, raising its error."""
        drain, self._drain = self._drain, None
        if drain is not None:
            drain.wait()

    def wait(self) -> SaveInfo | None:
        info = self.wait_local()
        self.wait_drain()
        return info

    # -- the save's background thread ------------------------------------------------------------

    def _after_commit(self, job: SaveJob, _info: SaveInfo, step: int, drain: bool, base: int | None) -> None:
        cfg = self.config
        # the next local save may stage before planning when every rank's chunks fit in its pool at once
        pipeline = job.pipeline
        self._fits = not job.coord.any_failed(len(pipeline.chunks()) > pipeline.pool.max_slabs)
        local = after_commit(
            job.coord, self.hosts, cfg.replicas, cfg.chunk_bytes, job.backend, step_dir(self.root, step), step, base
        )
        self.done_at = time.perf_counter()  # read after wait_local: the handle's event orders it
        if drain:
            self._start_drain(local, job.backend)
        if self.is_host_first and not holds_own_files(self.hosts, job.coord.rank, local, step_dir(self.root, step)):
            log.warning("local tier: this host does not hold step %d's own files (above): older local steps kept", step)
        elif self.is_host_first:
            try:
                with self._pin_lock:
                    apply_retention(self.root, step, cfg.keep, self._pinned, self.job)
            except OSError as e:  # one host's cleanup: retried at the next local save, never an error
                log.warning("local tier: retention under %s failed: %s", self.root, e)

    def _start_drain(self, local: LocalStep, backend: Any) -> None:
        step = local.step
        with self._pin_lock:
            self._pinned.add(step)

        def run() -> None:
            remote = resolve_backend(join_uri(self.root_uri, step_name(step)), self.storage_options)
            drain_step(
                self.drain_coord,
                backend,
                remote,
                local.manifest,
                local.catalog_bytes,
                local_parent=self.root,
                remote_parent=self.root_uri,
                storage_options=self.storage_options,
            )
            # the persistent root's retention and pointer, on the drain's group
            decide(self.drain_coord, "applying retention", self.housekeeping, [step])

        def unpin() -> None:
            with self._pin_lock:
                self._pinned.discard(step)

        self._drain = Drain(step, run, on_end=unpin).start()
