"""Where bcp's gloo group listens, and a bound on how long connecting it may take.

bcp runs its collectives on a gloo group of its own (``bcp.coordination.lanes``), also in
NCCL jobs. Gloo listens on the address the host name resolves to unless
``GLOO_SOCKET_IFNAME`` names an interface; on hosts whose name resolves to a loopback
address (127.0.1.1 is the Debian/Ubuntu default), to no local address (gloo then
falls back to 127.0.0.1) or to an address of another interface (a docker bridge),
the other hosts cannot reach it. An NCCL job configured with ``NCCL_SOCKET_IFNAME``
alone trains, then hangs at its first checkpoint for the group's timeout. So:

* :func:`choose` picks, when the user did not, the interface whose address routes
  to the job's master (``MASTER_ADDR``): the job's store already reaches the master
  from there, so the other ranks can reach it too. It is set as
  ``GLOO_SOCKET_IFNAME`` while bcp's group is created, then the environment is
  restored. ``BCP_GLOO_AUTO_IFNAME=0`` turns this off.
* :func:`create_group` first waits until every rank of the group has come to create
  it (through the job's store, ``MASTER_ADDR:MASTER_PORT``, for up to
  ``BCP_COLLECTIVE_TIMEOUT``), then gives gloo ``BCP_GLOO_CONNECT_TIMEOUT`` seconds
  (default 30) to connect the ranks, and raises :class:`GroupConnectError` naming
  ``GLOO_SOCKET_IFNAME`` when it does not. No public API gives gloo a connect
  timeout of its own, so the creation runs in a daemon thread; after the error that
  thread stays blocked inside gloo until the group's own timeout
  (``BCP_COLLECTIVE_TIMEOUT``) ends it, and later calls raise the same error at once.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from bcp.coordination.collectives import collective_timeout
from bcp.errors import GroupConnectError, RankFailedError

log = logging.getLogger(__name__)
T = TypeVar("T")

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
AUTO_ENV = "BCP_GLOO_AUTO_IFNAME"
CONNECT_TIMEOUT_ENV = "BCP_GLOO_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 30.0

#: the address gloo falls back to when the host name resolves to nothing it can bind
GLOO_FALLBACK_ADDRESS = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where this rank's gloo group will listen.

    ``interface``: what bcp sets ``GLOO_SOCKET_IFNAME`` to while creating its group
    (None: the environment is left as it is). ``address``: the address gloo binds to
    (best knowledge, for messages). ``reason``: why, in words."""

    interface: str | None
    address: str
    reason: str


