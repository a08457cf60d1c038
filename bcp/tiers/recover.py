"""Recovering from the local tier (docs/tiers.md, "Recovering").

All ranks call :func:`recover_latest_with_info` (``CheckpointManager.load_latest`` does, when a tier is configured), at
whatever world size the job restarted with:

1. **Inventory.** Each host's first rank lists its local root (:func:`bcp.tiers.inventory.list_local`); the coordinator
   gathers the listings.
2. **Choice.** The coordinator picks the newest local step that agreeing copies hold entirely
   (:func:`~bcp.tiers.inventory.choose_local`) and compares it with the persistent tier's newest committed step; the
   newer wins, a tie goes to the local one. Persistent (or nothing anywhere): :func:`recover_latest_with_info` returns
   None and the caller loads from persistent storage as before, with a WARNING when the local tier lost steps
   (:mod:`bcp.tiers.fallback`).
3. **Metadata.** The first rank of a host holding the chosen copy sends the manifest and catalog bytes to every rank
   (with the choice, in its broadcast, when that rank is the coordinator); every rank checks them (save id, catalog size
   and CRC32C).
4. **Recovery directory.** Each host not holding every data file gets ``<local root>/recover-<nonce>/``: the manifest,
   the catalog, a hard link to each data file the host holds whole, and a sparse file of the manifest's size for each
   other one (ranks of one host share it). A host holding every file loads from its local step directly (read-only).
5. **Fetch.** Each rank matches its template against the catalog (bcp's own ``match_state``, resharding included) and
   lists the byte ranges its load will read in files its host does not hold: the load's own read plan
   (``plan_tensor_reads``, the same boxes and replica choice), each run widened to the whole checksum blocks it touches,
   since the load verifies every block it reads from. One ``all_gather`` of those lists tells every rank the whole
   exchange; the ranges of one host's ranks are merged per file and each is asked once (by the lowest rank wanting part
   of it) from a rank of a host holding its file, the serving ranks balanced by bytes. The bytes move as uint8 tensors
   over bcp's gloo group (point-to-point), in rounds of at most ``round_bytes`` sent plus received per rank, and land at
   their offsets in the sparse files. The ranges also span the padding between two fragments wherever a coalesced read
   of the load spans it, so the load reads no byte its host did not fetch (one would read as zero and fail its block's
   CRC32C, unless zeros are what the block holds), and a read waits only for the bytes it reads. A host holding every
   data file of the step lists nothing and makes no read plan for it; when no host fetches anything (every rank present,
   or each host holding a whole copy) there is no exchange and step 6 is a plain load, at the cost of a load from the
   local root; when every host holds every file not even the ``all_gather`` of requests runs. The directory building and
   the request lists travel in one ``all_gather`` (an error on any rank raises on all).
6. **Load.** An ordinary load (:func:`bcp.loader.load_with_metadata`) from each host's recovery directory or local step,
   from the metadata of step 3 (not read or broadcast again): matching, resharding, casting, placement and the CRC32C
   check of every byte read are bcp's own. The directory is removed after. Every step ends in a round that agrees
   whether every rank succeeded (the load's phases do), so an error is raised on every rank or on none: a recovery that
   succeeded makes no round after the load's last (7 collective calls when every host holds every file, as many as a
   load from the persistent root).
7. **Corrupt copies.** A checksum or format error on any rank (every rank raises; each one's error travels in one
   ``all_gather``): each host checks the copies it served and quarantines the bad ones
   (:func:`bcp.tiers.recovery_dir.check_copy`), and all ranks start again from 1, without them: another host's copy, an
   older local step, or the persistent tier. A host out of room for its recovery directory (ENOSPC, EDQUOT): the
   persistent tier's step, with a WARNING (:func:`~bcp.tiers.fallback.no_room`).

With ``load_options.trace`` (or ``BCP_TRACE_DIR``) a recovery is traced as an operation of kind "recover"
(docs/observability.md): spans ``inventory`` (steps 1-2), ``metadata``, ``prepare`` and ``match`` (a host fetching),
``exchange`` (bytes received from peers) and the load's own spans (no ``catalog``: the metadata is step 3's); its stage
totals come back in :attr:`RecoveryInfo.stages`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bcp import trace
from bcp.coordination.collectives import Coordinator, GroupCoordinator, decide, portable
from bcp.errors import CorruptCheckpointError, FormatError, RankFailedError, StorageError
from bcp.loader import LoadInfo, load_with_metadata
from bcp.metadata import FileEntry, Manifest
from bcp.metadata.keys import MANIFEST_KEY, reference_key, step_name
from bcp.options import LoadOptions
from bcp.reader import CheckpointMetadata
from bcp.target import resolve_backend
from bcp.tiers.arrival import Arrivals, GatedBackend, HoleyFiles
from bcp.tiers.config import LocalTier
from bcp.tiers.exchange import CHUNK_BYTES, ROUND_BYTES, Exchange, wanted_ranges
from bcp.tiers.fallback import PersistentNewest, choose, give_up, no_room
from bcp.tiers.hosts import HostMap
from bcp.tiers.inventory import LocalChoice, StepCopy, list_local
from bcp.tiers.recovery_dir import (
    RECOVERY_PREFIX,
    BadCopy,
    check_copy,
    check_received,
    prepare,
    read_metadata,
    remove_leftovers,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecoveryInfo:
    """What a recovery from the local tier did on this rank."""

    step: int
    save_id: str
    #: the loaded state (``bcp.load``'s result)
    state: Mapping[str, Any]
    #: the whole recovery: inventory, choice, fetch and load
    seconds: float
    #: the exchange with peer hosts alone
    fetch_seconds: float
    #: bytes this rank read from its host's local root and sent to other ranks
    bytes_sent: int
    #: bytes this rank received from other hosts and wrote into its recovery directory
    bytes_received: int
    #: rounds of the exchange this rank took part in
    rounds: int
    #: the ordinary load from the recovery directory
    load: LoadInfo
    #: this rank's stages of the whole recovery (seconds active, bytes) when traced, else empty
    stages: Mapping[str, trace.StageTotal] = dataclasses.field(default_factory=dict, repr=False, compare=False)


def recover_latest_with_info(
    state: Any,
    *,
    local_root: str,
    persistent_root: str | None,
    coord: Coordinator,
    load_options: LoadOptions | None = None,
    round_bytes: int = ROUND_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
    exchange_coord: Coordinator | None = None,
    config: LocalTier | None = None,
    hosts: HostMap | None = None,
) -> RecoveryInfo | None:
    """(all ranks) Load the newest step the local tier holds entirely into ``state``,
    if it is not older than the persistent tier's newest committed step (at
    ``persistent_root``, read with ``load_options.storage_options``). Returns a
    :class:`RecoveryInfo`, or None: the caller loads from persistent storage.
    ``exchange_coord``: a coordinator of the same ranks on a gloo group nothing else
    uses meanwhile; with it the exchange runs while the ranks load (``arrival.py``).
    ``config``: the tier's configuration, for how many steps a lost local tier may
    have cost (its WARNING); without it that number is not known.
    ``round_bytes`` and ``chunk_bytes`` bound the exchange's memory.
    ``hosts``: the host map of ``coord``'s ranks when the caller knows it already (the
    tier gathered it when it started); else it is gathered here."""
    opts = load_options or LoadOptions()
    root = os.path.abspath(os.fspath(local_root))
    session = trace.begin(opts.trace, coord.rank, "recover")
    try:
        info = _recover(
            state, root, persistent_root, coord, opts, round_bytes, chunk_bytes, exchange_coord, config, hosts
        )
    except BaseException:
        if session is not None:
            session.end(failed=True)
        raise
    if session is None:
        return info
    if info is None:  # nothing recovered: no operation to show
        session.cancel()
        return None
    session.label = info.save_id
    stages = session.end(info.load.bytes_read, uri=root, save_id=info.save_id, step=info.step)
    return dataclasses.replace(info, stages=stages)


def _recover(
    state: Any,
    local_root: str,
    persistent_root: str | None,
    coord: Coordinator,
    opts: LoadOptions,
    round_bytes: int,
    chunk_bytes: int,
    exchange_coord: Coordinator | None,
    config: LocalTier | None,
    known_hosts: HostMap | None,
) -> RecoveryInfo | None:
    """:func:`recover_latest_with_info`'s steps, each a span when traced. A recovery
    that fails on corrupt bytes (a checksum or format error, on any rank) is tried
    again, on every rank, once each host has checked the copies it served and
    quarantined the bad ones (:func:`~bcp.tiers.recovery_dir.check_copy`): from other
    hosts' copies, an older local step, or the persistent tier."""
    started = time.perf_counter()
    # the coordinator lists the persistent root (round trips to a store) while the
    # hosts list their local roots
    persistent = PersistentNewest(persistent_root, opts.storage_options) if coord.is_coordinator else None
    hosts = known_hosts if known_hosts is not None else HostMap.gather(coord)
    if hosts.world_size != coord.world_size:
        raise ValueError(f"a host map of {hosts.world_size} ranks given for a group of {coord.world_size}")
    first = hosts.is_first(coord.rank)
    damaged: list[BadCopy] = []  # the copies quarantined so far (the same list on every rank)
    reason: str | None = None  # what the first failed attempt read
    for attempt in range(1, MAX_ATTEMPTS + 1):
        with trace.span("inventory"):
            listing: list[StepCopy] | None = _list_host(local_root) if first else None
            gathered = coord.gather(listing if first else None)
            plan = decide(
                coord,
                "choosing the step to recover",
                _choose_and_read,
                local_root,
                coord.rank,
                gathered,
                hosts,
                persistent,
                config,
                tuple(damaged),
                reason,
                share=_shared,
            )
        if plan is None:
            return None
        choice, nonce, metadata = plan
        try:
            info: RecoveryInfo | None = _attempt(
                state,
                local_root,
                coord,
                opts,
                round_bytes,
                chunk_bytes,
                exchange_coord,
                hosts,
                choice,
                nonce,
                started,
                metadata,
            )
            error: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - every rank learns of it below; raised unless it is damage
            info, error = None, e
        step_dir = os.path.join(local_root, step_name(choice.step))
        recovery_dir = os.path.join(local_root, f"{RECOVERY_PREFIX}{nonce}", step_name(choice.step))
        try:
            # an attempt's error is raised on every rank or on none (_attempt): whether it failed needs no
            # round of its own; each rank's damage travels only when it did
            reports = coord.all_gather((_damage_of(error, recovery_dir, choice.step), _no_room(error))) if error else []
        except Exception:
            if error is not None:  # a peer gone: its own error says more than the gather's
                raise error from None
            raise
        damage = [d for d, _room in reports if d is not None]
        full = [room for _d, room in reports if room is not None]
        if full and not damage:  # a host without room for the recovery directory: the persistent tier, if it has a step
            decide(coord, "giving up on the local tier", no_room, persistent, config, choice.step, full[0])
            return None
        if not damage:
            if error is not None:
                coord.check(error, "recovering from the local tier")
                raise error
            assert info is not None
            return info
        # some rank read corrupt bytes: every host checks the copies it served, then all retry
        paths: set[str] | None = set()
        for path, _reason in damage:
            if path is None or paths is None:
                paths = None
            else:
                paths.add(path)
        mine = hosts.host_of(coord.rank)
        held = [i for i, holders in enumerate(choice.holders) if mine in holders]
        bad = check_copy(step_dir, choice.save_id, held, paths, hosts.hosts[mine]) if first else []
        found = [b for per_rank in coord.all_gather(bad) for b in per_rank]
        damaged.extend(found)
        reason = reason or damage[0][1]
        if not found or attempt == MAX_ATTEMPTS:
            # nothing to blame (or no end to it): the persistent tier, if it has a step
            decide(
                coord,
                "giving up on the local tier",
                give_up,
                persistent,
                config,
                choice.step,
                damage[0][1],
                bool(found),
                tuple(damaged),
            )
            return None
        if coord.is_coordinator:
            log.warning(
                "local tier: recovering step %d failed (%s); %d corrupt local cop%s quarantined: %s; trying again "
                "without %s",
                choice.step,
                damage[0][1],
                len(found),
                "y" if len(found) == 1 else "ies",
                "; ".join(b.describe() for b in found),
                "it" if len(found) == 1 else "them",
            )
    raise AssertionError("unreachable")  # the last attempt returns or raises


