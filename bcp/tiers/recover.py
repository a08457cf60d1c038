"""Recovering from the local tier (docs/tiers.md, "Recovering").

All ranks call :func:`recover_latest` (``CheckpointManager.load_latest`` does, when
a tier is configured), at whatever world size the job restarted with:

1. **Inventory.** Each host's first rank lists its local root
   (:func:`bcp.tiers.inventory.list_local`); the coordinator gathers the listings.
2. **Choice.** The coordinator picks the newest local step that agreeing copies hold
   entirely (:func:`~bcp.tiers.inventory.choose_local`) and compares it with the
   persistent tier's newest committed step; the newer wins, a tie goes to the local
   one. Persistent (or nothing anywhere): :func:`recover_latest` returns None and the
   caller loads from persistent storage as before.
3. **Metadata.** The first rank of a host holding the chosen copy sends the manifest
   and catalog bytes to every rank.
4. **Recovery directory.** Each host gets ``<local root>/recover-<nonce>/``: the
   manifest, the catalog, a hard link to each data file the host holds whole, and a
   sparse file of the manifest's size for each other one (ranks of one host share it).
5. **Fetch.** Each rank matches its template against the catalog (bcp's own
   ``match_state``, resharding included) and lists the whole fragments its boxes touch
   in files its host does not hold. One ``all_gather`` of those lists tells every rank
   the whole exchange; each fragment is asked once per host (by the lowest rank
   wanting it) from a rank of a host holding its file, the serving ranks balanced by
   bytes. The bytes move as uint8 tensors over bcp's gloo group (point-to-point), in
   rounds of at most ``round_bytes`` sent plus received per rank, and land at their
   offsets in the sparse files.
6. **Load.** An ordinary ``bcp.load`` from each host's recovery directory: matching,
   resharding, casting, placement and the CRC32C check of every byte read are bcp's
   own (ranks load from different directories with identical manifests; the
   coordinator reads the metadata from its own). The directory is removed after.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from bcp.metadata import Manifest
from bcp.metadata.layout import MANIFEST_KEY, step_name

from ..collectives import Coordinator, GroupCoordinator, decide, portable, run_phase
from ..commit import fetch_catalog, fetch_manifest
from ..errors import CorruptCheckpointError
from ..housekeeping import committed_steps
from ..io_scheduler.read_plan import touched_rows
from ..loader import LoadInfo, load_with_info, match_state
from ..options import LoadOptions
from ..reader import reader_from_bytes
from ..state import detach_stateful
from ..target import resolve_backend
from ..tensor_io import byte_view
from .inventory import LocalChoice, StepCopy, choose_local, list_local, local_wins

log = logging.getLogger(__name__)

#: Each transfer between two ranks is cut into pieces of at most this many bytes.
CHUNK_BYTES = 64 << 20
#: What one rank sends plus receives in one round of the exchange, at most (a single
#: piece larger than this, impossible with the defaults, gets a round of its own).
ROUND_BYTES = 256 << 20
#: Recovery directories under a local root: ``recover-<nonce>`` (never a holding).
RECOVERY_PREFIX = "recover-"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _host_id() -> str:
    """This process's host: ``BCP_HOST_ID``, else the host name. (A private stand-in
    for the tier's shared host identity.)"""
    return os.environ.get("BCP_HOST_ID") or socket.gethostname()


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


def recover_latest(
    state: Any,
    *,
    local_root: str,
    persistent_root: str | None,
    coord: Coordinator,
    load_options: LoadOptions | None = None,
) -> tuple[int | None, Any] | None:
    """(all ranks) Load the newest step the local tier holds entirely into ``state``,
    if it is not older than the persistent tier's newest committed step (at
    ``persistent_root``, read with ``load_options.storage_options``). Returns
    ``(step, loaded state)``, or None: the caller loads from persistent storage."""
    info = recover_latest_with_info(
        state, local_root=local_root, persistent_root=persistent_root, coord=coord, load_options=load_options
    )
    return None if info is None else (info.step, info.state)