def connect_timeout() -> float:
    """``BCP_GLOO_CONNECT_TIMEOUT`` in seconds (0 or less: no bound but the group's own timeout)."""
    raw = os.environ.get(CONNECT_TIMEOUT_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_CONNECT_TIMEOUT
    except ValueError:
        raise ValueError(f"{CONNECT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


# -- this host's interfaces and routes ---------------------------------------------------

_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4 and IPv6 address of this host, in the
    kernel's order (Linux: SIOCGIFCONF, /proc/net/if_inet6; elsewhere: nothing). An
    IPv4 alias with a label is listed under its label (``eth0:1``), as gloo sees it."""
    if not sys.platform.startswith("linux"):
        return []
    out: list[tuple[str, str]] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        slots = 64
        while True:
            buf = array.array("B", bytes(_IFREQ_SIZE * slots))
            request = struct.pack("iL", len(buf), buf.buffer_info()[0])
            used = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, request))[0]
            if used < len(buf):
                break
            slots *= 4  # the kernel filled the buffer: there may be more
        raw = buf.tobytes()
        for at in range(0, used, _IFREQ_SIZE):
            name = raw[at : at + 16].split(b"\0", 1)[0].decode(errors="replace")
            out.append((name, socket.inet_ntoa(raw[at + 20 : at + 24])))  # sockaddr_in: family, port, address
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                out.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    return out


def interface_of(address: str, addresses: list[tuple[str, str]] | None = None) -> str | None:
    """The local interface holding ``address``, or None when no interface does."""
    want = _ip(address)
    for name, addr in interface_addresses() if addresses is None else addresses:
        if _ip(addr) == want:
            return name
    return None


def route_source(address: str) -> str | None:
    """The local address this host sends from to reach ``address`` (the kernel's route;
    a connected UDP socket sends nothing), or None when there is no route."""
    try:
        family = socket.AF_INET6 if _ip(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0]).split("%", 1)[0]
    except (OSError, ValueError):
        return None


def gloo_default_address(hostname: str | None = None) -> tuple[str, str]:
    """The address gloo binds to without ``GLOO_SOCKET_IFNAME`` and why, as gloo decides:
    the first address the host name resolves to that a socket can bind, else 127.0.0.1."""
    hostname = hostname or socket.gethostname()
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(sockaddr)
        except OSError:
            continue
        return str(sockaddr[0]), f"the host name {hostname!r} resolves to {sockaddr[0]}"
    found = ", ".join(sorted({str(i[4][0]) for i in infos})) or "nothing"
    return GLOO_FALLBACK_ADDRESS, (
        f"the host name {hostname!r} resolves to {found}, not an address of this host, so gloo falls back to "
        f"{GLOO_FALLBACK_ADDRESS}"
    )


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address.split("%", 1)[0])


def _resolve(host: str) -> str | None:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


# -- the choice --------------------------------------------------------------------------


def choose(environ: Any = None) -> Choice:
    """Where bcp's gloo group should listen on this rank (see the module's docstring).
    Each rank chooses for itself, from its own routes."""
    env = os.environ if environ is None else environ
    addresses = interface_addresses()
    user = env.get(IFNAME_ENV, "")
    if user:
        first = user.split(",")[0]
        address = next((a for n, a in addresses if n == first), "no address found on it")
        return Choice(None, address, f"{IFNAME_ENV}={user}, set by the user")
    default, why = gloo_default_address()
    if env.get(AUTO_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return Choice(None, default, f"{why}; {AUTO_ENV}=0 turns the automatic choice off")
    master_host = env.get("MASTER_ADDR", "")
    if not master_host:
        return Choice(None, default, f"{why}; MASTER_ADDR is not set, so bcp cannot tell which interface reaches it")
    master = _resolve(master_host)
    if master is None:
        return Choice(None, default, f"{why}; MASTER_ADDR={master_host} does not resolve")
    if _ip(master).is_loopback:
        return Choice(None, default, f"{why}; MASTER_ADDR={master_host} is this host (single-host job)")
    source = route_source(master)
    interface = interface_of(source, addresses) if source is not None else None
    if source is None or interface is None:
        return Choice(None, default, f"{why}; no local interface found that routes to MASTER_ADDR={master_host}")
    own = interface_of(default, addresses)
    if _ip(default).is_loopback:
        problem = "a loopback address the other hosts cannot reach"
    elif own is None:
        problem = "an address of no interface of this host"
    elif own != interface:
        problem = f"an address of {own}, not of {interface}, the interface that reaches MASTER_ADDR"
    else:
        return Choice(None, default, f"{why}, an address of {interface}, which reaches MASTER_ADDR={master_host}")
    return Choice(
        interface,
        source,
        f"{why}, {problem}; {interface} ({source}) reaches MASTER_ADDR={master_host}",
    )


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in os.environ (read by gloo's C++ code) for the block only."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- creating the group ------------------------------------------------------------------

#: creations abandoned by the watchdog whose thread is still blocked in gloo
_STUCK: list[tuple[threading.Thread, GroupConnectError]] = []
#: groups created so far per member ranks (every rank creates them in the same order)
_CREATED: dict[tuple[Any, ...], int] = {}


def create_group(
    create: Callable[[], T], process_group: Any = None, *, arrival_timeout: datetime.timedelta | None = None
) -> T:
    """``create()`` (a ``dist.new_group(..., backend="gloo")`` call over the ranks of
    ``process_group``, or of the job) with bcp's choice of interface, and within
    ``BCP_GLOO_CONNECT_TIMEOUT`` seconds of every rank's arrival; raises
    :class:`GroupConnectError`, naming ``GLOO_SOCKET_IFNAME``, when gloo cannot connect.
    ``arrival_timeout``: how long to wait for every rank to come (default
    ``BCP_COLLECTIVE_TIMEOUT``; the rendezvous group waits only its own timeout)."""
    import torch.distributed as dist

    for thread, error in _STUCK:
        if thread.is_alive():
            raise GroupConnectError(
                f"{error} (an earlier attempt to create bcp's gloo group in this process is still stuck; "
                f"restart the job with the setting fixed)",
                rank=error.rank,
                address=error.address,
            )
    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else None
    size = len(ranks) if ranks is not None else dist.get_world_size()
    rank = dist.get_rank()
    choice = choose()
    if choice.interface is not None:
        log.info("rank %d: bcp's gloo group listens on %s: %s", rank, choice.interface, choice.reason)
    else:
        log.debug("rank %d: bcp's gloo group listens on %s: %s", rank, choice.address, choice.reason)
    if size == 1:
        with _environment(IFNAME_ENV, choice.interface):
            return create()
    limit = connect_timeout()
    members = ranks if ranks is not None else ("world", size)
    count = _CREATED.get(members, 0)
    _CREATED[members] = count + 1
    digest = hashlib.sha1(repr(members).encode(), usedforsecurity=False).hexdigest()[:16]
    arrived = (
        _wait_for_every_rank(f"{digest}/{count}", size, rank, limit, arrival_timeout, ranks) if limit > 0 else False
    )
    with _environment(IFNAME_ENV, choice.interface):
        if not arrived:  # no bound of bcp's own: the group's timeout applies
            return _wrapped(create, rank, choice, None)
        return _with_watchdog(create, rank, choice, limit, subgroup=ranks is not None)


def _wrapped(create: Callable[[], T], rank: int, choice: Choice, limit: float | None) -> T:
    started = time.monotonic()
    try:
        return create()
    except RuntimeError as e:  # gloo's connect errors (refused, timed out) are RuntimeErrors
        raise _connect_error(rank, choice, time.monotonic() - started, limit, e) from e


def _with_watchdog(create: Callable[[], T], rank: int, choice: Choice, limit: float, *, subgroup: bool = False) -> T:
    result: list[Any] = []
    done = threading.Event()
    started = time.monotonic()

    def run() -> None:
        try:
            result.append(("ok", create()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller (or dropped, if it gave up waiting)
            result.append(("error", e))
            log.debug("rank %d: creating bcp's gloo group failed: %r", rank, e)
        finally:
            done.set()

    thread = threading.Thread(target=run, name="bcp-gloo-group", daemon=True)
    thread.start()
    if not done.wait(limit):
        error = _connect_error(rank, choice, time.monotonic() - started, limit, None, subgroup=subgroup)
        _STUCK.append((thread, error))
        raise error
    kind, value = result[0]
    if kind == "ok":
        return value
    if isinstance(value, RuntimeError):
        raise _connect_error(rank, choice, time.monotonic() - started, limit, value) from value
    raise value


def _connect_error(
    rank: int,
    choice: Choice,
    elapsed: float,
    limit: float | None,
    cause: BaseException | None,
    *,
    subgroup: bool = False,
) -> GroupConnectError:
    if cause is not None:
        first_line = (str(cause).splitlines() or [""])[0]
        what = f"gloo failed after {elapsed:.1f} s ({type(cause).__name__}: {first_line})"
    else:
        what = f"it was not connected within {limit:g} s although every rank had arrived"
    hints = []
    master_host = os.environ.get("MASTER_ADDR", "")
    master = _resolve(master_host) if master_host else None
    source = route_source(master) if master is not None else None
    interface = interface_of(source) if source is not None else None
    if interface is not None and not _ip(str(source)).is_loopback:
        hints.append(f"on this host {interface} ({source}) reaches MASTER_ADDR={master_host}")
    nccl = os.environ.get("NCCL_SOCKET_IFNAME")
    if nccl:
        hints.append(f"NCCL_SOCKET_IFNAME is {nccl}")
    nccl_hint = f" ({'; '.join(hints)})" if hints else ""
    bound = (
        f"; {CONNECT_TIMEOUT_ENV} (now {limit:g} s) sets how long bcp waits for the connection"
        if limit is not None
        else ""
    )
    message = (
        f"rank {rank}: the ranks could not connect bcp's gloo group: {what}. This rank's gloo listens on "
        f"{choice.address} ({choice.reason}). Every rank must reach every other rank's address: set "
        f"{IFNAME_ENV} to the network interface that reaches the other hosts{nccl_hint}, on every rank{bound}"
    )
    if subgroup and cause is None:  # arrived, never met: most likely torch's names for a group of some ranks
        message += (
            ". Or, with process_group= a group of some ranks: torch names the gloo group bcp makes for it by how many "
            "process groups each rank holds, so ranks holding different numbers (subgroups some created and others "
            "did not) never meet"
        )
    return GroupConnectError(message, rank=rank, address=choice.address)


# -- every rank arrived? ------------------------------------------------------------------


def _wait_for_every_rank(
    name: str,
    size: int,
    rank: int,
    limit: float,
    arrival_timeout: datetime.timedelta | None = None,
    members: tuple[int, ...] | None = None,
) -> bool:
    """Wait until every rank of the group has come to create it, through the job's
    store (``MASTER_ADDR:MASTER_PORT``), so that the connect bound does not count a
    rank that is late (still evaluating, still writing logs). True once every rank is
    there; False when the store cannot be reached (the bound is then not applied);
    raises RankFailedError when some rank has not come within BCP_COLLECTIVE_TIMEOUT.
    ``name`` is the same on every rank for the same group (its members, and how many
    such groups were created before)."""
    from torch.distributed import TCPStore

    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        log.debug("rank %d: no MASTER_ADDR/MASTER_PORT, bcp's gloo group gets no connect bound", rank)
        return False
    timeout = arrival_timeout if arrival_timeout is not None else collective_timeout()
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=min(timeout, datetime.timedelta(seconds=limit)))
    except (RuntimeError, OSError, ValueError) as e:
        log.debug("rank %d: the job's store at %s:%s cannot be reached (%s): no connect bound", rank, host, port, e)
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"bcp/gloo_arrival/{attempt}/{name}"
    store.set(f"{prefix}/rank{rank}", "1")  # who came, for the error below
    if store.add(f"{prefix}/count", 1) >= size:
        store.set(f"{prefix}/all", "1")
    try:
        store.set_timeout(timeout)
        store.wait([f"{prefix}/all"])
    except RuntimeError as e:  # the store's timeout (DistStoreError is a RuntimeError)
        here = store.add(f"{prefix}/count", 0)
        everyone = members if members is not None else tuple(range(size))
        missing = [r for r in everyone if not store.check([f"{prefix}/rank{r}"])]
        raise RanksNotArrivedError(
            f"rank {rank}: only {here} of the {size} ranks came to create bcp's gloo group within "
            f"{timeout.total_seconds():g} s ({e}); every rank must call save/load (BCP_COLLECTIVE_TIMEOUT sets "
            f"how long bcp waits)",
            missing=missing,
        ) from e
    return True


class RanksNotArrivedError(RankFailedError):
    """Some ranks never came to create bcp's gloo group; ``missing``: their global ranks."""

    def __init__(self, message: str, *, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing
