"""Hugging Face ``Trainer`` checkpoints kept in any bcp store, and resumed from it.

The Trainer writes each checkpoint as a local folder, ``<output_dir>/checkpoint-<step>``
(model weights, optimizer, scheduler, RNG state per rank, ``trainer_state.json``, ...),
and resumes from such a folder. :class:`BcpCheckpointCallback` is a ``TrainerCallback``
(the Trainer's public extension point; no Trainer method is overridden): its
``on_save`` mirrors the folder the Trainer just wrote to ``<uri>/checkpoint-<step>/``
through bcp's backends, every rank uploading a share of the files in parallel, with
the size and CRC32C of each file in ``.bcp-files.json``, written last: a checkpoint is
complete in the store only once that manifest exists, so an interrupted upload is never
resumed from. :func:`restore_checkpoint` brings the newest complete one (or a given
step) back into a local folder, verifying every byte, and returns the path for
``trainer.train(resume_from_checkpoint=...)``. Nothing here unpickles anything: the
files are bytes to bcp; the Trainer loads them itself, as it loads its own checkpoints.

``import bcp`` never imports this module; importing it without ``transformers``
installed fails naming the ``transformers`` extra (bcp/extras.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from typing import Any

from bcp.backends import Backend, ObjectNotFoundError, backend_for, join_uri
from bcp.errors import CorruptCheckpointError, FormatError
from bcp.extras import needs_extra
from bcp.integrations.dcp_storage import ObjectStream
from bcp.metadata.checksum import crc32c

with needs_extra("transformers", "bcp.integrations.transformers"):
    import accelerate  # noqa: F401 - the Trainer needs it: name the extra now, not at TrainingArguments
    from transformers import TrainerCallback

log = logging.getLogger(__name__)

#: Written last into each mirrored checkpoint: name -> size and CRC32C of every file.
MANIFEST_NAME = ".bcp-files.json"
MANIFEST_FORMAT = "bcp-trainer-files"
#: The Trainer's folder names (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``).
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
#: Bytes read from a local file per write to the store.
CHUNK_BYTES = 8 << 20
#: Temporary files, never part of a checkpoint: ``.tmpXXXXXX`` (safetensors writes the
#: model there, then renames it) and any name ending in ``.tmp`` (restore_checkpoint's own).
TEMPORARY_RE = re.compile(r"^\.tmp|\.tmp$")


def group() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def upload_file(backend: Backend, key: str, path: str) -> tuple[int, int]:
    """Copy the local file ``path`` to ``key``; return its (size, CRC32C)."""
    result: list[Any] = []
    with open(path, "rb") as f:
        stream = ObjectStream(backend, key, result.append)
        try:
            while chunk := f.read(CHUNK_BYTES):
                stream.write(chunk)
        except BaseException:
            stream.abort()
            raise
        stream.close()
    _key, size, crc, _segments = result[0]
    return size, crc


def checkpoint_files(folder: str) -> list[str]:
    """The files of the local checkpoint ``folder`` (relative, ``/``-separated), without
    temporary ones."""
    return sorted(
        os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
        for d, _dirs, files in os.walk(folder)
        for f in files
        if not TEMPORARY_RE.search(f)
    )


def mirror_checkpoint(folder: str, backend: Backend, name: str) -> dict[str, dict[str, int]]:
    """Upload the Trainer checkpoint ``folder`` to ``name/`` in ``backend``, on every
    rank of the default process group (call it on all of them, after the Trainer saved):
    each rank uploads the files it sees that fall to it, so the files of a rank-local
    disk get there too, and rank 0 writes the manifest last. Returns the manifest's files.

    The Trainer calls ``on_save`` on each rank as soon as that rank has written its own
    files, while rank 0 may still be writing the model (through a temporary file it then
    renames): every rank lists the folder only after a barrier, skips temporary files,
    and a file gone by the time it is read is left out (logged), so the store holds only
    files of the final checkpoint. Rank 0 first deletes whatever ``name/`` held (a
    re-saved step, an upload that never finished). A folder no rank finds a file in
    is a FileNotFoundError on every rank, before the store is touched."""
    import torch.distributed as dist

    rank, world = group()
    manifest_key = f"{name}/{MANIFEST_NAME}"
    seen: list[list[str]] = [[] for _ in range(world)]
    mine_seen = checkpoint_files(folder)
    if world > 1:
        dist.all_gather_object(seen, mine_seen)  # after every rank's files of this checkpoint are on disk
    else:
        seen = [mine_seen]
    if not any(seen):  # every rank, before anything in the store is touched: an empty "complete" one restored nothing
        raise FileNotFoundError(f"{folder}: no checkpoint files there to mirror to {backend.uri}/{name}")
    if rank == 0 and next(iter(backend.list(f"{name}/")), None) is not None:
        if backend.exists(manifest_key):  # re-saved step: no manifest names a mix
            backend.delete(manifest_key)
        backend.delete_prefix(f"{name}/")
    if world > 1:
        dist.barrier()  # name/ is empty before anyone uploads
    # file i goes to the i-th (round robin) of the ranks that see it
    owners: dict[str, int] = {}
    for i, file in enumerate(sorted({f for names in seen for f in names})):
        holders = [r for r in range(world) if file in seen[r]]
        owners[file] = holders[i % len(holders)]
    mine = {}
    for file, owner in owners.items():
        if owner == rank:
            try:
                size, crc = upload_file(backend, f"{name}/{file}", os.path.join(folder, file))
            except FileNotFoundError:
                log.warning("%s: %s was deleted before it was uploaded; left out", folder, file)
                continue
            mine[file] = {"size": size, "crc32c": crc}
    everyone: list[dict[str, dict[str, int]]] = [mine]
    if world > 1:
        everyone = [{} for _ in range(world)]
        dist.all_gather_object(everyone, mine)
    files = {k: v for part in everyone for k, v in part.items()}
    if rank == 0:
        doc = {"format": MANIFEST_FORMAT, "version": 1, "files": dict(sorted(files.items()))}
        backend.write(manifest_key, json.dumps(doc, indent=1).encode())
        log.info("mirrored %s to %s/%s (%d files)", folder, backend.uri, name, len(files))
    if world > 1:
        dist.barrier()  # the checkpoint is complete in the store on every rank's return
    return files


def complete_checkpoints(backend: Backend) -> list[int]:
    """Steps of the checkpoints in ``backend`` whose manifest exists, oldest first."""
    steps = set()
    for key in backend.list("checkpoint-"):
        folder, _, rest = key.partition("/")
        match = CHECKPOINT_RE.match(folder)
        if match and rest == MANIFEST_NAME:
            steps.add(int(match.group(1)))
    return sorted(steps)


def read_manifest(backend: Backend, name: str) -> dict[str, dict[str, int]]:
    """The files of the mirrored checkpoint ``name``: relative path -> size, CRC32C."""
    where = join_uri(backend.uri, f"{name}/{MANIFEST_NAME}")
    try:
        doc = json.loads(backend.read(f"{name}/{MANIFEST_NAME}"))
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        files = {str(k): {"size": int(v["size"]), "crc32c": int(v["crc32c"])} for k, v in doc["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{where}: not a bcp Trainer checkpoint manifest: {type(e).__name__}: {e}") from e
    for file in files:
        parts = file.split("/")
        if file.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise FormatError(f"{where}: file name {file!r} leaves the checkpoint folder")
    return files


def download_file(backend: Backend, key: str, path: str, size: int, crc: int) -> None:
    """Copy ``key`` to the local ``path`` (a temporary name, then renamed), checking
    its size and CRC32C; CorruptCheckpointError naming the key otherwise."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.bcp-{uuid.uuid4().hex[:8]}.tmp"
    try:
        got_crc, offset = 0, 0
        buffer = bytearray(min(CHUNK_BYTES, max(size, 1)))
        with open(tmp, "wb") as f:
            while offset < size:
                view = memoryview(buffer)[: min(len(buffer), size - offset)]
                backend.read_exact(key, offset, view)
                got_crc = crc32c(view, got_crc)
                f.write(view)
                offset += len(view)
        actual = backend.size(key)
        if actual != size or got_crc != crc:
            raise CorruptCheckpointError(
                f"{join_uri(backend.uri, key)}: {actual} bytes with CRC32C {got_crc:08x} (of its first {size}), "
                f"but {MANIFEST_NAME} records {size} bytes with {crc:08x}",
                file=key,
            )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def restore_checkpoint(
    uri: str | os.PathLike[str], local_dir: str | os.PathLike[str], *, step: int | None = None, **storage_options: Any
) -> str | None:
    """Bring the newest complete checkpoint under ``uri`` (or the one of ``step``) into
    ``local_dir/checkpoint-<step>`` and return that path, for
    ``trainer.train(resume_from_checkpoint=...)``; None when ``uri`` holds none (a first
    run). Call it on every rank: each one needs the files (its own RNG state among
    them); ranks sharing ``local_dir`` write the same bytes, each file renamed into place."""
    backend = backend_for(uri, **storage_options)
    try:
        if step is None:
            steps = complete_checkpoints(backend)
            if not steps:
                return None
            step = steps[-1]
        name = f"checkpoint-{step}"
        try:
            files = read_manifest(backend, name)
        except ObjectNotFoundError as e:
            raise FileNotFoundError(f"{join_uri(backend.uri, name)}: no complete checkpoint of step {step}") from e
        target = os.path.join(os.fspath(local_dir), name)
        for file, entry in files.items():
            download_file(
                backend, f"{name}/{file}", os.path.join(target, *file.split("/")), entry["size"], entry["crc32c"]
            )
        log.info("restored %s/%s into %s (%d files)", backend.uri, name, target, len(files))
        return target
    finally:
        backend.close()


