"""CheckpointManager: save every N steps, keep the right ones, resume from the newest.

Layout under the root URI: one bcp checkpoint per step in ``step_<10 digits>/``,
and ``latest.json`` (written after each commit, for people and tools). A step is
committed when its manifest exists; nothing else is trusted, so the manager works
on every backend (no rename) and a crashed save is never mistaken for a checkpoint.

(all ranks) ``save``, ``wait``, ``load_latest``, ``close`` are collective in a
multi-process job: every rank calls them. Only the coordinator (rank 0 of the
group) writes ``latest.json``, applies retention and deletes; ``load_latest``
broadcasts the coordinator's choice of step so every rank loads the same one.
Its collectives run on the caller's lane of bcp's groups, each operation after a
rendezvous of every rank (``bcp.coordination.lanes``); an async save's commit runs on the
background lane, so a pending save never shares a group with the manager's own
collectives or with ``bcp.save`` / ``bcp.load`` calls made meanwhile.
``process_group=bcp.LOCAL`` keeps a manager of this process alone (a rank-0-only hook).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, Unpack

from bcp import trace
from bcp.async_save import AsyncSaveHandle, async_save, reserve_staging
from bcp.backends import join_uri
from bcp.backends.retry import retry_count
from bcp.commit import DEFAULT_GRACE_SECONDS
from bcp.coordination.collectives import Coordinator, decide
from bcp.coordination.lanes import ready
from bcp.discovery import base_step, committed_steps
from bcp.incremental import on_newest_base
from bcp.io_scheduler.staging import StagingReservation
from bcp.loader import load_with_info
from bcp.manager_inputs import checked_step, stored_metrics
from bcp.metadata.keys import step_name
from bcp.metrics import MetricsCallback, MetricsRecord, stage_gbps
from bcp.options import LoadOptions, LoadOptionsKwargs, SaveOptions, SaveOptionsKwargs
from bcp.retention import RetentionPolicy, check_policy, plan_gc, run_gc, write_latest
from bcp.saver import SaveInfo, save
from bcp.schedule.auto import AutoInterval
from bcp.schedule.interval import IntervalPolicy, IntervalReport
from bcp.schedule.preemption import Agreement, Preemption, Verdict, Watch, choose_tier
from bcp.target import resolve_backend
from bcp.tiers import LocalTier
from bcp.tiers.recover import RecoveryInfo, recover_latest_with_info
from bcp.tiers.tier import Tier
from bcp.trace import StageTotal

log = logging.getLogger(__name__)


#: Save options the manager sets itself (from its constructor and the step).
_OWNED = frozenset({"metadata", "storage_options", "process_group"})


class CheckpointManager:
    """Keeps a training run's checkpoints under ``root_uri``.

    Retention (applied after each commit, only to committed steps; the newest is
    always kept): ``keep_last=N`` newest steps, ``keep_every=K`` steps that are
    multiples of K, ``keep_best=(metric, N, "min"|"max")`` best N by a metric passed
    to :meth:`save`. No policy: keep everything. ``async_save=True``: :meth:`save`
    returns once the state is staged in memory; the write finishes in the background
    and is committed (and retention applied) before the next save starts, or at
    :meth:`wait`; one still in flight when the process exits is finished first (an
    exit hook waits for it). Incomplete steps left by crashed saves are deleted when
    the manager starts and after each commit, once older than ``gc_grace_seconds``
    (younger ones may be saves of another process). Housekeeping never fails a save:
    a deletion that fails is logged as a warning and retried at the next commit.

    ``tier=bcp.LocalTier(...)`` adds the local tier (docs/tiers.md): :meth:`save`
    then saves every ``tier.every`` steps to each host's memory (replicated to other
    hosts) and copies every ``tier.persist_every`` steps to ``root_uri``; other steps
    are not saved. Without it, every :meth:`save` goes to ``root_uri``.

    ``metrics=callback`` calls ``callback(bcp.MetricsRecord)`` once per save (when it completes) and once
    per load (docs/observability.md); saves and loads are then traced in memory (``trace=True``).

    ``incremental=True``: each save to ``root_uri`` writes only the pieces changed since the newest committed
    step, referring to its bytes for the rest, kept until no kept step reads them (docs/manager.md).

    :meth:`step`, called at every training step, saves when a save is due
    (``interval=N``: every N steps; with a tier, the tier's ``every`` and
    ``persist_every``; None without a tier: only on a preemption notice;
    ``"auto"`` or a ``bcp.IntervalPolicy``: each tier's interval chosen from what the
    manager measures, docs/manager.md "Interval", :meth:`report`) and, with
    ``preemption=bcp.Preemption(...)``, saves and returns True once any rank got a
    notice (docs/manager.md, "Preemption").
    """

    def __init__(
        self,
        root_uri: str | os.PathLike,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, int, str] | None = None,
        async_save: bool = True,
        storage_options: dict | None = None,
        process_group: Any = None,
        overlap: Any = None,
        gc_grace_seconds: float = DEFAULT_GRACE_SECONDS,
        tier: LocalTier | None = None,
        metrics: MetricsCallback | None = None,
        preemption: Preemption | None = None,
        interval: int | Literal["auto"] | IntervalPolicy | None = None,
        incremental: bool = False,
    ) -> None:
        check_policy(keep_last, keep_every, keep_best)
        policy = _policy_of(interval, tier)
        self.interval = None if policy is not None else _check_interval(interval, tier)
        if preemption is not None and not isinstance(preemption, Preemption):
            raise TypeError(f"preemption must be a bcp.Preemption or None, got {type(preemption).__name__}")
        if gc_grace_seconds < 0:
            raise ValueError(f"gc_grace_seconds must be >= 0, got {gc_grace_seconds}")
        self.gc_grace_seconds = gc_grace_seconds
        self.root_uri = os.fspath(root_uri)
        self.policy: RetentionPolicy = {"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best}
        self.async_save = async_save
        self.incremental = bool(incremental)
        self.storage_options = dict(storage_options or {})
        self.process_group = process_group
        self.overlap = overlap
        self.backend = resolve_backend(self.root_uri, self.storage_options)
        self._pending: tuple[AsyncSaveHandle, int] | None = None
        self.metrics = metrics
        #: the save whose record is due: (step, retry count at the call, seconds the call blocked,
        #: perf_counter seconds at the call)
        self._due: tuple[int, int, float, float] | None = None
        self._reservation: StagingReservation | None = None
        #: the newest measured save time of each tier ("local", "persistent"): call to commit, seconds
        self.save_seconds: dict[str, float | None] = {"local": None, "persistent": None}
        #: the step of the newest save started (a preemption save does not save it twice)
        self._started: int | None = None
        #: the step at which :meth:`step` returned True (it keeps returning True)
        self._stopped_at: int | None = None
        # every group its saves, commits, drains and loads use, before any of them (bcp.coordination.lanes.ready)
        lanes: tuple[str, ...] = ("drain",) if tier is not None else ()
        lanes += ("preemption",) if preemption is not None else ()
        self._lanes = ready(process_group, "CheckpointManager()", lanes=lanes)
        #: preemption's handlers and per-step agreement (None: off, and step() runs no collective)
        self._watch: Watch | None = None
        self._agreement: Agreement | None = None
        if preemption is not None:
            self._agreement = Agreement(self._lanes.lane("preemption"))
            self._watch = Watch(preemption)
        coord = self._lanes.caller
        # a restart: check every kept step once; a failure raises on every rank
        decide(coord, "cleaning up the checkpoint root", self._housekeeping, None)
        self._tier: Tier | None = None
        if tier is not None:
            if not isinstance(tier, LocalTier):
                raise TypeError(f"tier must be a bcp.LocalTier, got {type(tier).__name__}")
            self._tier = Tier(
                tier,
                self.root_uri,
                storage_options=self.storage_options,
                process_group=process_group,
                lanes=self._lanes,
                housekeeping=self._housekeeping,
            )
        #: interval="auto": the policy and its measurements (None: another interval)
        self._auto: AutoInterval | None = None
        if policy is not None:
            self._auto = AutoInterval(policy, self._lanes.caller, self.backend)
            self._auto.start()  # (all ranks) the restart record, and the newest step's estimates
        if self._watch is not None:
            self._watch.install()

    @property
    def preemption(self) -> Watch | None:
        """The preemption watch (its ``notice``; ``notify()`` gives a notice from code), or None."""
        return self._watch

    # -- queries (local, no collectives) --------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (one listing of the root)."""
        return committed_steps(self.backend)

    def latest(self) -> int | None:
        """The newest committed step, or None. Never an uncommitted one."""
        steps = self.steps()
        return steps[-1] if steps else None

    def uri(self, step: int) -> str:
        return join_uri(self.root_uri, step_name(step))

    # -- collective operations ----------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: dict[str, float] | None = None,
        options: SaveOptions | None = None,
        **overrides: Unpack[SaveOptionsKwargs],
    ) -> SaveInfo | None:
        """(all ranks) Checkpoint ``state`` as ``step``. ``metrics`` (numbers) are
        stored in the manifest for ``keep_best``. ``options`` and keyword arguments
        are those of ``bcp.save`` (:class:`SaveOptions`), except the ones the manager
        owns: ``metadata``, ``storage_options`` and ``process_group``. Returns the
        SaveInfo when synchronous. With a local tier, its schedule says where (docs/tiers.md):
        a step due for draining that the local tier did not save goes to the root."""
        given = set(overrides)
        if options is not None:
            given |= {name for name in _OWNED if getattr(options, name) is not None}
        owned = sorted(_OWNED & given)
        if owned:
            raise TypeError(
                f"CheckpointManager.save: {', '.join(owned)} belong to the manager; pass them to its constructor"
            )
        return self._save(step, state, metrics, SaveOptions.of(options, overrides))

    def _save(
        self,
        step: int,
        state: Any,
        metrics: dict[str, float] | None,
        opts: SaveOptions,
        to: Literal["local", "persistent"] | None = None,
        due: tuple[bool, bool] | None = None,
    ) -> SaveInfo | None:
        """(all ranks) :meth:`save` once its options are checked. ``to``: this tier, whatever
        the tier's schedule says (a preemption save); a local save that some host has no
        room for is then not made (``self._started`` says whether a save started).
        ``due``: (local, drain) instead of the tier's schedule (``interval="auto"``)."""
        step = checked_step(step)
        self._wait_pending()
        called, retries = time.perf_counter(), retry_count()
        if self.metrics is not None and opts.trace is None:
            opts = dataclasses.replace(opts, trace=trace.directory_of(None) or True)
        meta: dict[str, Any] = {"bcp_manager": {"step": step, "metrics": stored_metrics(metrics, step)}}
        if self._auto is not None:  # the estimates a restarted job starts from, and bcp ls shows
            meta["bcp_manager"]["interval"] = self._auto.metadata()
        opts = dataclasses.replace(
            opts, metadata=meta, storage_options=self.storage_options or None, process_group=self.process_group
        )
        if self._tier is not None and to != "persistent":
            route = self._tier.save(step, state, opts, self.overlap, due=(True, False) if to == "local" else due)
            if route == "local":  # a "persistent" one has not started: the root's save below
                self._started = step
                self._due = (step, retries, time.perf_counter() - called, called)
                if not self.async_save:  # the record: when the local save and its replication are done
                    info = self._wait_pending()
                    self._tier.wait_drain()
                    return info
            if route != "persistent":
                return None
        # incremental: on the newest committed step, the coordinator's choice
        newest = (lambda: self._newest(step)) if self.incremental and opts.base is None else None
        started = on_newest_base(opts, newest, lambda chosen: self._start(step, state, chosen))
        self._started = step  # not before: a save that raised saved nothing, a preemption save is still owed
        if isinstance(started, AsyncSaveHandle):
            self._pending = (started, step)
            self._due = (step, retries, started.blocking_seconds, called)
            return None
        self._committed(step, "CheckpointManager.save")
        self._report_save(started, (step, retries, started.seconds, called), "persistent")
        return started

    def _start(self, step: int, state: Any, opts: SaveOptions) -> SaveInfo | AsyncSaveHandle:
        if self.async_save:
            return async_save(state, self.uri(step), opts, overlap=self.overlap)
        return save(state, self.uri(step), opts)

    def _newest(self, step: int) -> str | None:
        base = decide(self._coord("CheckpointManager.save"), "choosing the base", base_step, self.backend, step)
        return None if base is None else self.uri(base)

    def step(self, step: int, state: Any, *, metrics: dict[str, float] | None = None) -> bool:
        """(all ranks, at every training step, after the step) Save ``step`` when due;
        True: the job should stop now. Cheap when nothing is due: with preemption on,
        one all-reduce of four numbers on bcp's own group; off, no collective.

        Once any rank got a preemption notice (a signal, before or during this call's
        predecessors: a save, a load, a collective), every rank saves ``step`` to the
        fastest tier expected to commit within the deadline, waits for the commit and
        returns True, here and at every later call. When no tier can commit in time,
        nothing new is saved (WARNING): the last committed checkpoint stays the newest."""
        if self._stopped_at is not None:
            return True
        if self._agreement is not None:
            assert self._watch is not None
            verdict = self._agreement.exchange(self._watch, self.save_seconds)
            if verdict.stop:  # stopped once saved: a save that raised is still owed at the next call
                self._preempted(step, state, metrics, verdict)
                self._stopped_at = step
                return True
        if self._auto is not None:
            self._auto_step(step, state, metrics)
            return False
        if self._tier is not None:
            config = self._tier.config
            due = config.local_due(step) or config.drain_due(step)
        else:
            due = isinstance(self.interval, int) and step % self.interval == 0
        if due:
            self.save(step, state, metrics)
        return False

    def _auto_step(self, step: int, state: Any, metrics: dict[str, float] | None) -> None:
        """(all ranks) ``interval="auto"``: save ``step`` to the tiers due; the ranks then agree."""
        auto = self._auto
        assert auto is not None
        local, persistent = auto.due(step, auto.policy.tiers)
        if local or persistent:
            called = time.perf_counter()
            # a drain copies a local step: a persistent save with a tier is a local one drained
            due = (True, persistent) if self._tier is not None else None
            self._save(step, state, metrics, SaveOptions(), due=due)
            auto.saved(step, local or (persistent and due is not None), persistent, time.perf_counter() - called)
        auto.returned()

    def report(self) -> IntervalReport | None:
        """``interval="auto"``: the intervals chosen, the expected waste per hour and the inputs with their sources
        (agreed: the same on every rank); None otherwise."""
        return self._auto.policy.report() if self._auto is not None else None

    def _preempted(self, step: int, state: Any, metrics: dict[str, float] | None, verdict: Verdict) -> None:
        """(all ranks, the same ``verdict``) The preemption save of ``step``, waited for."""
        watch, agreement = self._watch, self._agreement
        assert watch is not None and agreement is not None
        if watch.notice is not None:
            log.warning(
                "preemption: %s arrived %.1f s before step %d on this rank; every rank saves and stops",
                watch.notice.name,
                time.monotonic() - watch.notice.at,
                step,
            )
        if self._started == step:  # save() or step() saved this step already: only its commit is left
            self.wait()
            return
        # the save in flight commits first: the deadline left is agreed again once it has
        self._wait_pending()
        verdict = agreement.exchange(watch, self.save_seconds)
        tier, expected = choose_tier(verdict, self._tier is not None)
        if tier == "local":
            saved = self._save(step, state, metrics, SaveOptions(), to="local")  # SaveInfo: made, waited for
            # made and replicated; None: some host had no room (WARNING logged): the root, if it fits
            if self._started != step or (saved is None and self._wait_pending() is None):
                persistent = verdict.estimates["persistent"]
                fits = verdict.remaining is None or persistent is None or persistent <= verdict.remaining
                tier, expected = ("persistent", persistent) if fits else (None, persistent)
        if tier == "persistent":
            self._save(step, state, metrics, SaveOptions(), to="persistent")
        if tier is None and self._lanes.caller.is_coordinator:
            log.warning(
                "preemption: step %d is not saved: its save is expected to take %.1f s to commit, more than the "
                "%.1f s left of the deadline (grace_seconds=%g); the last committed checkpoint stays the newest",
                step,
                expected if expected is not None else float("nan"),
                verdict.remaining if verdict.remaining is not None else float("nan"),
                watch.config.grace_seconds,
            )
        self.wait()

    def wait(self) -> SaveInfo | None:
        """(all ranks) Finish the save in flight, if any: commit, retention, pointer;
        with a local tier, its replication and the drain in flight too."""
        info = self._wait_pending()
        if self._tier is not None:
            self._tier.wait_drain()
        return info

    def _wait_pending(self) -> SaveInfo | None:
        """(all ranks) Finish the save in flight (a local one with its replication), not a drain.
        One that failed saved nothing: its step is no longer started (a preemption save is owed)."""
        try:
            local = self._tier.wait_local() if self._tier is not None else None
            if self._pending is None:
                if local is not None:
                    self._report_save(local, self._due, "local")
                return local
            handle, step = self._pending
            self._pending = None
            info = handle.wait()
        except BaseException:
            self._started = None
            raise
        self._committed(step, "CheckpointManager.wait")
        self._report_save(info, self._due, "persistent")
        return info

    def _report_save(self, info: SaveInfo, due: tuple[int, int, float, float] | None, tier: str) -> None:
        """Hand the metrics callback the record of a completed save. A local save's
        total runs to the end of its replication (``Tier.done_at``), which a
        synchronous manager waits for: then it is the blocking time too."""
        self._due = None
        if due is None:
            return
        step, retries, blocking, called = due
        total = info.seconds
        if tier == "local" and self._tier is not None:
            total = max(self._tier.done_at - called, blocking)
            if not self.async_save:
                blocking = total
        self.save_seconds["local" if tier == "local" else "persistent"] = total
        if self._auto is not None:
            self._auto.committed("local" if tier == "local" else "persistent", blocking, total)
        if self.metrics is None:
            return
        self.metrics(
            MetricsRecord(
                step=step,
                kind="save",
                blocking_seconds=blocking,
                total_seconds=total,
                bytes=info.rank_bytes_written,
                gbps=stage_gbps(info.stages),
                retries=retry_count() - retries,
                tier="local" if tier == "local" else "persistent",
            )
        )

    def _report_load(
        self, step: int, nbytes: int, stages: Mapping[str, StageTotal], since: tuple[float, int], tier: str
    ) -> None:
        """Hand the metrics callback the record of a load that ``load_latest`` started at
        ``since`` (perf_counter seconds, retry count); ``interval="auto"``: its recovery time."""
        called, retries = since
        seconds = time.perf_counter() - called
        if self._auto is not None:
            self._auto.loaded(step, seconds, "local" if tier == "local" else "persistent")
        if self.metrics is not None:
            self.metrics(
                MetricsRecord(
                    step=step,
                    kind="load",
                    blocking_seconds=seconds,
                    total_seconds=seconds,
                    bytes=nbytes,
                    gbps=stage_gbps(stages),
                    retries=retry_count() - retries,
                    tier="local" if tier == "local" else "persistent",
                )
            )

    def load_latest(
        self, state: Any, options: LoadOptions | None = None, **overrides: Unpack[LoadOptionsKwargs]
    ) -> tuple[int | None, Any]:
        """(all ranks) Load the newest committed step into ``state``; returns
        ``(step, loaded state)``, or ``(None, state)`` when there is none yet.
        With ``async_save``, once the load is done (pinning would compete with it)
        it also starts allocating the staging memory this rank's saves of ``state``
        will need, in the background (``bcp.reserve_staging``), so the first save of
        the run finds it pinned."""
        self.wait()
        since = (time.perf_counter(), retry_count())  # the load's own cost, from here
        # the manager's storage options and process group, whichever tier the step comes from
        opts = dataclasses.replace(
            LoadOptions.of(options, overrides),
            storage_options=self.storage_options or None,
            process_group=self.process_group,
        )
        if self.metrics is not None and opts.trace is None:
            opts = dataclasses.replace(opts, trace=trace.directory_of(None) or True)
        if self._tier is not None:
            # the local tier's recovery (docs/tiers.md, "Recovering"): a local step newer than the root's
            recovered = self._recover_from_local_tier(state, opts)
            if recovered is not None:
                self._report_load(recovered.step, recovered.load.bytes_read, recovered.stages, since, "local")
                self.reserve_staging(state)
                return recovered.step, recovered.state
        step = decide(self._coord("CheckpointManager.load_latest"), "finding the latest step", self.latest)
        if step is None:
            self.reserve_staging(state)
            return None, state
        info = load_with_info(state, self.uri(step), opts)
        self._report_load(step, info.bytes_read, info.stages, since, "persistent")
        self.reserve_staging(state)
        return step, info.state

    def _recover_from_local_tier(self, state: Any, opts: LoadOptions) -> RecoveryInfo | None:
        """(all ranks) Load the newest complete local step when it is at least as new
        as the root's newest (docs/tiers.md, "Recovering"); None: load from the root."""
        assert self._tier is not None
        return recover_latest_with_info(
            state,
            local_root=self._tier.root,
            persistent_root=self.root_uri,
            coord=self._coord("CheckpointManager.load_latest"),
            load_options=opts,
            exchange_coord=self._tier.drain_coord,  # free: load_latest waited for the drains
            config=self._tier.config,  # how many steps a lost local tier may have cost
            hosts=self._tier.hosts,  # gathered when the tier started: one round less
        )

    def reserve_staging(self, state: Any) -> None:
        """(all ranks) Start allocating staging memory for async saves of ``state`` in
        the background, sized from the boxes this rank will write (after
        deduplication) and the store's part size; done once per manager
        (``load_latest`` calls it)."""
        if self.async_save and self._reservation is None:
            self._reservation = reserve_staging(
                state,
                part_size=self.backend.hints.part_size,
                collective=True,
                process_group=self.process_group,
            )

    def close(self) -> None:
        """(all ranks) Finish the save in flight (commit, retention, pointer), then put
        preemption's handlers back (a signal during that commit is a notice, not death)."""
        try:
            self.wait()
        finally:
            if self._watch is not None:
                self._watch.uninstall()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        if self._pending is not None or self._tier is not None:  # an error in training: still finish what was staged
            try:
                self.wait()
            except Exception:  # logged: the training error is the one to report
                log.exception("the checkpoint in flight failed while handling another error")
        if self._watch is not None:
            self._watch.uninstall()

    # -- coordinator only -------------------------------------------------------------------------

    def _coord(self, operation: str) -> Coordinator:
        """The coordinator of one collective operation of the manager (caller lane)."""
        return ready(self.process_group, operation).caller

    def _committed(self, step: int, operation: str) -> None:
        # Only the step just written can have gained an unused generation (an overwrite).
        decide(self._coord(operation), "applying retention", self._housekeeping, [step])

    def _housekeeping(self, generations_of: list[int] | None) -> None:
        """One listing: retention, garbage, then the pointer to the newest step. Best
        effort: a failure is a warning (the checkpoint is committed; retention is
        retried at the next commit), never an error that stops training or a save."""
        busy = [self._pending[1]] if self._pending is not None else []
        try:
            plan = plan_gc(
                self.backend,
                busy=busy,
                generations_of=generations_of,
                grace_seconds=self.gc_grace_seconds,
                **self.policy,
            )
        except Exception as e:  # noqa: BLE001 - retention is retried at the next commit
            log.warning("retention skipped at %s: %s", self.backend.uri, e)
            return
        if not plan.empty:
            log.info(
                "retention: deleting steps %s, incomplete %s, unused generations %s, partial files %d",
                plan.expired,
                plan.incomplete,
                plan.orphan_generations,
                len(plan.unfinished),
            )
        run_gc(self.backend, plan)  # logs each deletion that fails
        if plan.committed:
            try:
                write_latest(self.backend, plan.committed[-1])  # the newest is always kept
            except Exception as e:  # noqa: BLE001 - latest.json is for people; bcp trusts manifests
                log.warning("could not update %s at %s: %s", "latest.json", self.backend.uri, e)


def _check_interval(interval: Any, tier: LocalTier | None) -> int | None:
    """The ``interval`` of :meth:`CheckpointManager.step`, checked: steps, or None."""
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"CheckpointManager: interval must be an int >= 1, 'auto' or None, got {interval!r}")
    if tier is not None:
        raise ValueError(
            f"CheckpointManager: interval={interval} and tier= both set when to save; with a tier, its every and "
            f"persist_every do: pass interval=None"
        )
    return interval


def _policy_of(interval: Any, tier: LocalTier | None) -> IntervalPolicy | None:
    """``interval="auto"`` (a policy for the manager's tiers) or a given policy, checked; None: another interval."""
    tiers = ("local", "persistent") if tier is not None else ("persistent",)
    if isinstance(interval, IntervalPolicy):
        if interval.tiers != tiers:
            raise ValueError(
                f"CheckpointManager: interval policy for tiers {interval.tiers}, the manager saves to {tiers}: "
                f"pass bcp.IntervalPolicy(tiers={tiers})"
            )
        return interval
    return IntervalPolicy(tiers=tiers) if isinstance(interval, str) and interval == "auto" else None
