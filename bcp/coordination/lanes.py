"""bcp's gloo groups: which group each operation's collectives use, and when the
groups are created and released (the coordinators themselves: ``bcp.coordination.collectives``).

Without an initialised process group, or with ``process_group=LOCAL``, an operation
gets a single-rank coordinator and no group; but a process that a launcher started as
one of several (``WORLD_SIZE=2``, ``RANK=1``, ...) without an initialised process group
is refused (``ProcessGroupMissingError``): this is the one place that decides.

How bcp keeps its collectives apart. Collectives on one group must be issued in the
same order on every rank, and gloo matches them by their order alone: two threads of
one process using one group can pair one rank's broadcast with another rank's
all-reduce and hang. bcp issues collectives from two kinds of threads, so each
process group it serves gets its own gloo groups, one per lane:

* **caller** (``coordinator_for``): everything that runs on the thread that called
  bcp: ``save``, ``load``, the planning of ``async_save``, every collective of
  ``CheckpointManager``. The program calls these in the same order on every rank
  (that is what collective means), and one thread issues them one after another,
  so the group sees the same sequence everywhere.
* **background** (``background_coordinator``): only the commit of async saves
  (``SaveJob.complete`` in the ``bcp-async-save`` thread). Commits of one process
  group run one at a time, in the order their ``async_save`` calls were made
  (``bcp.async_save`` makes each background thread wait for the previous one of its
  group before its first collective): the same order on every rank. This group is
  bcp's own ``ProcessGroupGloo`` on the job's store when it can be built
  (:class:`OwnGroupCoordinator`), so that ``destroy_process_group()`` before
  ``wait()`` does not take it down.
* **rendezvous**: one monitored barrier at the start of each caller-lane operation,
  with a short timeout (``BCP_RENDEZVOUS_TIMEOUT``), so that an operation called by
  fewer ranks than its group fails in seconds naming the missing ranks.

The caller may wait for the background lane (``wait()``, a third async save waiting
for the first), never the reverse, so a rank blocked in a caller collective never
holds back another rank's background commit: no cycle, no deadlock. Every gloo group
is created on the caller's thread, at the same point of the program on every rank
(``new_group`` is itself collective and must be called in one order). The caller's
own collectives on its own groups (FSDP's ``get_state_dict`` inside a
``TrainingState``) run on the caller's thread too, between bcp's, in program order.
At exit, one handler (``_exit_handler``) first finishes the async saves in flight,
then releases the groups.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from bcp.coordination import gloo_network
from bcp.coordination.collectives import Coordinator, GroupCoordinator, OwnGroupCoordinator, collective_timeout
from bcp.errors import ProcessGroupMissingError, RankFailedError, RanksMissingError

log = logging.getLogger(__name__)

_GROUPS: dict[Any, Any] = {}


class _Local:
    """The type of :data:`LOCAL` (one instance; pickles as that instance)."""

    def __repr__(self) -> str:
        return "bcp.LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"


#: ``process_group=bcp.LOCAL``: this process alone, even in an initialised world (a
#: framework's rank-0-only checkpoint hook); no collective, no other rank waited for.
LOCAL = _Local()
_Local.__module__ = __name__


#: the default of ``BCP_RENDEZVOUS_TIMEOUT`` (seconds; docs/distributed.md says why)
DEFAULT_RENDEZVOUS_SECONDS = 30.0


def rendezvous_timeout() -> datetime.timedelta | None:
    """How long the ranks of a group may arrive apart at a bcp operation
    (``BCP_RENDEZVOUS_TIMEOUT``, never more than the collective timeout); None: no
    rendezvous (the variable set to 0)."""
    seconds = float(os.environ.get("BCP_RENDEZVOUS_TIMEOUT", str(DEFAULT_RENDEZVOUS_SECONDS)))
    if seconds <= 0:
        return None
    return min(datetime.timedelta(seconds=seconds), collective_timeout())


#: base key of a process group -> why its rendezvous group is unusable
_BROKEN: dict[tuple, str] = {}


def _base_key(dist: Any, process_group: Any) -> tuple:
    # keyed by the job's default group too, so a re-initialised job gets fresh groups
    return (id(dist.group.WORLD), id(process_group) if process_group is not None else None)


def _group(dist: Any, base: tuple, lane: str, process_group: Any, timeout: datetime.timedelta) -> Any:
    """bcp's gloo group of ``lane`` for ``process_group``, created on first use (on the
    caller's thread: ``new_group`` is collective)."""
    key = (*base, lane)
    group = _GROUPS.get(key)
    if group is None:
        if process_group is None:
            create = lambda: dist.new_group(backend="gloo", timeout=timeout)  # noqa: E731
        else:
            # only the members call bcp with this group: a group-local creation, so
            # ranks outside it need not take part (and the job's group count stays equal)
            ranks = dist.get_process_group_ranks(process_group)
            create = lambda: dist.new_group(  # noqa: E731
                ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
            )
        # the interface gloo listens on, and a bound on connecting (bcp.coordination.gloo_network)
        group = gloo_network.create_group(create, process_group, arrival_timeout=timeout)
        _GROUPS[key] = group
    return group