#: Recoveries tried, each after quarantining what the one before found corrupt.
MAX_ATTEMPTS = 4

#: What the coordinator read of the chosen step's metadata: ("ok", bytes) or ("error", the error)
Prefetched = tuple[str, Any] | None


def _choose_and_read(
    local_root: str, rank: int, gathered: list[Any] | None, hosts: HostMap, *args: Any
) -> tuple[LocalChoice, str, Prefetched] | None:
    """(coordinator) :func:`~bcp.tiers.fallback.choose`, and, when the chosen source
    host's first rank is this one, the step's manifest and catalog read here
    (:func:`read_metadata`, an error kept to be raised by every rank's attempt), so
    they travel with the choice in one broadcast instead of a second one."""
    plan = choose(gathered, hosts, *args)
    if plan is None:
        return None
    choice, nonce = plan
    if hosts.ranks[choice.source][0] != rank:
        return choice, nonce, None
    try:
        return choice, nonce, ("ok", read_metadata(os.path.join(local_root, step_name(choice.step)), choice))
    except Exception as e:  # noqa: BLE001 - raised by every rank's attempt, where damage is handled
        return choice, nonce, ("error", e)


def _shared(plan: tuple[LocalChoice, str, Prefetched] | None) -> Any:
    """What the other ranks receive of :func:`_choose_and_read`'s result: an error as sent."""
    if plan is None or plan[2] is None or plan[2][0] == "ok":
        return plan
    return plan[0], plan[1], ("error", portable(plan[2][1]))


