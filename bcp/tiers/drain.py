"""Draining: copy a local step to ``<persistent root>/step_<N>/``.

A drained step is copied, not saved again: no device-to-host copy, no planning.
1. Each rank uploads its own data file from its host's local root with the
   persistent backend's writer (parts of the backend's part size, in parallel where
   the backend allows), then the ranks agree that every upload succeeded.
2. The coordinator uploads the catalog, checks that the generation is intact, and
   commits the manifest, create-only (``bcp.commit.commit``).
A drain that fails removes its generation (the coordinator), unless the coordinator
had committed it and only telling the other ranks failed (a rank died then): the
step is whole and stays. One killed midway leaves an uncommitted step, which the
manager's garbage collection removes, like any failed save. Drains run one at a
time, each in its own thread, on a gloo group of their own, so training and the
next local saves go on meanwhile.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Callable

from bcp.async_save import wait_all as _wait_for_async_saves
from bcp.backends import Backend, Capability, ObjectWriter
from bcp.coordination.collectives import Coordinator, decide, run_phase
from bcp.coordination.priority import lower_this_thread
from bcp.errors import CorruptCheckpointError
from bcp.metadata import FileEntry, Manifest
from bcp.metadata.keys import data_file_key
from bcp.save_phases import check_target, commit_generation, keep_or_discard

log = logging.getLogger(__name__)

#: Part size of uploads to backends that do not ask for one.
DEFAULT_PART_BYTES = 64 << 20

_live: set[Drain] = set()
_live_lock = threading.Lock()


def _upload_part(writer: ObjectWriter, offset: int, data: bytes) -> None:
    """Write one part of an upload (a seam: tests interrupt a drain here)."""
    writer.write_at(offset, data)


def upload_file(local: Backend, remote: Backend, entry: FileEntry) -> None:
    """Copy one data file from the local root to the persistent backend, under the same key."""
    part = remote.hints.part_size or DEFAULT_PART_BYTES
    offsets = list(range(0, entry.nbytes, part))
    writer = remote.open_writer(entry.path, size=entry.nbytes)
    try:

        def copy(offset: int) -> None:
            data = local.read(entry.path, offset, min(part, entry.nbytes - offset))
            _upload_part(writer, offset, data)

        if not offsets:
            writer.write_at(0, b"")
        elif Capability.PARALLEL_WRITES in remote.capabilities and len(offsets) > 1:
            streams = max(1, min(remote.hints.concurrency, len(offsets)))
            with concurrent.futures.ThreadPoolExecutor(
                streams, thread_name_prefix="bcp-drain", initializer=lower_this_thread
            ) as pool:
                for future in [pool.submit(copy, o) for o in offsets]:
                    future.result()
        else:
            for o in offsets:
                copy(o)
        writer.commit()
    except BaseException:
        writer.abort_after_failure()
        raise


def _check_absent(remote: Backend) -> None:
    check_target(remote, overwrite=False, otherwise="the drain is not made")


def _commit_drain(remote: Backend, manifest: Manifest, catalog_bytes: bytes) -> None:
    """(coordinator) The catalog, the generation check, then the manifest."""

    def same_catalog(catalog: FileEntry) -> Manifest:
        if catalog != manifest.catalog:
            raise CorruptCheckpointError(
                f"the catalog drained to {remote.uri} does not match its manifest", file=manifest.catalog.path
            )
        return manifest

    paths = [f.path for f in manifest.data_files]
    commit_generation(
        remote, manifest.generation, manifest.catalog.path, catalog_bytes, paths, same_catalog, overwrite=False
    )


def drain_step(coord: Coordinator, local: Backend, remote: Backend, manifest: Manifest, catalog_bytes: bytes) -> None:
    """(all ranks, collective) Copy the committed local step ``manifest`` (this rank's
    data file from ``local``) to ``remote``, and commit it there."""
    mine = {f.path: f for f in manifest.data_files}.get(data_file_key(manifest.generation, coord.rank))
    decide(coord, "draining: checking the target", _check_absent, remote)
    committed = False

    def commit_here() -> None:
        nonlocal committed
        _commit_drain(remote, manifest, catalog_bytes)
        committed = True

    note = f"the drained step at {remote.uri} is committed: its manifest was written last"
    with keep_or_discard(coord, remote, manifest.generation, lambda: committed, note, "the failed drain"):
        if mine is not None:
            run_phase(coord, "draining: uploading data files", upload_file, local, remote, mine)
        else:
            run_phase(coord, "draining: uploading data files", lambda: None)
        decide(coord, "draining: committing", commit_here)
    log.info("local tier: drained %s", remote.uri)


class Drain:
    """One drain in its own thread; ``wait()`` returns once it ended, raising its error."""

    def __init__(self, step: int, run: Callable[[], None], on_end: Callable[[], None] | None = None) -> None:
        self.step = step
        self._run_fn = run
        self._on_end = on_end
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bcp-drain-{step}", daemon=True)

    def start(self) -> Drain:
        with _live_lock:
            _live.add(self)
        self._thread.start()
        return self

    def _run(self) -> None:
        lower_this_thread()
        try:
            self._run_fn()
        except BaseException as e:  # noqa: BLE001 - raised from wait()
            self._error = e
        finally:
            try:
                if self._on_end is not None:
                    self._on_end()
            finally:
                self._done.set()
                with _live_lock:
                    _live.discard(self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _finish_at_exit() -> None:
    """At interpreter exit: finish the async saves (whose last step may start a
    drain), then the drains in flight, so a job that ends without ``close()`` still
    has its last drained step (a drain nobody waited for logs its failure)."""
    _wait_for_async_saves()
    with _live_lock:
        drains = list(_live)
    for d in drains:
        log.warning("the process is exiting: waiting for the drain of step %d to finish", d.step)
        d._done.wait()
        if d._error is not None:
            log.error("the drain of step %d failed and was never waited for: %s", d.step, d._error)


atexit.register(_finish_at_exit)  # after async_save's (imported above): runs before it