#: environment variables by which launchers give a process the number of processes of
#: its job: torchrun (and Lightning, accelerate, DeepSpeed), srun's tasks of one job
#: step, Open MPI, MPICH / Intel MPI. ``SLURM_NTASKS`` is not one of them: it is also
#: set in a batch script that runs a single process.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
#: ... and its rank among them (any rank but 0 means there are several)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched_among_several(environ: Mapping[str, str] | None = None) -> str | None:
    """``NAME=value`` of the environment variable that says this process was started
    as one of several processes of a job (a world size above 1, or a rank above 0);
    None when none does (no launcher, or a launch of one process: ``WORLD_SIZE=1``)."""
    env = os.environ if environ is None else environ
    for names, above in ((WORLD_SIZE_VARIABLES, 1), (RANK_VARIABLES, 0)):
        for name in names:
            value = env.get(name, "").strip()
            if value.isdigit() and int(value) > above:
                return f"{name}={value}"
    return None


def refuse_launched_without_group(operation: str) -> None:
    """Raise :class:`ProcessGroupMissingError` when a launcher started this process as
    one of several but torch.distributed is not initialised: each process would save
    (or load) as if alone, every one of them to the same location. Runs on every
    rank, so every rank refuses the same way, before anything is written."""
    variable = launched_among_several()
    if variable is None:
        return
    raise ProcessGroupMissingError(
        f"{operation}: this process was started as one of several processes of a job ({variable}) but "
        f"torch.distributed is not initialised, so each process would save or load alone, all of them at "
        f"the same location. Call torch.distributed.init_process_group() on every rank before bcp, or pass "
        f"process_group=bcp.LOCAL to save or load from this process alone",
        variable=variable,
        operation=operation,
    )


def coordinator_for(process_group: Any = None, operation: str = "bcp") -> Coordinator:
    """(every rank of the group, on the caller's thread) The coordinator of one
    collective ``operation`` (named in errors): single-rank without torch.distributed
    or with ``process_group=LOCAL``, else the caller lane's gloo group with bcp's
    timeout, after a rendezvous of every rank of the group (see the module's
    docstring). Raises :class:`RanksMissingError` within the rendezvous timeout
    when some rank of the group does not call it."""
    if process_group is LOCAL:
        return Coordinator()
    try:
        import torch.distributed as dist
    except ImportError:
        refuse_launched_without_group(operation)
        return Coordinator()
    if not (dist.is_available() and dist.is_initialized()):
        refuse_launched_without_group(operation)
        return Coordinator()
    _register_exit_handler()  # again: ahead of exit handlers registered since
    base = _base_key(dist, process_group)
    timeout = rendezvous_timeout()
    if timeout is not None:
        _rendezvous(dist, base, process_group, operation, timeout)
    group = _group(dist, base, "caller", process_group, collective_timeout())
    # every lane of a process group shares one plan cache (the base key)
    return GroupCoordinator(group, cache_key=base, process_group=process_group)


def lane_coordinator(coord: Coordinator, lane: str) -> Coordinator:
    """(every rank, on the caller's thread) A coordinator on a gloo group of its own
    (``lane``) for ``coord``'s process group: for work that runs in a thread of its own,
    such as the local tier's drains, whose collectives must never share a group with
    the caller's or the async commits' (see the module's docstring)."""
    if not isinstance(coord, GroupCoordinator):
        return coord
    import torch.distributed as dist

    group = _group(dist, coord.cache_key, lane, coord.process_group, collective_timeout())
    return GroupCoordinator(group, cache_key=coord.cache_key, process_group=coord.process_group)