def _no_room(error: BaseException | None) -> str | None:
    """The message of ``error`` when it is a full local file system (ENOSPC, EDQUOT), on this rank or, through
    RankFailedError, another; None otherwise."""
    errors = list(error.errors.values()) if isinstance(error, RankFailedError) else [error]
    full = [e for e in errors if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)]
    return f"no room for the recovery directory: {full[0]}" if full else None


def _damage_of(error: BaseException | None, recovery_dir: str, step: int) -> tuple[str | None, str] | None:
    """(file the error names or None, its message) when ``error`` is corrupt bytes of a
    local copy (a checksum or format error) or a local file that cannot be read, on this
    rank or, through RankFailedError, another; None otherwise. The message no longer names the recovery directory: it
    is gone by now."""
    local_root = os.path.dirname(os.path.dirname(recovery_dir))

    def damage(e: BaseException) -> bool:  # bad bytes, or a local file that cannot be read (EIO, EACCES)
        unreadable = isinstance(e, StorageError) and e.action == "reading" and e.uri.startswith(local_root)
        return unreadable or isinstance(e, (CorruptCheckpointError, FormatError))

    if isinstance(error, RankFailedError):
        inner = [e for e in error.errors.values() if damage(e)]
        if not inner:
            return None
        error = inner[0]
    if error is None or not damage(error):
        return None
    text = str(error).replace(recovery_dir, f"local step {step}")
    text = text.replace(os.path.dirname(recovery_dir), "the local root")  # a sibling step's file
    return getattr(error, "file", None) or getattr(error, "key", None), text


