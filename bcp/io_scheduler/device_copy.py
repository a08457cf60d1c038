"""Copies between device (CUDA) memory and host staging memory, and their ordering.

This is the one module that talks to CUDA streams and events; the save and load
pipelines go through :class:`DeviceCopies`. The rules it enforces (docs/io.md,
"Device tensors") follow torch's stream semantics:

* **Values at the call.** When a save or load starts, each device's side stream is
  made to wait for the caller's current stream (``wait_stream``: no host block), so
  every copy sees exactly the work the caller queued before the call, and nothing
  the caller queues later.
* **Copies run on a side stream**, into (or out of) pinned slabs, ``non_blocking``.
  Each copy is followed by an event; a slab is read by the host, or handed back to
  the pool, only after ``event.synchronize()``. Events are blocking (the waiting
  thread sleeps instead of spinning). Each device has one side stream for the
  process, reused by every save and load: a later save's ``wait_stream`` only adds
  ordering, and an event recorded after a copy completes after it whatever else
  the stream ran. A pageable stand-in slab (staging.py) is as correct: the event
  after the copy still completes only once the copy has.
* **Source memory stays reserved**: every device tensor a copy reads is marked with
  ``record_stream(side stream)``, so the caching allocator does not hand its memory
  to a new tensor until the copy has run, even if the caller frees it at once.
  Temporaries (a non-contiguous source made contiguous) are made on the side stream
  itself, so their reuse is ordered behind the copy.
* **Release**: :meth:`DeviceCopies.wait` blocks the host until every copy queued so
  far has completed; :meth:`DeviceCopies.order_after` makes a stream wait for them
  on the device instead (the CPU goes on).
* **Reads outside the copies** (an incremental save's digests and first-block
  checksums, taken with ``.cpu()`` on background threads, whose current stream is
  not the caller's) wait first for an event recorded on the caller's current stream
  at the call (:func:`caller_done`), so they too see the values at the call.

Only CUDA tensors take this path; tensors of other non-CPU devices are copied
synchronously with ``.to("cpu")``. Tests replace :data:`api` with a recording fake
that defers every copy until its completion is waited on, so a release that comes
too early shows up as wrong bytes on a machine without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from bcp.tensor_io import raw


class CudaApi:
    """The CUDA calls bcp makes, and nothing else."""

    #: ``is_device`` depends on the tensor's device alone (callers that already compare
    #: the device, as ``bcp.kept_plans.fingerprint`` does, need not ask per tensor); a
    #: stand-in without this attribute is asked per tensor
    by_device = True

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in CUDA memory (copies to and from it go through streams)."""
        return t.device.type == "cuda"

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}
        self._side_lock = threading.Lock()

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def side_stream(self, device: torch.device) -> Any:
        """bcp's one side stream of ``device``, made on first use and kept: every save
        and load reuses it (a new stream per save would take another of torch's
        pooled streams each time, each keeping its own cached device memory)."""
        with self._side_lock:
            stream = self._side.get(device)
            if stream is None:
                stream = self._side[device] = self.new_stream(device)
            return stream

    def new_event(self) -> Any:
        """An event whose ``synchronize`` blocks the waiting thread (cudaEventBlockingSync)
        instead of spinning a CPU core for as long as the copy runs."""
        return torch.cuda.Event(blocking=True)

    def use_stream(self, stream: Any) -> Any:
        """Context manager: kernels and allocations inside go to ``stream``."""
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream without blocking the host."""
        dst.copy_(src, non_blocking=True)

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        """A dense row-major copy of ``t`` (conjugate and negative bits resolved: a
        lazily conjugated tensor stays lazy through ``contiguous()``), made by
        kernels on the current stream. Copied as same-width integers: torch has no
        CUDA copy kernel for int1..int7/uint1..uint7, and a bool copy would turn
        every non-zero byte into 1."""
        t = t.resolve_conj().resolve_neg()
        return raw(t).contiguous().view(t.dtype)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Uninitialised device memory, allocated on the current stream."""
        return torch.empty(shape, dtype=dtype, device=device)