def recover_latest_with_info(
    state: Any,
    *,
    local_root: str,
    persistent_root: str | None,
    coord: Coordinator,
    load_options: LoadOptions | None = None,
    round_bytes: int = ROUND_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
) -> RecoveryInfo | None:
    """:func:`recover_latest`, returning a :class:`RecoveryInfo` (None: use the
    persistent tier). ``round_bytes`` and ``chunk_bytes`` bound the exchange's memory."""
    started = time.perf_counter()
    opts = load_options or LoadOptions()
    local_root = os.path.abspath(os.fspath(local_root))
    hosts = _Hosts(coord.all_gather(_host_id()), coord.rank)
    listing: list[StepCopy] | None = _list_host(local_root) if hosts.is_first else None
    gathered = coord.gather(listing if hosts.is_first else None)
    plan = decide(
        coord,
        "choosing the step to recover",
        _choose,
        gathered,
        hosts,
        persistent_root,
        opts.storage_options,
    )
    if plan is None:
        return None
    choice, nonce = plan
    step_dir = os.path.join(local_root, step_name(choice.step))
    source = hosts.ranks[choice.source][0]
    manifest_bytes, catalog_bytes = _from_rank(
        coord, source, "reading the local step's metadata", _read_metadata, step_dir, choice
    )
    manifest = Manifest.from_json(manifest_bytes, where=f"{step_dir}/{MANIFEST_KEY} (local tier)")
    held = frozenset(i for i, h in enumerate(choice.holders) if hosts.mine in h)
    recovery_dir = os.path.join(local_root, f"{RECOVERY_PREFIX}{nonce}")
    try:
        run_phase(
            coord,
            "preparing the recovery directory",
            _prepare,
            recovery_dir,
            step_dir,
            manifest,
            manifest_bytes,
            catalog_bytes,
            held,
        )
        wanted = run_phase(
            coord,
            "matching the state for recovery",
            _wanted,
            state,
            recovery_dir,
            manifest,
            manifest_bytes,
            catalog_bytes,
            held,
            coord,
            opts,
        )
        fetch_started = time.perf_counter()
        exchange = _Exchange(coord, hosts, choice, manifest, step_dir, recovery_dir, round_bytes, chunk_bytes)
        exchange.plan(coord.all_gather(wanted))
        error = exchange.run()
        coord.check(error, "fetching fragments from peer hosts")
        fetch_seconds = time.perf_counter() - fetch_started
        load_opts = dataclasses.replace(opts, storage_options=None, share_reads=False)
        loaded = load_with_info(state, recovery_dir, load_opts)
    finally:
        if hosts.is_first:
            shutil.rmtree(recovery_dir, ignore_errors=True)
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


# -- hosts, inventory, choice --------------------------------------------------------------------


class _Hosts:
    """The job's hosts, in the order of their first ranks."""

    def __init__(self, ids: list[str], rank: int) -> None:
        order: dict[str, list[int]] = {}
        for r, host in enumerate(ids):
            order.setdefault(host, []).append(r)
        self.names = list(order)
        #: ranks of each host, ascending
        self.ranks = [order[h] for h in self.names]
        #: host index of each rank
        where = {h: i for i, h in enumerate(self.names)}
        self.of_rank = [where[h] for h in ids]
        self.mine = self.of_rank[rank]
        self.is_first = self.ranks[self.mine][0] == rank


def _list_host(root: str) -> list[StepCopy] | None:
    """This host's listing (never raises: a host that cannot list holds nothing), after
    removing the recovery directories a killed recovery left behind."""
    try:
        for entry in os.scandir(root):
            if entry.name.startswith(RECOVERY_PREFIX) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
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