def _attempt(
    state: Any,
    local_root: str,
    coord: Coordinator,
    opts: LoadOptions,
    round_bytes: int,
    chunk_bytes: int,
    exchange_coord: Coordinator | None,
    hosts: HostMap,
    choice: LocalChoice,
    nonce: str,
    started: float,
    prefetched: Prefetched,
) -> RecoveryInfo:
    """One recovery of the chosen step: metadata, recovery directory, exchange, load.
    ``prefetched``: the metadata the coordinator read with the choice (it is the source).
    Raises on every rank or on none: each step ends in a round that agrees (the metadata's
    broadcast, then checks of the same bytes everywhere; the gather of the directories and
    requests; the exchange's check; the load's phases, its opening included), so the
    caller needs no round of its own to learn whether every rank succeeded."""
    first = hosts.is_first(coord.rank)
    step_dir = os.path.join(local_root, step_name(choice.step))
    source = hosts.ranks[choice.source][0]
    with trace.span("metadata"):
        if prefetched is None:
            metadata = _from_rank(coord, source, "reading the local step's metadata", read_metadata, step_dir, choice)
        else:
            metadata = _prefetched(prefetched, source)
        manifest = Manifest.from_json(metadata.manifest, where=f"{step_dir}/{MANIFEST_KEY} (local tier)")
        # checked as a load checks the bytes it reads; on every rank alike (the same bytes), so that
        # all raise or none does before the load's first collective
        check_received(step_dir, manifest, metadata, choice)
    mine = hosts.host_of(coord.rank)
    held = frozenset(i for i, h in enumerate(choice.holders) if mine in h)
    n_files = len(manifest.data_files)
    # every host holds every file: no host fetches, so no directory, read plan or exchange anywhere
    everywhere = all(len(set(h)) == len(hosts.hosts) for h in choice.holders)
    # the recovery directory mirrors the local root: the step, and the sibling steps it refers to
    recovery_parent = os.path.join(local_root, f"{RECOVERY_PREFIX}{nonce}")
    recovery_dir = os.path.join(recovery_parent, step_name(choice.step))
    # a host holding every file loads its local step itself (read-only), with no recovery directory
    load_dir = step_dir if len(held) == n_files else recovery_dir
    try:

        def prepare_and_match() -> np.ndarray:
            if len(held) == n_files:
                # the host holds every file: nothing to fetch, so no directory and no read plan to make
                # here (the load makes its own, and matches the template as it always does)
                return np.empty((0, 3), np.int64)
            with trace.span("prepare"):
                prepare(recovery_dir, step_dir, manifest, metadata, held)
            with trace.span("match"):
                return wanted_ranges(state, recovery_dir, manifest, metadata, held, coord, opts)

        fetch_started = time.perf_counter()
        exchange = Exchange(coord, hosts, choice, manifest, step_dir, recovery_dir, round_bytes, chunk_bytes)
        if not everywhere:
            # one round: every rank of the host has built the directory before any byte lands in it, and
            # every rank learns what every other wants (or that one failed)
            exchange.plan(
                _gather_outcomes(coord, "preparing the recovery directory and matching the state", prepare_and_match)
            )
        load_opts = dataclasses.replace(opts, storage_options=None, share_reads=False)
        if not exchange.rounds_of:  # the same on every rank: no host fetches anything, a plain load
            fetch_seconds = time.perf_counter() - fetch_started
            loaded = _load_plain(state, load_dir, recovery_dir, metadata, load_opts)
        elif exchange_coord is None or coord.world_size == 1:
            with trace.span("exchange") as exchanging:
                coord.check(exchange.run(), FETCH_PHASE)
                if exchanging is not None:
                    exchanging.nbytes = exchange.bytes_received
            fetch_seconds = time.perf_counter() - fetch_started
            loaded = _load_plain(state, load_dir, recovery_dir, metadata, load_opts)
        else:
            fetched = {i: e for i, e in enumerate(manifest.data_files) if i not in held}
            loaded, fetch_seconds = _load_while_fetching(
                state, exchange, exchange_coord, load_dir, fetched, load_opts, metadata
            )
    finally:
        if first and load_dir == recovery_dir:
            shutil.rmtree(recovery_parent, ignore_errors=True)
    seconds = time.perf_counter() - started
    log.info(
        "recovered step %d (save %s) from the local tier in %.3f s: %d bytes received from peers and %d sent "
        "in %.3f s (%d rounds); the load read %d bytes",
        choice.step,
        choice.save_id,
        seconds,
        exchange.bytes_received,
        exchange.bytes_sent,
        fetch_seconds,
        exchange.rounds,
        loaded.bytes_read,
    )
    return RecoveryInfo(
        step=choice.step,
        save_id=choice.save_id,
        state=loaded.state,
        seconds=seconds,
        fetch_seconds=fetch_seconds,
        bytes_sent=exchange.bytes_sent,
        bytes_received=exchange.bytes_received,
        rounds=exchange.rounds,
        load=loaded,
    )