#: The seam tests replace (see tests/cuda_fakes.py).
api = CudaApi()


def is_device_tensor(t: torch.Tensor) -> bool:
    return api.is_device(t)


class DeviceCopies:
    """The device copies of one save or one load, on one side stream per device.

    Call order (one instance per save or load):

    1. ``start(devices)`` in the caller's thread, at the call: side streams wait for
       the caller's current streams.
    2. ``to_host`` / ``to_device`` (any thread): queue a copy, get the event that
       completes it.
    3. ``wait()`` (host block) or ``order_after()`` (device-side): release.
    """

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}
        self._last: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def start(self, devices: Iterable[torch.device]) -> None:
        """Order every later copy on ``devices`` after the work the caller queued so far.
        Must run in the caller's thread: current streams are per thread."""
        for device in devices:
            if device in self._side:
                continue
            side = api.side_stream(device)
            side.wait_stream(api.current_stream(device))
            self._side[device] = side

    def _stream_for(self, device: torch.device) -> Any:
        try:
            return self._side[device]
        except KeyError:
            raise RuntimeError(f"bcp: copies on {device} were not started at the call (DeviceCopies.start)") from None

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Device memory allocated on the side stream: reused by the allocator only
        behind the copies queued there."""
        with api.use_stream(self._stream_for(device)):
            return api.empty(shape, dtype, device)

    def contiguous(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` made contiguous on its side stream (after the caller's work, and
        reused by the allocator only behind the copies that read it)."""
        stream = self._stream_for(src.device)
        api.record_stream(src, stream)
        with api.use_stream(stream):
            return api.contiguous(src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue ``dst[...] = src`` (device -> pinned host); return its completion event."""
        return self._queue(src.device, dst, src, reads=src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue ``dst[...] = src`` into device memory, from host memory or the same
        device (a cast or a strided placement), behind the copies already queued;
        return its completion event. A host ``src`` must not be reused until then."""
        return self._queue(dst.device, dst, src, reads=dst)

    def _queue(self, device: torch.device, dst: torch.Tensor, src: torch.Tensor, *, reads: torch.Tensor) -> Any:
        stream = self._stream_for(device)
        with self._lock:
            api.record_stream(reads, stream)
            with api.use_stream(stream):
                api.copy(dst, src)
            try:
                event = api.new_event()
                event.record(stream)
            except BaseException:
                stream.synchronize()  # a copy no event covers must not outlive this call
                raise
            self._last[device] = event
        return event

    def events(self) -> list[Any]:
        """One event per device that completes every copy queued so far."""
        with self._lock:
            return list(self._last.values())

    def wait(self) -> None:
        """Block the host until every copy queued so far has completed."""
        for event in self.events():
            event.synchronize()

    def order_after(self) -> None:
        """Make the calling thread's current stream of each device wait (on the device,
        not the host) for every copy queued so far."""
        with self._lock:
            pending = list(self._last.items())
        for device, event in pending:
            api.current_stream(device).wait_event(event)


def caller_done(tensors: Iterable[torch.Tensor]) -> Callable[[], None]:
    """(the caller's thread, at the call) Mark the caller's current stream of each device
    among ``tensors``; the returned function blocks the host until the work the caller
    queued before the call has run. A thread that reads device memory outside
    :class:`DeviceCopies` (an incremental save's digests and first-block checksums:
    a plain ``.cpu()``, on that thread's own current stream, ordered after nothing the
    caller queued) calls it before its first read."""
    events = []
    seen: set[torch.device] = set()
    for t in tensors:
        if t.device in seen or not api.is_device(t):
            continue
        seen.add(t.device)
        event = api.new_event()
        event.record(api.current_stream(t.device))
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


def settle(events: list) -> None:
    """Wait for copies whose result is no longer wanted (a failed save or load), so
    their memory may be reused; errors are left to the operation's own report."""
    for event in events:
        try:
            event.synchronize()
        except Exception:  # noqa: BLE001 - a broken device is reported by the save's own error
            pass
