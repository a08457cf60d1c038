"""Reusable host staging memory.

Memory touched for the first time copies at 0.4-1 GB/s on this machine, reused
memory at 11-13 GB/s, so staging buffers are allocated once and kept for the life of
the process (a pool of equal slabs). With CUDA present the slabs are pinned, so
device-to-host copies can be asynchronous. The pool's capacity is the memory
budget: ``acquire`` blocks while every slab is in use, which is what bounds a save's
in-flight bytes.

Pinned memory is slow to allocate (about 1 GB/s with cudaHostAlloc), so the first
save of a run would pay for it on the critical path: :meth:`StagingPool.reserve`
allocates slabs ahead of time in a background thread (``bcp.reserve_staging``).
Pinned slabs are allocated at exactly the slab size: torch's pinned allocator rounds
every request up to a power of two, and a slab of 32 MiB plus alignment slack would
cost 64 MiB of pinned memory.
"""

from __future__ import annotations

import os
import threading

import torch

#: Default slab (= chunk) size; see docs/benchmarks.md for the measurement behind it.
DEFAULT_SLAB_BYTES = 32 << 20
_ALIGN = 4096


def available_memory() -> int:
    """Bytes of memory available to this process (MemAvailable, else physical memory / 2)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default_budget() -> int:
    """``BCP_MEMORY_BUDGET`` bytes if set, else 40% of available memory (at least 256 MiB)."""
    env = os.environ.get("BCP_MEMORY_BUDGET")
    if env:
        return int(float(env))
    return max(256 << 20, int(available_memory() * 0.4))


class Slab:
    """One page-aligned staging buffer of at least ``pool.slab_bytes`` bytes."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

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
    """Slabs of ``slab_bytes``, at most ``capacity // slab_bytes`` of them, reused."""

    def __init__(self, capacity: int, slab_bytes: int = DEFAULT_SLAB_BYTES, *, pinned: bool | None = None) -> None:
        self.slab_bytes = slab_bytes
        self.max_slabs = max(2, capacity // slab_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._free: list[Slab] = []
        self._allocated = 0
        self._cond = threading.Condition()

    @property
    def capacity(self) -> int:
        return self.max_slabs * self.slab_bytes

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slab_bytes

    def _new_slab(self) -> Slab:
        if self.pinned:
            # Exactly slab_bytes (see the module docstring); pinned memory is page-aligned.
            raw = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=True)
            if raw.data_ptr() % _ALIGN == 0:
                raw.zero_()
                return Slab(raw)
            raw = torch.empty(self.slab_bytes + _ALIGN, dtype=torch.uint8, pin_memory=True)
        else:
            raw = torch.empty(self.slab_bytes + 2 * _ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % _ALIGN  # page-aligned start, and room to shift by < 4096
        # Touch every page now: a slab reused for a larger chunk than before would
        # otherwise pay first-touch cost (0.4-1 GB/s here) save after save.
        raw.zero_()
        return Slab(raw[skip : skip + min(self.slab_bytes + _ALIGN, raw.numel() - skip)])

    def acquire(self) -> Slab:
        with self._cond:
            while not self._free and self._allocated >= self.max_slabs:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._allocated += 1
        try:
            return self._new_slab()
        except BaseException:
            with self._cond:
                self._allocated -= 1
                self._cond.notify()
            raise

    def would_block(self) -> bool:
        """Whether ``acquire`` would wait right now."""
        with self._cond:
            return not self._free and self._allocated >= self.max_slabs

    def release(self, slab: Slab) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify()

    def reserve(self, nbytes: int) -> int:
        """Allocate free slabs (in this thread) until ``nbytes`` of staging, or the
        whole capacity, is ready; return the bytes now allocated. Saves running at
        the same time take slabs as they appear."""
        want = min(self.max_slabs, -(-max(0, nbytes) // self.slab_bytes))
        while True:
            with self._cond:
                if self._allocated >= want:
                    return self.allocated_bytes
                self._allocated += 1
            try:
                slab = self._new_slab()
            except BaseException:
                with self._cond:
                    self._allocated -= 1
                    self._cond.notify()
                raise
            self.release(slab)

    def trim(self) -> None:
        """Free the slabs not in use (their memory returns to the system)."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()


class StagingReservation:
    """Slabs being allocated ahead of a save, in a background thread."""

    def __init__(self, pool: StagingPool, nbytes: int, *, background: bool = True) -> None:
        self.pool = pool
        #: the bytes asked for (capped by the pool's capacity)
        self.nbytes = min(nbytes, pool.capacity)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="bcp-reserve-staging", daemon=True)
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