FETCH_PHASE = "fetching fragments from peer hosts"


def _load_while_fetching(
    state: Any,
    exchange: Exchange,
    exchange_coord: Coordinator,
    recovery_dir: str,
    fetched: dict[int, FileEntry],
    load_opts: LoadOptions,
    metadata: CheckpointMetadata,
) -> tuple[LoadInfo, float]:
    """The exchange in a thread on ``exchange_coord``'s group while this rank loads
    through a :class:`GatedBackend` (the step's own files, and a second one over the
    recovery directory's parent for the sibling steps' files it refers to); an exchange
    error wins over the load's."""
    started = time.perf_counter()
    arrivals = Arrivals()
    exchange.coord = exchange_coord
    exchange.arrivals = arrivals
    outcome: dict[str, Any] = {}

    def fetch() -> None:
        failure: BaseException | None = None
        try:
            with trace.span("exchange") as exchanging:  # spans of any thread land in the session
                exchange_coord.check(exchange.run(), FETCH_PHASE)
                if exchanging is not None:
                    exchanging.nbytes = exchange.bytes_received
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            failure = e
        outcome["seconds"] = time.perf_counter() - started
        outcome["error"] = failure
        arrivals.end(failure)

    thread = threading.Thread(target=fetch, name="bcp-recover-exchange", daemon=True)
    thread.start()
    loaded: LoadInfo | None = None
    try:
        own = {e.path: i for i, e in fetched.items() if e.checkpoint is None}
        refs = {reference_key(e.checkpoint, e.path): i for i, e in fetched.items() if e.checkpoint is not None}
        backend = GatedBackend(resolve_backend(recovery_dir), own, arrivals)
        siblings = GatedBackend(resolve_backend(os.path.dirname(recovery_dir)), refs, arrivals)
        loaded = load_with_metadata(state, backend, metadata, load_opts, parent=lambda: siblings)
    finally:
        thread.join()  # every transfer happens, so no peer waits forever
        if outcome.get("error") is not None:
            raise outcome["error"]
    assert loaded is not None
    return loaded, outcome["seconds"]