def background_coordinator(coord: Coordinator) -> Coordinator:
    """(every rank, on the caller's thread, right after ``coordinator_for``) The
    coordinator of the background lane for ``coord``'s process group: what an async
    save's commit uses. Created here, never in the background thread: a gloo group of
    bcp's own (:class:`OwnGroupCoordinator`) when the job's store address is known,
    else a ``new_group`` group."""
    if not isinstance(coord, GroupCoordinator):
        return coord
    import torch.distributed as dist

    key = (*coord.cache_key, "background")
    if key not in _OWN_GROUPS:
        _OWN_GROUPS[key] = _own_gloo_group(dist, coord, "background")
    own = _OWN_GROUPS[key]
    if own is not None:
        return OwnGroupCoordinator(own, coord.rank, coord.world_size, coord.cache_key)
    group = _group(dist, coord.cache_key, "background", coord.process_group, collective_timeout())
    return GroupCoordinator(group, cache_key=coord.cache_key, process_group=coord.process_group)


@dataclasses.dataclass(frozen=True)
class Lanes:
    """The coordinators of every lane of one process group, all of their groups
    created (:func:`ready`): what a save, its commit, a drain and a load use, so that
    no group is created inside a save's phases."""

    #: the caller's thread (save, load, the manager's collectives)
    caller: Coordinator
    #: an async save's commit (its background thread)
    background: Coordinator
    #: further lanes by name ("drain": the local tier's drains)
    others: Mapping[str, Coordinator] = dataclasses.field(default_factory=dict)

    def lane(self, name: str) -> Coordinator:
        """The coordinator of lane ``name``, asked for when ready() was called."""
        return self.others[name]


def ready(process_group: Any = None, operation: str = "bcp", *, lanes: tuple[str, ...] = ()) -> Lanes:
    """(every rank of the group, on the caller's thread, before any phase) The one
    entry into bcp's groups: the rendezvous of ``operation``, then the caller's lane,
    the background lane and each lane of ``lanes``, each created on first use and kept
    for the process (the network choice of ``bcp.coordination.gloo_network`` is made
    as each is created). ``CheckpointManager`` calls it when constructed, ``bcp.save``
    and ``bcp.async_save`` at each call (a dictionary look-up once the groups exist),
    so a save's phases only run collectives on groups that exist already."""
    caller = coordinator_for(process_group, operation)
    return Lanes(
        caller=caller,
        background=background_coordinator(caller),
        others={name: lane_coordinator(caller, name) for name in lanes},
    )


#: (base key, lane) -> bcp's own ProcessGroupGloo, or None where one could not be built
_OWN_GROUPS: dict[tuple, Any] = {}

#: how long a rank tries to reach the job's store at MASTER_ADDR:MASTER_PORT
STORE_CONNECT_SECONDS = 30.0


