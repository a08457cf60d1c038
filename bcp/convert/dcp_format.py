"""bcp <-> PyTorch DCP (``torch.distributed.checkpoint``).

* Out: written by DCP's own writer and planner (so DCP's load finds the state's
  nesting as it flattens it), the tensors read from bcp in bounded batches only when
  the writer asks for them (:mod:`bcp.convert.dcp_writer`), into a staging directory
  moved into place once complete. Memory: one batch.
* In: every tensor is loaded by DCP into a file-backed buffer, then saved with the
  nesting DCP recorded (``planner_data``) rebuilt. DCP's ``.metadata`` and its
  non-tensor entries are pickles: without ``allow_pickle=True`` the metadata is
  unpickled with an allow-list of DCP's own types (:mod:`bcp.convert.dcp_metadata`)
  and the entries with ``weights_only=True``; an entry that needs more is skipped
  (and named). Every item's offset and length, and every tensor's declared size, are
  checked against the data files' real sizes first
  (:func:`bcp.convert.dcp_metadata.check_storage`): a truncated file is a
  :class:`~bcp.errors.CorruptCheckpointError` naming it and the offset.

DCP's own failures (``CheckpointException``, a ``BaseException``) are raised as a
one-line :class:`~bcp.errors.ConversionError` (:func:`conversion_error`). This module
imports DCP only when a conversion runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from bcp.convert.files import file_backed, publish_dir, regular_fd, stale_files
from bcp.convert.formats import DCP_METADATA_FILE
from bcp.convert.per_rank import export_object, per_rank_keys
from bcp.convert.pickle_check import FileSlice, check_archive
from bcp.convert.selection import Progress, select
from bcp.errors import ConversionError, FormatError
from bcp.reader import CheckpointReader, PerRankChoice, check_per_rank_choice, open_checkpoint
from bcp.saver import SaveInfo, save
from bcp.state import KeyPath, build_nested

log = logging.getLogger(__name__)


#: to_dcp reads and writes the tensors in batches of about this many bytes (the
#: export's memory bound; a larger tensor is a batch of its own).
DCP_BATCH_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class DCPExportInfo:
    """What :func:`to_dcp` wrote, and the most tensors (and bytes) it held at once."""

    path: str
    tensors: int
    objects: int
    tensor_bytes: int
    peak_resident_tensors: int
    peak_resident_bytes: int
    #: the per-rank objects written with every saving rank's value, under ``__rank_<r>__`` keys
    per_rank: tuple[str, ...] = ()


def to_dcp(
    src: str | CheckpointReader,
    dst_dir: str,
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    sync_files: bool = True,
    batch_bytes: int = DCP_BATCH_BYTES,
    progress: Progress | None = None,
    per_rank: PerRankChoice = "all",
) -> DCPExportInfo:
    """Write the checkpoint as a PyTorch DCP checkpoint in ``dst_dir`` (data files
    and ``.metadata``), loadable by
    ``torch.distributed.checkpoint.load`` on any number of ranks with the state's
    original nesting (DCP's planner flattens it as it flattens the template).

    Streamed: DCP plans over placeholders, and the tensors are read from bcp batch by
    batch (one coalesced read each) just before DCP's writer writes them, in batches
    of at most ``batch_bytes`` (one data file each, ``__0_<batch>_0.distcp``; a tensor
    larger than that is a batch of its own), each written and freed before the next
    is read: memory holds about one batch, never the whole checkpoint. Tensors inside
    objects (an RNG state) are decoded with their object and written as DCP tensor
    items, as DCP would have saved them. ``prefix`` keeps only the keys under it (with
    their nesting).

    DCP has no per-rank values (its save keeps one value per key), so an object saved
    per rank is written, with ``per_rank="all"``, as ``{"__rank_0__": value of rank 0,
    ...}`` where the object was: rank ``r`` loads its own by asking for
    ``{rank_key(r): template}`` there (docs/interop.md has the recipe). With
    ``per_rank=R`` every rank's DCP load gets saved rank ``R``'s value.

    The files are written into a staging directory inside ``dst_dir`` and moved into
    place (``.metadata`` last) only once DCP has written them all: a failure (a
    :class:`~bcp.errors.ConversionError` for one inside DCP) leaves ``dst_dir`` as it
    was, and removes it if this call created it. ``dst_dir`` must be empty or absent
    unless ``overwrite`` (then the ``*.distcp`` files and ``.metadata`` in it are
    replaced; nothing else is touched)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from bcp.convert.dcp_writer import BatchedFileSystemWriter, StreamingSavePlanner

    check_per_rank_choice(per_rank)
    reader = src if isinstance(src, CheckpointReader) else open_checkpoint(src)
    keys = [key for key, _name in select(reader.keys(), prefix, strip=False)]
    if not keys:
        raise ValueError(f"no entries under prefix {prefix!r} in {reader.uri}")
    stale = stale_files(
        dst_dir,
        kind="DCP",
        wanted=lambda name: name == DCP_METADATA_FILE or name.endswith(".distcp"),
        overwrite=overwrite,
    )
    source: dict[int, str] = {}
    entries = []
    for key in keys:
        path = reader.key_path(key)
        entries.append((path, _dcp_value(reader, key, path, source, per_rank)))
    state = build_nested(entries)

    def fill(pairs: list[tuple[str, torch.Tensor]]) -> None:
        reader.fill([(key, ((0,) * t.dim(), tuple(t.shape)), t) for key, t in pairs])  # fill checks the sizes first
        if progress:
            progress(sum(t.numel() * t.element_size() for _key, t in pairs))

    created = not os.path.isdir(dst_dir)
    os.makedirs(dst_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".bcp-partial-", dir=dst_dir)
    try:
        planner = StreamingSavePlanner(source, fill)
        writer = BatchedFileSystemWriter(
            staging, batch_bytes=batch_bytes, sync_files=sync_files, final_path=os.path.abspath(dst_dir)
        )
        try:
            with _single_process_dcp():
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            raise conversion_error(e, f"PyTorch DCP could not write {dst_dir}") from e
        publish_dir(staging, dst_dir, stale, last=DCP_METADATA_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.listdir(dst_dir):
            os.rmdir(dst_dir)  # a failed export leaves no directory it made
    tensors = [k for k in keys if k in reader.catalog.tensors]
    return DCPExportInfo(
        path=dst_dir,
        tensors=len(tensors),
        objects=len(keys) - len(tensors),
        tensor_bytes=sum(reader.meta(k).nbytes for k in tensors),
        peak_resident_tensors=planner.peak_resident,
        peak_resident_bytes=planner.peak_resident_bytes,
        per_rank=tuple(per_rank_keys(reader, keys)) if per_rank == "all" else (),
    )


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist=True``):
    a conversion is one process by design, so that warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_value(
    reader: CheckpointReader, key: str, path: KeyPath, source: dict[int, str], per_rank: PerRankChoice
) -> Any:
    """An object as decoded (a per-rank one as :func:`export_object` writes it); a
    tensor as a meta placeholder read later, except under a tuple (DCP stores a tuple
    whole, as pickled bytes, so its tensors must be real)."""
    if key not in reader.catalog.tensors:
        return export_object(reader, key, per_rank)
    if any(kind == "t" for kind, _k in path):
        return reader.read(key)
    meta = reader.meta(key)
    placeholder = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    source[id(placeholder)] = key
    return placeholder


# -- into bcp ------------------------------------------------------------------------------------


def from_dcp(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    scratch_dir: str | None = None,
    storage_options: dict | None = None,
) -> tuple[SaveInfo, list[str]]:
    """A PyTorch DCP checkpoint directory into bcp, with the saved state's nesting
    (dicts, lists, optimizer param groups, scheduler state) rebuilt from DCP's own
    ``Metadata.planner_data``, so a strict ``bcp.load`` with the original state works.
    Returns the SaveInfo and the non-tensor keys that were skipped.

    Nothing here unpickles without ``allow_pickle``: ``.metadata`` is read with an
    allow-list of DCP's own types (PickleNotAllowedError naming the file and the
    refused global otherwise), and non-tensor entries with ``weights_only=True``;
    an entry that needs more is skipped and named."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from bcp.convert.dcp_metadata import DCPReader, SafeBytesPlanner, check_storage, key_paths, read_metadata

    metadata = read_metadata(src, allow_pickle=allow_pickle)
    paths = key_paths(metadata, where=os.path.join(src, DCP_METADATA_FILE))
    _check_nesting(paths, where=src)  # from .metadata alone: a bad one fails before anything is loaded
    # every offset and declared size against the files' real sizes, before any allocation
    check_storage(
        metadata,
        size_of=lambda name: os.path.getsize(os.path.join(src, name)),
        where=lambda name: os.path.join(src, name),
    )
    _check_entries(metadata, src)  # no entry a zip bomb torch would inflate
    reader = DCPReader(src, metadata)
    planner = SafeBytesPlanner(allow_pickle=allow_pickle)
    scratch = tempfile.mkdtemp(prefix="bcp-convert-", dir=scratch_dir)
    try:
        state: dict[str, Any] = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                state[fqn] = file_backed(scratch, fqn, meta.size, meta.properties.dtype)
            else:
                state[fqn] = None  # a torch.save'd value: SafeBytesPlanner loads it
        try:
            with _single_process_dcp():
                dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as e:
            raise conversion_error(e, f"PyTorch DCP could not read {src}") from e
        for fqn in list(state):
            if fqn in planner.loaded:
                state[fqn] = planner.loaded[fqn]
            elif state[fqn] is None:
                del state[fqn]
        skipped = sorted(planner.refused)
        if skipped:
            log.warning(
                "skipped %d non-tensor DCP entries that need a full unpickle (pass allow_pickle=True to "
                "convert them): %s",
                len(skipped),
                "; ".join(f"{k!r} ({planner.refused[k]})" for k in skipped[:10]),
            )
        nested = _nest(state, paths, where=src)
        info = save(nested, dst, overwrite=overwrite, allow_pickle=allow_pickle, storage_options=storage_options)
        return info, skipped
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_entries(metadata: Any, root: str) -> None:
    """:func:`~bcp.convert.pickle_check.check_archive` of every entry of the data files
    under ``root`` (a tensor or a value, each a ``torch.save`` zip that torch's loader
    inflates in memory), from its zip directory alone; FormatError naming the file, the
    bytes and the key. Run after ``check_storage``: every entry lies in its file, none
    compressed."""
    files: dict[str, int] = {}
    try:
        for index, info in metadata.storage_data.items():
            name, offset, length = info.relative_path, info.offset, info.length
            if name not in files:
                files[name] = regular_fd(os.path.join(root, name), follow_links=False)  # no link out of it
            where = f"{os.path.join(root, name)}: bytes {offset}..{offset + length} ({index.fqn!r})"
            check_archive(FileSlice(files[name], offset, length), where=where)
    finally:
        for fd in files.values():
            os.close(fd)


def _check_nesting(paths: dict[str, KeyPath], *, where: str) -> None:
    """FormatError unless DCP's key paths describe one nested state: no entry inside
    another's value, no list items named far past the entries there are."""
    leaves = {path: fqn for fqn, path in paths.items()}
    for fqn, path in paths.items():
        inner = next((leaves[path[:i]] for i in range(1, len(path)) if path[:i] in leaves), None)
        if inner is not None:
            raise FormatError(f"{where}: DCP planner_data puts {fqn!r} inside the value of {inner!r}")
    if len(_list_gaps(list(paths.values()))) > len(paths):
        raise FormatError(f"{where}: DCP planner_data names list items far past the entries it has")


def _nest(flat: dict[str, Any], paths: dict[str, KeyPath], *, where: str) -> dict:
    """DCP's flat entries put back where they sat in the saved state (dicts, lists);
    ``paths`` passed :func:`_check_nesting`."""
    entries = [(paths[fqn], value) for fqn, value in flat.items()]
    gaps = _list_gaps([path for path, _value in entries])
    try:
        return build_nested([*entries, *((path, {}) for path in gaps)])
    except (FormatError, AttributeError, TypeError) as e:  # a path through a leaf, say
        raise FormatError(f"{where}: DCP planner_data does not describe one nested state: {e}") from e


def _list_gaps(paths: list[KeyPath]) -> list[KeyPath]:
    """The list items no path reaches, before the last one that is reached. DCP
    records nothing for an empty dict (no leaf below it), and that is the only value
    it drops, so each gap was one: it is rebuilt as ``{}``."""
    reached: dict[KeyPath, set[int]] = {}
    for path in paths:
        for i, (kind, key) in enumerate(path):
            if kind == "l":
                assert isinstance(key, int), "a list step's key is its index"
                reached.setdefault(path[:i], set()).add(key)
    return [(*parent, ("l", i)) for parent, indices in reached.items() for i in range(max(indices)) if i not in indices]


def conversion_error(error: BaseException, what: str) -> ConversionError:
    """DCP's ``CheckpointException`` (a ``BaseException`` whose message is every
    failed rank's traceback) as one line: ``what``, then the first failure's type and
    message; ``errors`` keeps each rank's error."""
    failures = getattr(error, "failures", None) or {}
    errors = {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in failures.items()}
    if errors:
        rank = min(errors)
        first = errors[rank]
        detail = f"{type(first).__name__}: {first}" if str(first) else type(first).__name__
        if len(errors) > 1:
            detail += f" (rank {rank}; {len(errors) - 1} more ranks failed)"
    else:
        detail = f"{type(error).__name__}: {error}"
    text = " | ".join(line.strip() for line in f"{what}: {detail}".splitlines() if line.strip())
    return ConversionError(text, errors={r: e for r, e in errors.items() if isinstance(e, BaseException)})