# -- inventory, choice, metadata --------------------------------------------------------------------


def _list_host(root: str) -> list[StepCopy] | None:
    """This host's listing (never raises: a host that cannot list holds nothing), after
    removing the recovery directories a killed recovery left behind."""
    try:
        remove_leftovers(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("local tier: cannot list %s: %s", root, e)
        return None
    try:
        return list_local(root)
    except Exception as e:  # noqa: BLE001 - this host then holds nothing; the others may hold all
        log.warning("local tier: cannot list %s: %s", root, e)
        return None


def _from_rank(coord: Coordinator, src: int, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Rank ``src`` runs ``fn(*args)``; every rank gets its result, or raises its error."""
    if coord.world_size == 1:
        return fn(*args)
    assert isinstance(coord, GroupCoordinator)
    outcome: Any = None
    error: BaseException | None = None
    if coord.rank == src:
        try:
            outcome = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
            error = e
            outcome = ("error", portable(e))
    box = [outcome]
    ranks = coord.dist.get_process_group_ranks(coord.group)
    coord.dist.broadcast_object_list(box, src=ranks[src], group=coord.group)
    tag, payload = box[0]
    if tag == "ok":
        return payload
    if error is not None:
        raise error
    restored = payload.restore()
    restored.add_note(f"raised on rank {src} while {phase}")
    raise restored


def _gather_outcomes(coord: Coordinator, phase: str, fn: Callable[[], Any]) -> list[Any]:
    """(all ranks) Every rank's ``fn()`` in one ``all_gather`` (a ``run_phase`` and an
    ``all_gather`` in one round); if any rank raised, every rank raises as
    :meth:`~bcp.coordination.collectives.Coordinator.check` does."""
    try:
        outcome: tuple[bool, Any] = (True, fn())
        error: BaseException | None = None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        outcome, error = (False, None), e
    results = coord.all_gather(outcome)
    if not all(ok for ok, _r in results):
        coord.check(error, phase)  # every rank agrees some rank failed: raises on each
        raise AssertionError("unreachable")  # pragma: no cover
    return [r for _ok, r in results]


def _prefetched(prefetched: tuple[str, Any], source: int) -> CheckpointMetadata:
    """The metadata the coordinator (rank ``source``) sent with the choice, or its error raised."""
    tag, payload = prefetched
    if tag == "ok":
        assert isinstance(payload, CheckpointMetadata)
        return payload
    if isinstance(payload, BaseException):  # the coordinator's own error
        raise payload
    restored = payload.restore()
    restored.add_note(f"raised on rank {source} while reading the local step's metadata")
    raise restored


def _load_plain(state: Any, load_dir: str, recovery_dir: str, metadata: Any, opts: Any) -> Any:
    """A plain load of ``load_dir``. The recovery directory's fetched files have holes
    where no rank of this host reads, so its load (and its siblings') reads across no gap;
    a local step held whole loads as any checkpoint does."""
    if load_dir != recovery_dir:
        return load_with_metadata(state, load_dir, metadata, opts)
    siblings = HoleyFiles(resolve_backend(os.path.dirname(load_dir)))
    return load_with_metadata(state, HoleyFiles(resolve_backend(load_dir)), metadata, opts, parent=lambda: siblings)
