"""Draining: copy a local step to ``<persistent root>/step_<N>/``.

A drained step is copied, not saved again: no device-to-host copy, no planning.
1. Each rank uploads its own data file from its host's local root with the
   persistent backend's writer (parts of the backend's part size, in parallel where
   the backend allows), each part checked as uploaded (``holding.StreamedDigest``;
   the upload is committed only if the file matches the manifest's digest), then
   the ranks agree that every upload succeeded.
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
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from bcp.async_save import wait_all as _wait_for_async_saves
from bcp.backends import Backend, Capability, ObjectNotFoundError, ObjectWriter
from bcp.backends.file import FileBackend
from bcp.coordination.collectives import Coordinator, decide, run_phase
from bcp.coordination.priority import lower_this_thread
from bcp.errors import CorruptCheckpointError, IncompleteCheckpointError
from bcp.metadata import Catalog, FileEntry, Manifest
from bcp.metadata.keys import data_file_key, generation_of, hold_key, reference_key, split_parent
from bcp.save_phases import check_target, commit_generation, keep_or_discard
from bcp.target import resolve_backend
from bcp.tiers.holding import StreamedDigest, file_spans

log = logging.getLogger(__name__)

#: Part size of uploads to backends that do not ask for one.
DEFAULT_PART_BYTES = 64 << 20

_live: set[Drain] = set()
_live_lock = threading.Lock()


def _upload_part(writer: ObjectWriter, offset: int, data: bytes) -> None:
    """Write one part of an upload (a seam: tests interrupt a drain here)."""
    writer.write_at(offset, data)


def upload_file(
    local: Backend, remote: Backend, entry: FileEntry, key: str | None = None, *, digest: StreamedDigest
) -> None:
    """Copy one data file from the local root to the persistent backend, under the same
    key (``key``, default ``entry.path``). Every part is checked as it is uploaded
    (``digest``: the file's fragments and block size); the upload is committed only
    when the whole file matches the manifest's digest (CorruptCheckpointError otherwise):
    bytes changed on the local tier since they were saved never reach the root."""
    key = entry.path if key is None else key
    part = remote.hints.part_size or DEFAULT_PART_BYTES
    offsets = list(range(0, entry.nbytes, part))
    writer = remote.open_writer(key, size=entry.nbytes)
    try:

        def copy(offset: int) -> None:
            data = local.read(key, offset, min(part, entry.nbytes - offset))
            digest.feed(offset, data, lambda at, n: local.read(key, at, n))
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
        problem = digest.problem(entry)
        if problem is not None:
            raise CorruptCheckpointError(
                f"local tier: the local copy of {key!r} in {local.uri} is not what was saved ({problem}); "
                f"it was not drained to {remote.uri}",
                file=key,
            )
        writer.commit()
    except BaseException:
        writer.abort_after_failure()
        raise


def _check_absent(remote: Backend) -> None:
    check_target(remote, overwrite=False, otherwise="the drain is not made")


def _commit_drain(remote: Backend, manifest: Manifest, catalog_bytes: bytes, parent: Backend | None = None) -> None:
    """(coordinator) The catalog, the generation check (an incremental step's referenced
    files too, on ``parent``: still there, held), then the manifest."""
    if parent is not None:
        gone = _missing_references(parent, manifest)
        if gone:
            raise IncompleteCheckpointError(
                f"the drain of {remote.uri} refers to {len(gone)} data file(s) of its siblings that are gone "
                f"({', '.join(gone[:3])}); nothing was committed"
            )

    def same_catalog(catalog: FileEntry) -> Manifest:
        if catalog != manifest.catalog:
            raise CorruptCheckpointError(
                f"the catalog drained to {remote.uri} does not match its manifest", file=manifest.catalog.path
            )
        return manifest

    paths = [f.path for f in manifest.data_files if f.checkpoint is None]
    commit_generation(
        remote, manifest.generation, manifest.catalog.path, catalog_bytes, paths, same_catalog, overwrite=False
    )


def _missing_references(parent: Backend, manifest: Manifest) -> list[str]:
    """The referenced files of ``manifest`` that ``parent`` (the persistent root) lacks
    at ``<sibling>/<path>`` with the manifest's size, as keys of the parent."""
    missing = []
    for f in manifest.references:
        assert f.checkpoint is not None
        key = reference_key(f.checkpoint, f.path)
        try:
            size = parent.size(key)
        except ObjectNotFoundError:
            size = None
        if size != f.nbytes:
            missing.append(key)
    return missing


def _hold_references(parent: Backend, manifest: Manifest, name: str) -> list[str]:
    """(coordinator) FORMAT.md's order for an incremental drain: hold every generation
    the step refers to in the persistent root, then list the referenced files it lacks
    (the drain uploads those: :func:`drain_step`)."""
    gens = {(f.checkpoint, g) for f in manifest.references if (g := generation_of(f.path)) is not None}
    for owner, gen in sorted((o, g) for o, g in gens if o is not None):
        parent.write(f"{owner}/{hold_key(gen, name, manifest.save_id)}", b"")
    return _missing_references(parent, manifest)


def _uploader(key: str, world: int) -> int:
    """The rank uploading a referenced file the persistent root lacks: the rank that
    wrote it (its host holds it; ``rank<NNNNN>-<part>.bin``), else the coordinator."""
    found = _WRITER.search(key)
    rank = int(found.group(1)) if found else 0
    return rank if rank < world else 0


_WRITER = re.compile(r"/rank(\d{5})-\d+\.bin$")


def drain_step(
    coord: Coordinator,
    local: Backend,
    remote: Backend,
    manifest: Manifest,
    catalog_bytes: bytes,
    *,
    local_parent: str | None = None,
    remote_parent: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """(all ranks, collective) Copy the committed local step ``manifest`` (this rank's
    data file from ``local``) to ``remote``, and commit it there. An incremental step
    (references to sibling local steps, ``local_parent`` the local root) is committed
    as it is: the persistent root (``remote_parent``) is given holds on the generations
    it refers to, and only the referenced files it lacks are uploaded, each once, under
    the sibling's name (docs/tiers.md, "Incremental local steps"). Returns the bytes
    this rank uploaded."""
    mine = {f.path: f for f in manifest.data_files}.get(data_file_key(manifest.generation, coord.rank))
    decide(coord, "draining: checking the target", _check_absent, remote)
    refs = {reference_key(f.checkpoint, f.path): f for f in manifest.references if f.checkpoint is not None}
    parent: Backend | None = None
    missing: list[str] = []
    if refs:
        if local_parent is None or remote_parent is None:
            raise ValueError(f"the drain of {remote.uri} refers to sibling steps: it needs both parents")
        parent = resolve_backend(remote_parent, storage_options)
        name = split_parent(remote.uri)[1]
        missing = decide(coord, "draining: holding the referenced steps", _hold_references, parent, manifest, name)
    committed = False
    uploaded = 0

    def commit_here() -> None:
        nonlocal committed
        _commit_drain(remote, manifest, catalog_bytes, parent)
        committed = True

    def upload() -> None:
        nonlocal uploaded
        block = manifest.checksum_block_bytes
        # each file's digest covers this catalog's rows in it, a referenced file's too (FORMAT.md)
        spans = file_spans(Catalog.from_arrow(catalog_bytes, where=local.uri, checksum_block_bytes=block))
        if mine is not None:
            upload_file(local, remote, mine, digest=StreamedDigest(spans.get(mine.path, ()), block))
            uploaded += mine.nbytes
        if missing:
            assert parent is not None and local_parent is not None
            siblings = FileBackend(local_parent, fsync=False)
            for key in missing:
                if _uploader(key, coord.world_size) == coord.rank:
                    ref = refs[key]
                    upload_file(siblings, parent, ref, key, digest=StreamedDigest(spans.get(ref.path, ()), block))
                    uploaded += ref.nbytes

    note = f"the drained step at {remote.uri} is committed: its manifest was written last"
    with keep_or_discard(coord, remote, manifest.generation, lambda: committed, note, "the failed drain"):
        run_phase(coord, "draining: uploading data files", upload)
        decide(coord, "draining: committing", commit_here)
    log.info("local tier: drained %s (%.1f MiB uploaded by this rank)", remote.uri, uploaded / 2**20)
    return uploaded


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
