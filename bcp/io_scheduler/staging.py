"""Reusable host staging memory.

Memory touched for the first time copies at 0.4-1 GB/s on this machine, reused
memory at 11-13 GB/s, so staging buffers are allocated once and kept for the life of
the process (a pool of equal slabs). With CUDA present the slabs are pinned, so
device-to-host copies can be asynchronous. The pool's capacity is the memory
budget: ``acquire`` blocks while every slab is in use, which is what bounds a save's
in-flight bytes.

Pinned memory is slow to allocate (about 1 GB/s with cudaHostAlloc), so the first
save of a run would pay for it on the critical path: :meth:`StagingPool.reserve`
allocates slabs ahead of time in a background thread (``bcp.reserve_staging``), and
without a reservation a pinned pool lends pageable stand-in slabs while it pins in
the background (``acquire`` never waits for pinning).

The budget (``default_budget``) is per host: 40% of the available memory, capped by
the cgroup's limit, divided among the job's processes on the host.
Pinned slabs are allocated at exactly the slab size: torch's pinned allocator rounds
every request up to a power of two, and a slab of 32 MiB plus alignment slack would
cost 64 MiB of pinned memory.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)

#: Default slab (= chunk) size; see docs/benchmarks.md for the measurement behind it.
DEFAULT_SLAB_BYTES = 32 << 20
_ALIGN = 4096
#: A cgroup limit at or above this is "no limit" (cgroup v1 writes 2^63 rounded to pages).
_NO_LIMIT = 1 << 60


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, names: tuple[str, ...]) -> int:
    """The first of ``names`` found in a cgroup ``memory.stat`` (0 if none)."""
    try:
        with open(path) as f:
            values = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except OSError:
        return 0
    for name in names:
        if name in values:
            try:
                return int(values[name])
            except ValueError:
                return 0
    return 0


def _cgroup_dirs(base: str, path: str) -> list[str]:
    """``base``/``path`` and each of its ancestors up to ``base`` that exist, deepest
    first (inside a container the cgroup's own files are at ``base`` itself)."""
    parts = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    out = []
    for k in range(len(parts), -1, -1):
        d = os.path.join(base, *parts[:k])
        if os.path.isdir(d):
            out.append(d)
    return out


def cgroup_available(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's cgroup memory limit still allows (the tightest of its
    cgroup and their ancestors), or None when no limit applies. Usage counts without
    the inactive page cache (reclaimed before the limit is hit: checkpoint files
    written earlier must not shrink the budget). cgroup v2: ``memory.max`` minus
    ``memory.current``; v1: ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``."""
    v2_path = v1_path = "/"
    try:
        with open(self_cgroup) as f:
            for line in f:
                hier, _sep, rest = line.strip().partition(":")
                controllers, _sep, path = rest.partition(":")
                if hier == "0" and controllers == "":
                    v2_path = path or "/"
                elif "memory" in controllers.split(","):
                    v1_path = path or "/"
    except OSError:
        pass
    best: int | None = None
    layouts = (
        (root, v2_path, "memory.max", "memory.current", ("inactive_file",)),
        (
            os.path.join(root, "memory"),
            v1_path,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            ("total_inactive_file", "inactive_file"),
        ),
    )
    for base, path, limit_file, usage_file, inactive in layouts:
        for d in _cgroup_dirs(base, path):
            limit = _read_int(os.path.join(d, limit_file))
            if limit is None or limit >= _NO_LIMIT:
                continue
            usage = _read_int(os.path.join(d, usage_file)) or 0
            used = max(0, usage - _stat_value(os.path.join(d, "memory.stat"), inactive))
            room = max(0, limit - used)
            best = room if best is None else min(best, room)
    return best


def available_memory(
    meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> int:
    """Bytes of memory available to this process: ``MemAvailable`` (else physical
    memory / 2), capped by what the cgroup memory limit still allows (in a container
    ``MemAvailable`` is the host's)."""
    host = _meminfo_available(meminfo)
    if host is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    limited = cgroup_available(cgroup_root, self_cgroup)
    return host if limited is None else min(host, limited)


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Processes of this job on this host: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else 1."""
    environ = os.environ if environ is None else environ
    try:
        return max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_budget(*, environ: Mapping[str, str] | None = None, available: int | None = None) -> int:
    """``BCP_MEMORY_BUDGET`` bytes if set (this process's), else 40% of the memory
    available on this host (capped by the cgroup limit) shared by the job's processes
    on the host (``LOCAL_WORLD_SIZE``), at least 256 MiB."""
    environ = os.environ if environ is None else environ
    env = environ.get("BCP_MEMORY_BUDGET")
    if env:
        return int(float(env))
    available = available_memory() if available is None else available
    return max(256 << 20, int(available * 0.4) // local_world_size(environ))


class Slab:
    """One page-aligned staging buffer of at least ``pool.slab_bytes`` bytes."""

    __slots__ = ("standin", "tensor")

    def __init__(self, tensor: torch.Tensor, *, standin: bool = False) -> None:
        self.tensor = tensor
        #: pageable memory lent while the pool's pinned slabs are still being allocated
        self.standin = standin

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def view(self, nbytes: int, shift: int = 0) -> torch.Tensor:
        """``nbytes`` of the slab starting ``shift`` (< 4096) bytes in, so the data's
        address modulo 4096 can match its file offset's (O_DIRECT). Where the shifted
        bytes would not fit (an exactly sized pinned slab) the view starts at 0: the
        storage then writes those bytes through the page cache, still correctly."""
        if shift + nbytes > self.capacity:
            shift = 0
        if nbytes > self.capacity:
            raise ValueError(f"a staged chunk of {nbytes} bytes does not fit a slab of {self.capacity}")
        return self.tensor[shift : shift + nbytes]


class StagingPool:
    """Slabs of ``slab_bytes``, at most ``capacity // slab_bytes`` of them, reused.

    A pinned pool never makes a caller wait for pinning: when no pinned slab is free
    and the budget has room, ``acquire`` lends a pageable stand-in slab at once
    (device copies to and from pageable memory are correct, only slower) and a
    background thread pins slabs up to the demand seen; a stand-in is dropped when
    released, so pinned slabs take its place in the budget."""

    def __init__(self, capacity: int, slab_bytes: int = DEFAULT_SLAB_BYTES, *, pinned: bool | None = None) -> None:
        self.slab_bytes = slab_bytes
        self.max_slabs = max(2, capacity // slab_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._free: list[Slab] = []
        self._allocated = 0  # the pool's own slabs (pinned in a pinned pool): existing or being made
        self._standins = 0  # stand-ins lent and not yet released
        self._in_use = 0  # the pool's own slabs lent and not yet released
        self._target = 0  # slabs the background pinner brings the pool up to
        self._pinner: threading.Thread | None = None
        #: set at interpreter exit: the pinner stops before torch's allocators are torn down
        self._closing = False
        _POOLS.add(self)
        self._pin_failed = False
        self._cond = threading.Condition()
        #: stand-in slabs lent so far (each one an acquire that did not wait for pinning)
        self.standins_lent = 0

    @property
    def capacity(self) -> int:
        return self.max_slabs * self.slab_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool's own slabs (pinned in a pinned pool; stand-ins not counted)."""
        return self._allocated * self.slab_bytes

    def _pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory (tests replace this)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _new_slab(self, *, touch: bool = True) -> Slab:
        """A slab of the pool's own. ``touch``: write every page now (reservations and
        the background pinner, ahead of the save). A pageable slab made inside
        ``acquire`` is not touched: the save's copy into it is the first touch, so the
        first save pays for its memory once, as a copy into fresh memory does, not a
        zeroing pass and then the copy (every byte a save writes is copied or zeroed
        explicitly, as for a stand-in)."""
        if self.pinned:
            # Exactly slab_bytes (see the module docstring); pinned memory is page-aligned.
            raw = self._pinned_buffer(self.slab_bytes)
            if raw.data_ptr() % _ALIGN == 0:
                raw.zero_()
                return Slab(raw)
            raw = self._pinned_buffer(self.slab_bytes + _ALIGN)
        else:
            raw = torch.empty(self.slab_bytes + 2 * _ALIGN, dtype=torch.uint8)
        if touch:
            # Touch every page now: the save's copy runs at warm-memory speed (first touch
            # is 0.4-1 GB/s here).
            raw.zero_()
        return Slab(self._aligned(raw))

    def _aligned(self, raw: torch.Tensor) -> torch.Tensor:
        skip = (-raw.data_ptr()) % _ALIGN  # page-aligned start, and room to shift by < 4096
        return raw[skip : skip + min(self.slab_bytes + _ALIGN, raw.numel() - skip)]

    def _standin(self) -> Slab:
        """Pageable memory for one use, not zeroed: the copy into it is its first
        touch, and every byte a save writes is copied or zeroed explicitly."""
        return Slab(self._aligned(torch.empty(self.slab_bytes + 2 * _ALIGN, dtype=torch.uint8)), standin=True)

    def acquire(self) -> Slab:
        with self._cond:
            while not self._free and self._allocated + self._standins >= self.max_slabs:
                self._cond.wait()
            if self._free:
                self._in_use += 1
                return self._free.pop()
            standin = self.pinned
            if standin:
                self._standins += 1
                self.standins_lent += 1
                self._target = max(self._target, self._in_use + self._standins)  # slabs in use: the demand seen
                self._start_pinner()
            else:
                self._allocated += 1
                self._in_use += 1
        try:
            return self._standin() if standin else self._new_slab(touch=False)
        except BaseException:
            with self._cond:
                if standin:
                    self._standins -= 1
                else:
                    self._allocated -= 1
                    self._in_use -= 1
                self._cond.notify_all()
            raise

    def _start_pinner(self) -> None:
        """(lock held) Start the background pinner unless it runs or pinning failed."""
        if self._pinner is None and not self._pin_failed and not self._closing and self._allocated < self._target:
            self._pinner = threading.Thread(target=self._pin_loop, name="bcp-pin-staging", daemon=True)
            self._pinner.start()

    def _pin_loop(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._closing
                    and self._allocated < self._target
                    and self._allocated + self._standins >= self.max_slabs
                ):
                    self._cond.wait()  # the budget is lent to stand-ins: pin once they come back
                if self._allocated >= self._target or self._closing:
                    self._pinner = None
                    return
                self._allocated += 1
            try:
                slab = self._new_slab()
            except BaseException as e:  # noqa: BLE001 - saves go on with stand-ins
                with self._cond:
                    self._allocated -= 1
                    self._pin_failed = True
                    self._pinner = None
                    self._cond.notify_all()
                log.warning("pinning staging memory failed (saves go on with pageable memory): %s", e)
                return
            self._add_free(slab)

    def _add_free(self, slab: Slab) -> None:
        """A slab just made (pinner, reservation): free, not returned by a user."""
        with self._cond:
            self._free.append(slab)
            self._cond.notify_all()

    def pinning(self) -> bool:
        """Whether the background pinner is running."""
        with self._cond:
            return self._pinner is not None

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait until the background pinner has stopped; return whether it has."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pinner is None, timeout)

    def would_block(self) -> bool:
        """Whether ``acquire`` would wait right now."""
        with self._cond:
            return not self._free and self._allocated + self._standins >= self.max_slabs

    def release(self, slab: Slab) -> None:
        with self._cond:
            if slab.standin:
                self._standins -= 1  # dropped: its share of the budget goes to a pinned slab
            else:
                self._free.append(slab)
                self._in_use -= 1
            self._cond.notify_all()

    def reserve(self, nbytes: int) -> int:
        """Allocate free slabs (in this thread) until ``nbytes`` of staging, or the
        whole capacity, is ready; return the bytes now allocated. Saves running at
        the same time take slabs as they appear."""
        want = min(self.max_slabs, -(-max(0, nbytes) // self.slab_bytes))
        while True:
            with self._cond:
                while (
                    not self._closing and self._allocated < want and self._allocated + self._standins >= self.max_slabs
                ):
                    self._cond.wait()  # stand-ins in use hold the budget until released
                if self._allocated >= want or self._closing:
                    return self.allocated_bytes
                self._allocated += 1
            try:
                slab = self._new_slab()
            except BaseException:
                with self._cond:
                    self._allocated -= 1
                    self._cond.notify_all()
                raise
            self._add_free(slab)

    def trim(self) -> None:
        """Free the slabs not in use (their memory returns to the system)."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()
            self._target = min(self._target, self._allocated)


def _stop_background_allocation() -> None:
    """At interpreter exit: let every pool's pinner finish the slab it is allocating
    and stop. A thread still inside torch's allocator while the interpreter tears
    down aborts the process ("terminate called without an active exception"): a
    resumed job that exits without saving did, after every bcp call had returned."""
    for pool in list(_POOLS):
        with pool._cond:
            pool._closing = True
            pool._cond.notify_all()
            pinner = pool._pinner
        if pinner is not None:
            pinner.join(timeout=60)
    for thread in list(_RESERVING):
        thread.join(timeout=60)


#: every pool of this process (weakly), for the exit hook
_POOLS: weakref.WeakSet[StagingPool] = weakref.WeakSet()
#: reservation threads still running, for the exit hook
_RESERVING: set[threading.Thread] = set()
atexit.register(_stop_background_allocation)


class StagingReservation:
    """Slabs being allocated ahead of a save, in a background thread (stopped and
    joined at interpreter exit, see :func:`_stop_background_allocation`)."""

    def __init__(self, pool: StagingPool, nbytes: int, *, background: bool = True) -> None:
        self.pool = pool
        #: the bytes asked for (capped by the pool's capacity)
        self.nbytes = min(nbytes, pool.capacity)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="bcp-reserve-staging", daemon=True)
            _RESERVING.add(self._thread)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self.pool.reserve(self.nbytes)
        except BaseException as e:  # noqa: BLE001 - reported by wait(); a save allocates what is missing
            self.error = e
        finally:
            self._done.set()
            _RESERVING.discard(threading.current_thread())

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the slabs are allocated; return the pool's allocated bytes."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"staging reservation of {self.nbytes} bytes still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.pool.allocated_bytes


_default: StagingPool | None = None
_default_lock = threading.Lock()


def default_pool() -> StagingPool:
    """The process-wide pool every save uses unless given another."""
    global _default
    with _default_lock:
        if _default is None:
            _default = StagingPool(default_budget())
        return _default


def _new_pool_in_child() -> None:
    """A forked child makes its own pool: the parent's lock may be held by a thread the child
    lacks (its saves would wait forever), its slabs lent to the parent's saves in flight."""
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_new_pool_in_child)
