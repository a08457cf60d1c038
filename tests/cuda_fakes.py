"""A stand-in for CUDA streams and events that makes ordering mistakes visible on CPU.

``FakeCudaApi`` replaces ``bcp.io_scheduler.device_copy.api``. CPU tensors registered with
``as_device`` play device tensors. A copy queued on a side stream does not happen
when it is queued: it runs when an event recorded after it is synchronized (or a
stream is made to wait for that event), as a real asynchronous copy may. So code
that reads a slab, returns to the caller, or lets ``step()`` run before waiting for a
copy sees stale bytes, or writes the caller's later changes into the checkpoint.

With ``gate`` closed, ``Event.synchronize`` from any thread but the main one blocks
until the gate opens: the background writers cannot complete copies early and
hide a missing wait in the caller's thread. Every rule break the fake can see is
appended to ``violations``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from bcp.tensor_io import raw


class FakeStream:
    def __init__(self, api: FakeCudaApi, name: str) -> None:
        self.api, self.name = api, name
        self.ops: list = []  # (callable, tensors touched)
        self.done = 0
        self.lock = threading.RLock()

    def run_until(self, mark: int) -> None:
        with self.lock:
            while self.done < mark:
                fn, touched = self.ops[self.done]
                fn()
                # a stream keeps no tensor alive once its work has run (temporaries freed)
                self.ops[self.done] = (None, touched)
                self.done += 1

    def pending(self) -> list:
        with self.lock:
            return self.ops[self.done :]

    def synchronize(self) -> None:
        self.run_until(len(self.ops))

    def wait_stream(self, other: FakeStream) -> None:
        self.api.log.append(("wait_stream", self.name, other.name))
        other.run_until(len(other.ops))

    def wait_event(self, event: FakeEvent) -> None:
        self.api.log.append(("wait_event", self.name, event.stream.name if event.stream else None))
        # Work queued on this stream later runs after the event: the test's "kernels" run
        # on the CPU at once, so the event's copies must happen now.
        event.complete()

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, api: FakeCudaApi, blocking: bool = True) -> None:
        self.api = api
        self.stream: FakeStream | None = None
        self.mark = 0
        self.blocking = blocking

    def record(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, len(stream.ops)

    def complete(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def synchronize(self) -> None:
        if threading.current_thread() is not threading.main_thread() and not self.api.gate.wait(timeout=30):
            self.api.violations.append("a background thread waited 30 s on a closed gate")
        self.api.log.append(("synchronize", self.stream.name if self.stream else None))
        self.complete()

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark


def _span(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class FakeCudaApi:
    def __init__(self) -> None:
        self.device_storages: set[int] = set()
        self.side_allocated: set[int] = set()
        self.recorded: set[tuple[int, str]] = set()
        self.streams: list[FakeStream] = []
        self.caller = FakeStream(self, "caller")
        self.log: list = []
        self.violations: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self._local = threading.local()
        self.copies_queued = 0
        self._side: dict = {}
        self._side_lock = threading.Lock()
        #: device temporaries alive now (made by ``empty`` on a side stream), and the most at once
        self.live_temporaries = 0
        self.peak_temporaries = 0
        self.peak_temporary_bytes = 0
        self._live_bytes = 0
        self._temp_lock = threading.Lock()

    # -- test helpers --------------------------------------------------------------------

    def as_device(self, t: torch.Tensor) -> torch.Tensor:
        self.device_storages.add(t.untyped_storage().data_ptr())
        return t

    def pending(self) -> int:
        return sum(len(s.pending()) for s in self.streams)

    def pending_touching(self, t: torch.Tensor) -> bool:
        lo, hi = _span(t)
        for stream in self.streams:
            for _fn, touched in stream.pending():
                for a, b in touched:
                    if a < hi and lo < b:
                        return True
        return False

    # -- the CudaApi surface ---------------------------------------------------------------

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device_storages

    def _current(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.caller

    def current_stream(self, device) -> FakeStream:
        return self._current()

    def new_stream(self, device) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def side_stream(self, device) -> FakeStream:
        with self._side_lock:
            if device not in self._side:
                self._side[device] = self.new_stream(device)
            return self._side[device]

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def _device_operand_ok(self, t: torch.Tensor, stream: FakeStream) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.device_storages and ptr not in self.side_allocated and (ptr, stream.name) not in self.recorded:
            self.violations.append(f"device memory used on {stream.name} without record_stream")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._current()
        if stream is self.caller:
            dst.copy_(src)
            return
        for t in (dst, src):
            self._device_operand_ok(t, stream)
        self.copies_queued += 1
        with stream.lock:
            stream.ops.append((lambda: dst.copy_(src), [_span(dst), _span(src)]))

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        stream = self._current()
        out = torch.empty(t.shape, dtype=t.dtype)
        self.as_device(out)
        self.side_allocated.add(out.untyped_storage().data_ptr())
        with stream.lock:
            stream.ops.append((lambda: raw(out).copy_(raw(t.resolve_conj().resolve_neg())), [_span(out), _span(t)]))
        return out

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.recorded.add((t.untyped_storage().data_ptr(), stream.name))
        self.log.append(("record_stream", stream.name))

    def empty(self, shape, dtype, device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.as_device(out)
        if self._current() is not self.caller:
            self.side_allocated.add(out.untyped_storage().data_ptr())
            self._count_temporary(out)
        return out

    def _count_temporary(self, t: torch.Tensor) -> None:
        """Track ``t`` until it is garbage (what a caching allocator could hand out again)."""
        nbytes = t.numel() * t.element_size()
        with self._temp_lock:
            self.live_temporaries += 1
            self._live_bytes += nbytes
            self.peak_temporaries = max(self.peak_temporaries, self.live_temporaries)
            self.peak_temporary_bytes = max(self.peak_temporary_bytes, self._live_bytes)

        def freed() -> None:
            with self._temp_lock:
                self.live_temporaries -= 1
                self._live_bytes -= nbytes

        weakref.finalize(t, freed)  # views made of it keep it alive (their ._base)


class CheckedPool:
    """A staging pool that records a slab handed back while a copy still touches it."""

    def __init__(self, pool, api: FakeCudaApi) -> None:
        self._pool, self._api = pool, api

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def acquire(self):
        return self._pool.acquire()

    def release(self, slab) -> None:
        if self._api.pending_touching(slab.tensor):
            self._api.violations.append("a slab went back to the pool before its copy completed")
        self._pool.release(slab)


@pytest.fixture(name="fake")
def fake_cuda(monkeypatch) -> Iterator[FakeCudaApi]:
    """A FakeCudaApi in place of bcp's CUDA calls for one test (import this fixture)."""
    import bcp.io_scheduler.device_copy

    api = FakeCudaApi()
    monkeypatch.setattr(bcp.io_scheduler.device_copy, "api", api)
    yield api
    api.gate.set()  # a test that failed with the gate closed must not leave writers blocked for the next ones