def _choose(
    gathered: list[Any] | None,
    hosts: _Hosts,
    persistent_root: str | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[LocalChoice, str] | None:
    """(coordinator) The local step to recover and a fresh directory name, or None."""
    assert gathered is not None
    listings = [gathered[ranks[0]] for ranks in hosts.ranks]
    choice = choose_local(listings)
    persistent = None
    if persistent_root is not None:
        try:
            steps = committed_steps(resolve_backend(persistent_root, storage_options))
            persistent = steps[-1] if steps else None
        except Exception as e:  # noqa: BLE001 - the local tier may still do; the fallback reports it again
            log.warning("local tier: cannot list the persistent root %s: %s", persistent_root, e)
    if choice is None:
        if any(listings):
            log.warning(
                "local tier: no local step is held entirely by the %d surviving hosts; loading from the "
                "persistent tier (newest step %s)",
                len(listings),
                persistent,
            )
        return None
    if not local_wins(choice.step, persistent):
        log.info(
            "local tier: persistent step %s is newer than local step %d; loading from the persistent tier",
            persistent,
            choice.step,
        )
        return None
    log.info(
        "local tier: recovering step %d (save %s) from %d hosts (persistent tier's newest: %s)",
        choice.step,
        choice.save_id,
        len({h for holders in choice.holders for h in holders}),
        persistent,
    )
    return choice, secrets.token_hex(8)


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


def _read_metadata(step_dir: str, choice: LocalChoice) -> tuple[bytes, bytes]:
    """The chosen copy's manifest (the one the inventory saw) and its catalog, checked."""
    backend = resolve_backend(step_dir)
    manifest_bytes, manifest = fetch_manifest(backend)
    if manifest.save_id != choice.save_id:
        raise CorruptCheckpointError(
            f"{step_dir}/{MANIFEST_KEY} changed during recovery (save {manifest.save_id}, chosen {choice.save_id})",
            file=MANIFEST_KEY,
        )
    return manifest_bytes, fetch_catalog(backend, manifest)


# -- the recovery directory -----------------------------------------------------------------------


def _prepare(
    recovery_dir: str,
    step_dir: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    catalog_bytes: bytes,
    held: frozenset[int],
) -> None:
    """The host's recovery directory (ranks of one host may all run this at once):
    hard links to the files held whole, sparse files of the manifest's sizes for the
    others, then the catalog and the manifest."""
    for i, entry in enumerate(manifest.data_files):
        target = os.path.join(recovery_dir, *entry.path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if i in held:
            _link(os.path.join(step_dir, *entry.path.split("/")), target)
        else:
            _sparse(target, entry.nbytes)
    _write_replace(os.path.join(recovery_dir, *manifest.catalog.path.split("/")), catalog_bytes)
    _write_replace(os.path.join(recovery_dir, MANIFEST_KEY), manifest_bytes)


def _link(source: str, target: str) -> None:
    """``target`` the same file as ``source`` (a hard link: bcp's file backend refuses
    symbolic links); a copy where the file system has no hard links."""
    try:
        os.link(source, target, follow_symlinks=False)
    except FileExistsError:
        if not os.path.samefile(source, target):
            raise
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        log.warning("local tier: cannot hard-link %s (%s); copying it", source, e)
        partial = f"{target}.{secrets.token_hex(4)}.partial"
        shutil.copyfile(source, partial, follow_symlinks=False)
        os.replace(partial, target)


def _sparse(path: str, nbytes: int) -> None:
    """A file of ``nbytes`` (holes until written). Several ranks may create it at once:
    none truncates what another wrote (it has its final size from the first call)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o644)
    try:
        if os.fstat(fd).st_size != nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _write_replace(path: str, data: bytes) -> None:
    """Write ``path`` whole through a partial file and a rename (identical bytes from
    several ranks of a host: the last rename wins, with the same content)."""
    partial = f"{path}.{secrets.token_hex(4)}.partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


# -- what each rank needs --------------------------------------------------------------------------


def _wanted(
    state: Any,
    recovery_dir: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    catalog_bytes: bytes,
    held: frozenset[int],
    coord: Coordinator,
    opts: LoadOptions,
) -> np.ndarray:
    """(N, 3) int64 rows (data file index, byte offset, bytes): the whole fragments this
    rank's load will read from files its host does not hold. The template is matched as
    ``bcp.load`` matches it (same strictness, world size and replica choice), so a
    mismatch raises here, before any byte moves."""
    detached, _stateful = detach_stateful(state)
    reader = reader_from_bytes(
        resolve_backend(recovery_dir), manifest_bytes, catalog_bytes, allow_pickle=opts.allow_pickle
    )
    index = {f.path: i for i, f in enumerate(manifest.data_files)}
    rows: set[tuple[int, int, int]] = set()
    try:
        plan = match_state(reader, detached, opts.strict, coord.world_size, opts.reshard_objects)
        for request in plan.tensor_requests:
            entry = reader.catalog.tensors[request.fqn]
            # the reads of bcp.load's fill: one box at a time, the same replica choice
            _bi, picked, _o, _l = touched_rows(entry, [request.box], prefer_rank=coord.rank)
            for row in np.unique(picked).tolist():
                nbytes = int(entry.sizes[row])
                file = index[entry.file_names[int(entry.files[row])]]
                if nbytes and file not in held:
                    rows.add((file, int(entry.byte_offsets[row]), nbytes))
    finally:
        reader.close()
    return np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)


# -- the exchange ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
    sender: int
    receiver: int
    file: int
    offset: int
    nbytes: int


class _Exchange:
    """Every rank computes the same transfers and rounds from the gathered requests,
    then carries out its own part."""

    def __init__(
        self,
        coord: Coordinator,
        hosts: _Hosts,
        choice: LocalChoice,
        manifest: Manifest,
        step_dir: str,
        recovery_dir: str,
        round_bytes: int,
        chunk_bytes: int,
    ) -> None:
        self.coord = coord
        self.hosts = hosts
        self.choice = choice
        self.manifest = manifest
        self.step_dir = step_dir
        self.recovery_dir = recovery_dir
        self.round_bytes = max(1, round_bytes)
        self.chunk_bytes = max(1, min(chunk_bytes, self.round_bytes))
        self.rounds_of: list[list[_Piece]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rounds = 0

    def plan(self, requests: list[np.ndarray]) -> None:
        """Who sends what to whom, in which round (the same on every rank)."""
        wanted: dict[tuple[int, int, int, int], int] = {}  # (host, file, offset, bytes) -> receiving rank
        for rank, rows in enumerate(requests):
            host = self.hosts.of_rank[rank]
            for file, offset, nbytes in rows.tolist():
                wanted.setdefault((host, file, offset, nbytes), rank)  # ranks ascend: the host's lowest asks
        servers = {
            file: [r for h in holders for r in self.hosts.ranks[h]] for file, holders in enumerate(self.choice.holders)
        }
        load = [0] * self.coord.world_size
        pieces: list[_Piece] = []
        for (_host, file, offset, nbytes), receiver in sorted(wanted.items(), key=lambda kv: (kv[0][1:], kv[1])):
            sender = min(servers[file], key=lambda r: (load[r], r))
            load[sender] += nbytes
            for at in range(0, nbytes, self.chunk_bytes):
                pieces.append(_Piece(sender, receiver, file, offset + at, min(self.chunk_bytes, nbytes - at)))
        self.rounds_of = self._rounds(pieces)

    def _rounds(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        """First fit: each piece in the earliest round where neither its sender nor its
        receiver would move more than ``round_bytes``."""
        used: list[dict[int, int]] = []
        first_open: dict[int, int] = {}
        rounds: list[list[_Piece]] = []
        for p in pieces:
            r = max(first_open.get(p.sender, 0), first_open.get(p.receiver, 0))
            while r < len(rounds) and (
                used[r].get(p.sender, 0) + p.nbytes > self.round_bytes
                or used[r].get(p.receiver, 0) + p.nbytes > self.round_bytes
            ):
                r += 1
            if r == len(rounds):
                rounds.append([])
                used.append({})
            rounds[r].append(p)
            for who in (p.sender, p.receiver):
                used[r][who] = used[r].get(who, 0) + p.nbytes
                while first_open.get(who, 0) < len(rounds) and used[first_open.get(who, 0)].get(who, 0) >= (
                    self.round_bytes
                ):
                    first_open[who] = first_open.get(who, 0) + 1
        return rounds

    def run(self) -> BaseException | None:
        """This rank's sends and receives, round by round. Returns the first error (a
        file that could not be read or written): every transfer still happens, so no
        peer waits forever, and the caller raises it on every rank."""
        me = self.coord.rank
        files: dict[tuple[str, int], int] = {}
        error: BaseException | None = None
        try:
            for tag, pieces in enumerate(self.rounds_of):
                sends = [p for p in pieces if p.sender == me]
                recvs = [p for p in pieces if p.receiver == me]
                if not sends and not recvs:
                    continue
                self.rounds += 1
                failed = self._round(tag, sends, recvs, files)
                error = error or failed
        finally:
            for fd in files.values():
                os.close(fd)
        return error

    def _fd(self, files: dict[tuple[str, int], int], where: str, file: int) -> int:
        key = (where, file)
        if key not in files:
            root = self.step_dir if where == "read" else self.recovery_dir
            path = os.path.join(root, *self.manifest.data_files[file].path.split("/"))
            flags = (os.O_RDONLY if where == "read" else os.O_WRONLY) | _NOFOLLOW
            files[key] = os.open(path, flags)
        return files[key]

    def _round(
        self, tag: int, sends: list[_Piece], recvs: list[_Piece], files: dict[tuple[str, int], int]
    ) -> BaseException | None:
        assert isinstance(self.coord, GroupCoordinator), "only one rank: nothing to exchange"
        dist, group = self.coord.dist, self.coord.group
        ranks = dist.get_process_group_ranks(group)
        error: BaseException | None = None
        outgoing: dict[int, list[_Piece]] = {}
        incoming: dict[int, list[_Piece]] = {}
        for p in sends:
            outgoing.setdefault(p.receiver, []).append(p)
        for p in recvs:
            incoming.setdefault(p.sender, []).append(p)
        works = []
        inboxes: dict[int, torch.Tensor] = {}
        for peer, ps in incoming.items():
            inboxes[peer] = torch.empty(sum(p.nbytes for p in ps), dtype=torch.uint8)
            works.append(dist.irecv(inboxes[peer], src=ranks[peer], group=group, tag=tag))
        outboxes = []
        for peer, ps in outgoing.items():
            box = torch.empty(sum(p.nbytes for p in ps), dtype=torch.uint8)
            view = byte_view(box)
            at = 0
            for p in ps:
                try:
                    got = os.preadv(self._fd(files, "read", p.file), [view[at : at + p.nbytes]], p.offset)
                    if got != p.nbytes:
                        raise CorruptCheckpointError(
                            f"local tier: {self.manifest.data_files[p.file].path} in {self.step_dir} ended at "
                            f"byte {p.offset + got}, before {p.offset + p.nbytes}",
                            file=self.manifest.data_files[p.file].path,
                            offset=p.offset + got,
                        )
                except (OSError, CorruptCheckpointError) as e:
                    error = error or e
                    view[at : at + p.nbytes] = bytes(p.nbytes)
                at += p.nbytes
            outboxes.append(box)
            self.bytes_sent += at
            works.append(dist.isend(box, dst=ranks[peer], group=group, tag=tag))
        for work in works:
            work.wait()
        for peer, ps in incoming.items():
            view = byte_view(inboxes[peer])
            at = 0
            for p in ps:
                try:
                    fd = self._fd(files, "write", p.file)
                    done = 0
                    while done < p.nbytes:
                        done += os.pwritev(fd, [view[at + done : at + p.nbytes]], p.offset + done)
                except OSError as e:
                    error = error or e
                at += p.nbytes
            self.bytes_received += at
        return error