def _own_gloo_group(dist: Any, coord: GroupCoordinator, lane: str) -> Any:
    """(every rank of ``coord``, collective on its group) A ``ProcessGroupGloo`` of
    bcp's own, built on the job's store (a ``TCPStore`` client of MASTER_ADDR and
    MASTER_PORT, set by ``env://`` initialisation and torchrun) under a fresh prefix,
    and never registered with torch.distributed, so ``destroy_process_group()`` does
    not shut it down. None on every rank when some rank cannot reach the store (or
    the job did not say where it is): the caller falls back to ``new_group``."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    prefix = coord.broadcast(f"bcp/{uuid.uuid4().hex}/{lane}/" if coord.is_coordinator else None)
    store = None
    if address and port:
        connect = min(datetime.timedelta(seconds=STORE_CONNECT_SECONDS), collective_timeout())
        try:
            store = dist.TCPStore(address, int(port), is_master=False, timeout=connect, wait_for_workers=False)
        except (RuntimeError, ValueError, OSError) as e:
            log.info(
                "bcp's %s group falls back to new_group: the store at %s:%s is out of reach: %s", lane, address, port, e
            )
    if coord.any_failed(store is None):  # every rank the same way
        return None
    return gloo_network.create_group(
        lambda: dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), coord.rank, coord.world_size, collective_timeout()
        ),
        coord.process_group,
    )


def _rendezvous(dist: Any, base: tuple, process_group: Any, operation: str, timeout: datetime.timedelta) -> None:
    """A monitored barrier of every rank of the group, within ``timeout``: the
    rendezvous group is created with that timeout too, so a first operation that
    some rank never calls fails as fast."""
    if base in _BROKEN:
        raise RanksMissingError(
            f"{operation}: bcp cannot run collectives on this process group any more in this job: {_BROKEN[base]}. "
            f"process_group=bcp.LOCAL still saves and loads from this process alone",
            operation=operation,
        )
    group = None
    try:
        group = _group(dist, base, "rendezvous", process_group, timeout)
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
    except (RuntimeError, RankFailedError) as e:  # DistError, DistStoreError: gloo's timeouts and closed pairs;
        # RankFailedError: a rank never came to create the rendezvous group (bcp.coordination.gloo_network)
        error = _missing_error(dist, process_group, group, operation, timeout, e)
        _BROKEN[base] = f"an earlier {operation} was not called by every rank ({e})"
        raise error from e


def _missing_error(
    dist: Any, process_group: Any, group: Any, operation: str, timeout: datetime.timedelta, cause: BaseException
) -> RanksMissingError:
    """The error of a failed rendezvous: which ranks did not arrive (global ranks; as
    far as gloo's message tells), and what to do."""
    if process_group is None:
        members = list(range(dist.get_world_size()))
    else:
        members = dist.get_process_group_ranks(process_group)
    me = dist.get_rank()
    text = str(cause)
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    partial = found is None
    if isinstance(cause, gloo_network.RanksNotArrivedError):  # never came to create the group: all of them known
        found_ranks = [members.index(r) for r in cause.missing if r in members]
        partial = False
    elif found is None:  # the group's creation timed out: the store keys it waited for (the first missing rank)
        keys = re.search(r"keys: (.*)", text)
        found_ranks = [int(k) for k in re.findall(r"/(\d+)(?:,|$)", keys.group(1))] if keys else []
    else:
        found_ranks = [int(r) for r in found.group(1).replace(" ", "").split(",") if r]
    missing = sorted({members[r] for r in found_ranks if 0 <= r < len(members)} - {me})
    seconds = f"{timeout.total_seconds():g}"
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        if partial and len(members) > len(missing) + 1:
            who += " (and perhaps others)"
        who += f" did not call it within {seconds} s"
    elif "from rank 0" in text or "closed by peer" in text or "pair closure" in text:
        who = (
            f"rank {members[0]} (the group's coordinator) did not confirm within {seconds} s that every rank "
            f"called it (it did not call it, or another rank did not, or they called it more than {seconds} s apart)"
        )
    else:
        who = f"not every rank called it within {seconds} s"
    return RanksMissingError(
        f"{operation} on rank {me}: {who} ({len(members)} ranks in its process group; BCP_RENDEZVOUS_TIMEOUT). "
        f"Every rank of the process group must call {operation}. To save or load from fewer ranks, pass "
        f"process_group= a group of exactly the ranks that call it, or process_group=bcp.LOCAL to save or load "
        f"from this process alone (what a rank-0-only checkpoint hook needs). Ranks that are only slow to get "
        f"there need a larger BCP_RENDEZVOUS_TIMEOUT",
        missing=missing,
        operation=operation,
    )


#: run at exit before bcp's groups are released (``async_save`` finishes its saves)
_BEFORE_RELEASE: list[Callable[[], None]] = []


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, before bcp's groups are released."""
    _BEFORE_RELEASE.append(fn)


def _exit_handler() -> None:
    """bcp's one exit handler: first what must still talk to other ranks (finishing
    async saves in flight), then the release of bcp's groups. One handler, so that
    their order does not depend on when each was registered."""
    for fn in _BEFORE_RELEASE:
        try:
            fn()
        except Exception:  # the next one and the release must still run
            log.exception("bcp's exit handler %s failed", getattr(fn, "__name__", fn))
    release_groups()


def _register_exit_handler() -> None:
    """(Re-)register the exit handler: atexit runs the last registered first, so bcp
    finishes its saves before any handler registered earlier (one that destroys the
    default process group, say) runs."""
    atexit.unregister(_exit_handler)
    atexit.register(_exit_handler)


def release_groups() -> None:
    """Destroy bcp's gloo groups. Runs at exit: a process group left to interpreter
    finalisation can abort the process while gloo threads are still running."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    own = [pg for pg in _OWN_GROUPS.values() if pg is not None]
    _OWN_GROUPS.clear()
    for pg in own:
        try:
            pg.shutdown()
        except RuntimeError:  # already shut down
            pass
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed with the default group
                pass


def group_destroyed(coord: Coordinator) -> bool:
    """Whether ``coord``'s gloo group was destroyed under it
    (``dist.destroy_process_group()`` by the caller)."""
    if not isinstance(coord, GroupCoordinator):
        return False
    dist = coord.dist
    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        dist.get_process_group_ranks(coord.group)
    except (ValueError, RuntimeError, KeyError):
        return True
    return False


_register_exit_handler()
