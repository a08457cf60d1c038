"""Benchmarks of bcp itself, as library functions: ``bcp bench`` prints what
:func:`save_load` measures, and scripts under bench/ may call it too.

:func:`save_load` saves and loads a synthetic state through a URI (any backend) and
times each; every scratch checkpoint it writes is deleted, whatever happens, with the
local directories the run created. :func:`storage_speed` measures the storage itself
(``bcp trace --measure``: the speeds a trace's stages are put against).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import bcp  # bcp.save and bcp.load, looked up at each call: the public functions, as a user calls them
from bcp.backends import Backend, backend_for, join_uri
from bcp.backends.file import file_directory
from bcp.trace_report import Resource, storage_kind

log = logging.getLogger(__name__)

#: The synthetic state: this many float32 tensors of equal size.
TENSORS = 16


@dataclasses.dataclass(frozen=True)
class SaveLoadResult:
    """What :func:`save_load` measured: the state's size and each run's seconds."""

    nbytes: int
    save_seconds: list[float]
    load_seconds: list[float]

    @property
    def save_gbps(self) -> float:
        """Save throughput of the median run, in GB/s (10^9 bytes)."""
        return self.nbytes / statistics.median(self.save_seconds) / 1e9

    @property
    def load_gbps(self) -> float:
        """Load throughput of the median run, in GB/s (10^9 bytes)."""
        return self.nbytes / statistics.median(self.load_seconds) / 1e9


def synthetic_state(gib: float, tensors: int = TENSORS) -> dict[str, torch.Tensor]:
    """``tensors`` random float32 tensors (``t0``, ``t1``, ...) of about ``gib`` GiB in all."""
    n = max(1, int(gib * 2**30 / 4 / tensors))
    return {f"t{i}": torch.rand(n) for i in range(tensors)}


def save_load(
    uri: str,
    *,
    gib: float = 1.0,
    repeats: int = 3,
    on_run: Callable[[int, int, float, float], None] | None = None,
    on_cleanup_error: Callable[[str, Exception], None] | None = None,
) -> SaveLoadResult:
    """Save a synthetic state of ``gib`` GiB under ``uri`` and load it back into a
    fresh template, ``repeats`` times, each run into a scratch checkpoint deleted right
    after it (with the partial writes of an interrupted save). ``on_run(index, nbytes,
    save_seconds, load_seconds)`` is called after each run. A scratch checkpoint that
    cannot be deleted is passed to ``on_cleanup_error(prefix, error)`` (default: a
    warning) and does not hide the error that stopped the run. A local ``uri`` whose
    directories do not exist yet is left as it was: the directories this run made are
    removed when empty."""
    if not gib > 0:
        raise ValueError(f"gib must be > 0, got {gib:g}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    state = synthetic_state(gib)
    size = sum(t.numel() * t.element_size() for t in state.values())
    saves: list[float] = []
    loads: list[float] = []
    backend = backend_for(uri)
    root = file_directory(backend)
    made = _missing_top(root) if root is not None else None
    scratch = f"bcp-bench-{os.getpid()}-{time.time_ns()}"
    try:
        for rep in range(repeats):
            name = f"{scratch}-{rep}"
            target = join_uri(uri, name)
            try:
                start = time.perf_counter()
                bcp.save(state, target)
                saves.append(time.perf_counter() - start)
                template = {k: torch.empty_like(v) for k, v in state.items()}
                start = time.perf_counter()
                bcp.load(template, target)
                loads.append(time.perf_counter() - start)
            finally:
                _delete_scratch(backend, f"{name}/", on_cleanup_error)
            if on_run is not None:
                on_run(rep, size, saves[-1], loads[-1])
    finally:
        if made is not None and root is not None:
            _remove_empty_dirs(root, made)
    return SaveLoadResult(size, saves, loads)


def _delete_scratch(backend: Backend, prefix: str, on_error: Callable[[str, Exception], None] | None) -> None:
    """Delete one scratch checkpoint, with the partial writes of a save that was
    interrupted (the file backend prunes the directories it empties). A failure is
    reported, not raised: it must not hide the error that stopped the run. A Ctrl-C
    that lands during the deletion cuts it short: the deletion is finished, then the
    interrupt goes on (a second Ctrl-C stops the deletion too)."""
    try:
        try:
            _delete_prefix(backend, prefix)
        except KeyboardInterrupt:
            _delete_prefix(backend, prefix)
            raise
    except Exception as e:  # noqa: BLE001 - reported, and the run's own outcome stands
        if on_error is None:
            log.warning("could not delete the scratch checkpoint %s: %s", prefix, e)
        else:
            on_error(prefix, e)


def _delete_prefix(backend: Backend, prefix: str) -> None:
    for pending in backend.unfinished(prefix):
        backend.delete_unfinished(pending.name)
    backend.delete_prefix(prefix)


def _missing_top(path: str) -> str | None:
    """The outermost directory of ``path`` that does not exist yet (``path`` itself,
    or one of its parents), or None if ``path`` exists."""
    top = None
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        top, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return top


def _remove_empty_dirs(path: str, top: str) -> None:
    """Remove ``path`` and its parents up to ``top`` (the directories a run created),
    each only if empty: what someone else put there stays."""
    path = os.path.abspath(path)
    while True:
        try:
            os.rmdir(path)
        except OSError:
            log.info("left %s: not empty", path)
            return
        if path == top or os.path.dirname(path) == path:
            return
        path = os.path.dirname(path)


@dataclasses.dataclass(frozen=True)
class StorageSpeed:
    """What :func:`storage_speed` measured at one location."""

    #: what the location is reached through: a local disk or the network
    kind: Resource
    nbytes: int
    write_seconds: float
    read_seconds: float

    @property
    def write_gbps(self) -> float:
        return self.nbytes / self.write_seconds / 1e9

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_seconds / 1e9


def storage_speed(uri: str, *, nbytes: int = 256 << 20) -> StorageSpeed:
    """Write one scratch object of about ``nbytes`` under ``uri``, read it back, delete
    it, and time both, with the backend's own parallelism (``hints.concurrency`` parts
    in flight, of ``hints.part_size`` or 8 MiB) as a save and a load drive it. On a
    local disk the file backend writes with O_DIRECT and fsync and reads with O_DIRECT,
    so the page cache plays no part: the figures are the disk's (and the network's for
    an object store), for one process. Local directories the measurement had to create
    are removed again when empty."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    backend = backend_for(uri)
    kind = storage_kind(backend.uri)
    if kind is None:
        raise ValueError(f"{backend.uri}: memory holds no disk or network to measure")
    root = file_directory(backend)
    made = _missing_top(root) if root is not None else None  # left as it was, as save_load does
    hints = backend.hints
    part = hints.part_size or 8 << 20
    nbytes = -(-nbytes // part) * part  # whole parts: each write_at a part, as uploads need
    buffer = mmap.mmap(-1, nbytes)  # page-aligned: O_DIRECT writes go straight from it
    block = os.urandom(1 << 20)
    for at in range(0, nbytes, len(block)):
        buffer[at : at + len(block)] = block[: nbytes - at]
    view = memoryview(buffer)
    parts = [(at, view[at : at + part]) for at in range(0, nbytes, part)]
    key = f".bcp-speed-{os.getpid()}-{time.time_ns()}"
    try:
        with ThreadPoolExecutor(max(1, hints.concurrency), thread_name_prefix="bcp-speed") as pool:
            start = time.perf_counter()
            writer = backend.open_writer(key, size=nbytes)
            try:
                list(pool.map(lambda p: writer.write_at(*p), parts))
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            write_seconds = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(lambda p: backend.read_exact(key, *p), parts))
            read_seconds = time.perf_counter() - start
    finally:
        try:
            backend.delete(key)
        except Exception as e:  # noqa: BLE001 - reported; the measurement's own outcome stands
            log.warning("could not delete the scratch object %s under %s: %s", key, backend.uri, e)
        parts.clear()
        view.release()
        buffer.close()
        if made is not None and root is not None:
            _remove_empty_dirs(root, made)
    return StorageSpeed(kind, nbytes, write_seconds, read_seconds)