def delete_old_checkpoints(backend: Backend, keep_last: int, newest: int | None = None) -> list[int]:
    """Delete all but the ``keep_last`` newest complete checkpoints (each manifest first,
    so that none is ever half there and complete); return the steps deleted. ``newest``:
    the step just mirrored, kept first whatever its number (after a rollback the store
    holds the abandoned run's higher steps, which outranked it: it was deleted at once)."""
    steps = complete_checkpoints(backend)
    ranked = sorted(steps, key=lambda step: (step == newest, step), reverse=True)
    old = sorted(ranked[keep_last:])
    for step in old:
        backend.delete(f"checkpoint-{step}/{MANIFEST_NAME}")
        backend.delete_prefix(f"checkpoint-{step}/")
    return old


class BcpCheckpointCallback(TrainerCallback):
    """A ``TrainerCallback`` that mirrors every checkpoint the Trainer saves to
    ``uri/checkpoint-<step>/`` (``keep_last``: how many complete ones to keep in the
    store, None for all; the Trainer's ``save_total_limit`` rotates the local ones).
    ``storage_options`` go to ``backend_for``.

    ``trainer = Trainer(..., callbacks=[BcpCheckpointCallback("s3://bucket/run")])``
    """

    def __init__(self, uri: str | os.PathLike[str], *, keep_last: int | None = None, **storage_options: Any) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None for all), got {keep_last}")
        self.uri = os.fspath(uri)
        self.keep_last = keep_last
        self.storage_options = storage_options
        #: steps mirrored by this callback, in order
        self.mirrored: list[int] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer has written ``<output_dir>/checkpoint-<step>``: mirror it."""
        name = f"checkpoint-{state.global_step}"
        folder = os.path.join(args.output_dir, name)
        backend = backend_for(self.uri, **self.storage_options)
        try:
            mirror_checkpoint(folder, backend, name)
            self.mirrored.append(state.global_step)
            if self.keep_last is not None and group()[0] == 0:
                delete_old_checkpoints(backend, self.keep_last, newest=state.global_step)
        finally:
            backend.close()
