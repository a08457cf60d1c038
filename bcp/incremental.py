"""The save side of incremental checkpoints (metadata/FORMAT.md, "References" and "Holds").

An incremental save (``base=`` or ``incremental=True``) cuts every fragment into pieces of whole dim-0 rows
(:func:`cut_pieces`), digests each piece's bytes with XXH3-128 and, where a piece's fqn, dtype, global shape, box,
checksum block size and digest equal a row of its base's catalog, writes nothing for it: its row copies the base
row's file, byte offset, size, checksums and digest (:func:`match`). The coordinator checks the base (a committed
sibling), puts holds on every generation the base's manifest names and reads that manifest again (:func:`hold_base`),
in that order, before any rank decides what to reuse; the commit lists the referenced files with ``"checkpoint":
NAME`` (:func:`reference_entries`). A base that cannot be read (damaged, a newer format) or held (a read-only one)
only costs the bytes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch

from bcp import commit as commit_protocol
from bcp import holds
from bcp.commit import read_manifest
from bcp.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from bcp.io_scheduler.write_pipeline import WriteItem
from bcp.metadata import FileEntry, FormatError, Manifest, crc32c, digest_of_checksums, itemsize
from bcp.metadata.keys import generation_of, hold_key, is_sibling_name, split_parent
from bcp.metadata.rows import Rows, TensorEntry
from bcp.metadata.ties import reusable
from bcp.options import SaveOptions
from bcp.pieces import background
from bcp.planning.writer_rows import REPORT_SCHEMA, WriterReport
from bcp.reader import CheckpointReader, fetch_metadata, open_reader
from bcp.references import parent_factory
from bcp.target import Target, resolve_backend
from bcp.tensor_io import flat_bytes, host_contiguous, raw

log = logging.getLogger(__name__)

#: how many times a manager's save chooses its base again after another process deleted it
BASE_TRIES = 3
_T = TypeVar("_T")

# -- the base ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BaseRef:
    """The base a save refers to, as the coordinator checked and held it (sent to every rank)."""

    uri: str  #: the base's URI
    name: str  #: its last segment, under the common parent
    manifest: Manifest  #: its manifest as read (every rank reads the same one)


def _parent_key(uri: str) -> str:
    parent, _name = split_parent(uri)
    if "://" not in parent and not parent.lower().startswith("file:"):
        return os.path.realpath(parent)
    return parent


def check_sibling(uri: Target, base: str) -> tuple[str, str]:
    """``(parent, base name)``; ValueError naming ``base`` unless it is a sibling of ``uri``
    (same parent URI, a name FORMAT.md allows, not ``uri`` itself)."""
    if not isinstance(uri, (str, os.PathLike)) or not isinstance(base, (str, os.PathLike)):
        raise ValueError(f"base {base!r}: an incremental save needs URIs for the checkpoint and its base")
    uri, base = os.fspath(uri), os.fspath(base)
    try:
        parent, name = split_parent(uri)
        _bparent, bname = split_parent(base)
    except ValueError as e:
        raise ValueError(f"base {base!r}: {e}") from None
    if _parent_key(uri) != _parent_key(base):
        raise ValueError(f"base {base!r} is not a sibling of {uri!r}: it must lie under the same parent {parent!r}")
    if not is_sibling_name(bname) or not is_sibling_name(name):
        raise ValueError(f"base {base!r}: checkpoint names must match [A-Za-z0-9_][A-Za-z0-9._-]*")
    if bname == name:
        raise ValueError(f"base {base!r} is the checkpoint being saved: pass an earlier sibling")
    return parent, bname


def is_sibling(uri: Target, base: str) -> bool:
    """Whether :func:`check_sibling` accepts ``base`` (nothing is read before it does)."""
    try:
        check_sibling(uri, base)
    except ValueError:
        return False
    return True


def referenced_generations(manifest: Manifest, name: str) -> dict[tuple[str, str], None]:
    """(owner checkpoint, generation) of every data file ``manifest`` (of checkpoint ``name``) names."""
    out: dict[tuple[str, str], None] = {(name, manifest.generation): None}
    for f in manifest.data_files:
        gen = generation_of(f.path)
        if gen is not None:
            out[(f.checkpoint or name, gen)] = None
    return out


def hold_base(
    uri: Target,
    base: str,
    save_id: str,
    storage_options: object = None,
    reusable: Callable[[BaseRef], bool] | None = None,
) -> BaseRef | None:
    """(coordinator) FORMAT.md's order: read the base's manifest, write a hold on every
    generation it names, read the manifest again. The base, or None (refer to nothing)
    when it changed or went away in between. CheckpointNotFoundError naming ``base``
    when it is not committed at the start. ``reusable`` (a save of one rank, which alone
    decides what it reuses): asked after the first read; False means no piece of the
    base would be reused, so nothing is held and the save refers to nothing (dense
    training then pays no durable hold write)."""
    parent, name = check_sibling(uri, base)
    opts = dict(storage_options or {})  # type: ignore[call-overload]
    base_backend = resolve_backend(base, opts)
    try:
        first = read_manifest(base_backend)  # None: no manifest
    except (CorruptCheckpointError, FormatError) as e:  # a base only saves bytes: a damaged one fails no save
        log.warning("base %s: its manifest cannot be used (%s): saving every byte", base, e)
        return None
    if first is None:
        raise CheckpointNotFoundError(f"base {base!r} holds no committed checkpoint (no manifest.json)")
    if reusable is not None and not reusable(BaseRef(os.fspath(base), name, first)):
        log.debug("base %s: no piece of it equals one being saved: nothing held", base)
        return None
    parent_backend = resolve_backend(parent, opts)
    own_name = split_parent(os.fspath(uri))[1]  # type: ignore[arg-type]  # check_sibling took URIs
    keys = [f"{owner}/{hold_key(gen, own_name, save_id)}" for owner, gen in referenced_generations(first, name)]
    try:
        holds.place(parent_backend, keys)
        again = read_manifest(base_backend)
    except Exception as e:  # noqa: BLE001 - a base this job cannot hold (read-only) or read again: refer to nothing
        log.warning("base %s: cannot hold it or read it again (%s: %s): saving every byte", base, type(e).__name__, e)
        return None
    if again is None or again.save_id != first.save_id:
        log.warning("base %s changed or was deleted while this save held it: saving every byte", base)
        return None
    return BaseRef(os.fspath(base), name, first)


def drop_unused_holds(uri: str, base: BaseRef, save_id: str, manifest: Manifest, options: object = None) -> None:
    """(coordinator, after the commit) Delete the holds :func:`hold_base` put on base generations the committed
    ``manifest`` reads no byte of (they would keep bytes retired for gc's grace period). Never raises."""
    used = {(f.checkpoint, generation_of(f.path)) for f in manifest.references}
    unused = [held for held in referenced_generations(base.manifest, base.name) if held not in used]
    try:
        parent, own_name = split_parent(uri)
        backend = resolve_backend(parent, dict(options or {}))  # type: ignore[call-overload]
        for owner, gen in unused:
            backend.delete(f"{owner}/{hold_key(gen, own_name, save_id)}")
    except Exception as e:  # noqa: BLE001 - housekeeping after a commit never fails the save
        log.warning("%s: holds on unused generations of its base stay until they age: %s", uri, e)


def release_replaced(uri: str, replaced: Manifest, options: object = None) -> None:
    """(coordinator, after an overwrite's commit) Release the replaced one's holds as deleting it would. Never fails."""
    try:
        parent, name = split_parent(uri)
        backend = resolve_backend(parent, dict(options or {}))  # type: ignore[call-overload]
        holds.release(backend, name, replaced, holds.HoldChecker(backend))
    except Exception as e:  # noqa: BLE001 - housekeeping after a commit never fails the save
        log.warning("%s: the holds of the checkpoint it replaced stay until they age: %s", uri, e)


# -- matching ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reuse:
    """What one rank takes from its base: per reused item, the row it copies."""

    #: indices (into the rank's items) of the reused items, and of the changed ones
    reused: list[int]
    changed: list[int]
    #: per reused item: (file path, byte offset, nbytes, checksums)
    rows: list[tuple[str, int, int, list[int]]]
    #: path -> the reference's FileEntry (checkpoint set; crc32c filled at commit)
    files: dict[str, FileEntry]


def on_newest_base(
    options: SaveOptions, newest: Callable[[], str | None] | None, start: Callable[[SaveOptions], _T]
) -> _T:
    """(all ranks) ``start(options)`` with the base ``newest()`` chooses (a manager's:
    its newest committed step; ``newest`` None: ``options`` as they are). Another process
    on the root (a second manager's retention, ``bcp gc``) may delete that step before
    the save holds it: the save then raises CheckpointNotFoundError naming it, on every
    rank, before writing anything; the base is chosen again, at most ``BASE_TRIES``
    times, then none (every byte written)."""
    if newest is None:
        return start(options)
    for attempt in range(BASE_TRIES + 1):
        base = newest() if attempt < BASE_TRIES else None
        try:
            return start(dataclasses.replace(options, incremental=True, base=base))
        except CheckpointNotFoundError as e:
            if base is None or repr(base) not in str(e):
                raise
            log.info("base %s was deleted before this save held it: choosing again", base)
    raise AssertionError("unreachable: the last attempt has no base")


def open_base(base: str, storage_options: object = None) -> CheckpointReader:
    """A reader of the base's metadata (manifest and catalog head; sections on demand)."""
    options = dict(storage_options or {})  # type: ignore[call-overload]
    backend = resolve_backend(base, options)
    metadata = fetch_metadata(backend, allow_head_only=True)
    return open_reader(backend, metadata, parent=parent_factory(base, options))


def prefetch_base(base: str, storage_options: object, fqns: Sequence[str]) -> concurrent.futures.Future:
    """Start reading the base's metadata and the catalog sections of ``fqns`` in the
    background, while the coordinator holds the base (a durable write): :func:`match`
    takes the reader if its manifest is the one held (the same ``save_id``: a
    generation's files never change), else reads again. Errors wait for :func:`match`."""

    def read() -> CheckpointReader:
        reader = open_base(base, storage_options)
        known = set(reader.tensor_keys())
        reader.catalog.entries(sorted({f for f in fqns if f in known}))
        return reader

    return background(read)


#: a base row an item could reuse: (digest, file path, byte offset, nbytes, checksums)
BaseRow = tuple[bytes, str, int, int, tuple[int, ...]]

#: per item: its base rows of the same box, each with its first block checksum (None:
#: an empty row), or None (no such row): what :func:`base_rows` looks up
Looked = list[list[tuple[int | None, BaseRow]] | None]

#: Base-row lookups kept per structure (``bcp.kept_plans.LocalPlan.lookups``): the base
#: and the one before it (a save's early match and its match after the holds).
KEEP_LOOKUPS = 4
#: Guards every kept lookups mapping (an async save's commit and the next save's early
#: match may touch one at once).
_kept_lock = threading.Lock()


def _new_kept_lock_in_child() -> None:
    """A fork while a commit thread held the lock would leave it held forever in the child."""
    global _kept_lock
    _kept_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_kept_lock_in_child)


@dataclasses.dataclass
class Candidates:
    """What the base offers ``items`` before any digest is taken: per item, the base
    rows that could hold it (same fqn, dtype, global shape, box and size, with a digest)
    whose first block checksum equals the CRC32C of the item's first block now (a
    different checksum proves the bytes changed: no digest is needed to know that)."""

    #: the base as held (``None``: the save refers to nothing)
    base: BaseRef | None
    #: per item: its candidate rows, or None
    rows: list[list[BaseRow] | None]

    def to_digest(self) -> list[int]:
        """The items whose digest decides whether they are reused (the others are written)."""
        return [k for k, r in enumerate(self.rows) if r is not None]

    def subset(self, indices: Sequence[int]) -> Candidates:
        """The candidates of ``items[i] for i in indices`` (one rank's writes of every box)."""
        return Candidates(self.base, [self.rows[i] for i in indices])


def _reader_of(
    base: BaseRef, storage_options: object, prefetched: concurrent.futures.Future | None
) -> CheckpointReader | None:
    """A reader of ``base`` as held (the prefetched one when it read the same save), or None when the base changed,
    went away or cannot be read after it was held (every byte is written)."""
    reader = None
    if prefetched is not None:
        try:
            reader = prefetched.result()
        except Exception as e:  # noqa: BLE001 - read again below; that error is the one to report
            log.debug("base %s: the early read failed (%s): reading it again", base.uri, e)
        if reader is not None and reader.manifest.save_id != base.manifest.save_id:
            reader = None
    if reader is None:
        try:
            reader = open_base(base.uri, storage_options)
        except (CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError, FormatError) as e:
            # deleted since the coordinator held it (another process's retention; its bytes stay, held), or its
            # catalog is damaged: refer to nothing (the hold is then stale: its files are not named)
            log.warning("base %s went away after it was held or cannot be read (%s): saving every byte", base.uri, e)
            return None
    if reader.manifest.save_id != base.manifest.save_id:
        return None  # the base changed after the coordinator held it
    return reader


def base_rows(
    base: BaseRef, items: Sequence[WriteItem], storage_options: object, prefetched: concurrent.futures.Future | None
) -> Looked | None:
    """Per item, the rows of ``base``'s catalog holding its box (fqn, dtype, global shape, box, size, a digest, a file
    the manifest lists): from the base and the items' structure only. None when the base changed after it was held.
    Reads only the catalog sections those boxes need."""
    none: Looked = [None] * len(items)
    reader = _reader_of(base, storage_options, prefetched)
    if reader is None:
        return None
    catalog = reader.catalog
    known = set(reader.tensor_keys())
    wanted = [(i.plan.fqn, i.piece.box) for i in items if i.plan.fqn in known]
    if not wanted:
        return none
    catalog.require(wanted)
    entries = {e.fqn: e for e in catalog.entries(list(dict.fromkeys(f for f, _b in wanted)))}  # in save order
    try:  # of a tie in the base, only its keys tied again may reuse its rows (metadata.ties.reusable)
        entries = reusable(entries, {i.plan.fqn: i.plan.alias_of for i in items})
    except FormatError as e:  # bytes shared otherwise (an older bcp's untie): reuse none of them
        log.warning("base %s: %s: saving every byte", base.uri, e)
        return none
    by_path = {f.path for f in base.manifest.data_files}
    names = catalog.file_names
    out = list(none)
    for k, item in enumerate(items):
        entry = entries.get(item.plan.fqn)
        if entry is None:
            continue
        found = []
        for h in _same_box(entry, item).tolist():
            path = names[int(entry.files[h])]
            if path not in by_path:
                continue
            sums = tuple(entry.checksums(h))
            size = int(entry.sizes[h])
            row: BaseRow = (bytes(entry.digests[h]), path, int(entry.byte_offsets[h]), size, sums)  # type: ignore[index]  # _same_box: digests
            found.append((sums[0] if size else None, row))
        if found:
            out[k] = found
    return out


def find_candidates(
    base: BaseRef | None,
    items: Sequence[WriteItem],
    block: int,
    storage_options: object = None,
    prefetched: concurrent.futures.Future | None = None,
    kept: OrderedDict[Any, Looked] | None = None,
    scope: object = None,
) -> Candidates:
    """:class:`Candidates` of ``items`` in ``base``'s catalog (:func:`base_rows`; ``prefetched``: a reader
    :func:`prefetch_base` started, used when it read the base held). ``kept`` (a kept plan's ``lookups``, for items of
    its structure taken at ``scope``): the lookup of the same base (URI and save id: its files never change) taken
    there by an earlier save, else taken and kept. One CRC32C of at most ``block`` bytes per item with a candidate row:
    dense training, where every piece changes, then takes no digest before writing (``bcp.pieces`` digests writes)."""
    none: list[list[BaseRow] | None] = [None] * len(items)
    if base is None or base.manifest.checksum_block_bytes != block or not items:
        return Candidates(None, none)
    key = (base.uri, base.manifest.save_id, block, scope)
    looked = None
    if kept is not None:
        with _kept_lock:
            looked = kept.get(key)
            if looked is not None:
                kept.move_to_end(key)  # the least recently used is dropped first
    if looked is None or len(looked) != len(items):
        looked = base_rows(base, items, storage_options, prefetched)
        if looked is None:
            return Candidates(None, none)
        if kept is not None:
            remember_commit(kept, base.uri, base.manifest.save_id, block, {scope: looked})
    rows = list(none)
    for k, found in enumerate(looked):
        if not found:
            continue
        first = first_block_crc(items[k].piece.tensor, block)
        keep = [row for f, row in found if f is None or f == first]
        if keep:
            rows[k] = keep
    return Candidates(base, rows)


def _same_box(e: TensorEntry, item: WriteItem) -> np.ndarray:
    """The indices of ``e``'s rows holding exactly ``item``'s box, with a digest."""
    if e.digests is None or e.dtype != item.plan.dtype or tuple(e.global_shape) != tuple(item.plan.global_shape):
        return np.zeros(0, np.int64)
    offs, lens = item.piece.box
    nd = len(offs)
    nbytes = math.prod(lens) * itemsize(item.plan.dtype)
    same = e.sizes == nbytes
    if nd:
        same &= (e.offsets[:, :nd] == np.asarray(offs)).all(axis=1)
        same &= (e.lengths[:, :nd] == np.asarray(lens)).all(axis=1)
    return np.flatnonzero(same)


def _head(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A view of ``t``'s leading part whose row-major bytes begin ``t``'s and hold at least
    its first ``nbytes`` (all of ``t`` when it holds fewer): the first rows that cover
    them, or within the first row when one row does."""
    size = t.element_size()
    while t.dim() > 1 and t.shape[0]:
        row = math.prod(t.shape[1:]) * size
        if not row or row < nbytes:
            return t[: -(-nbytes // row)] if row else t
        t = t[0]  # one row holds them: its own leading part
    return t[: -(-nbytes // size)] if t.dim() == 1 else t


def first_block_crc(tensor: torch.Tensor, block: int) -> int:
    """CRC32C of the first ``block`` bytes of ``tensor``'s stored bytes (row-major): the
    first block checksum a catalog row of those bytes holds. A CUDA tensor is read on this
    thread's stream: the caller orders it (``device_copy.caller_done``)."""
    # only the leading rows that hold the first block are made contiguous (or copied off
    # the device): a whole non-contiguous piece copied for 64 KiB cost ~600x more
    t = _head(tensor.detach(), max(1, block))
    if t.device.type != "cpu":  # made dense on the device as same-width integers (every dtype has a kernel)
        t = t.resolve_conj().resolve_neg()
        t = raw(t).contiguous().view(t.dtype).cpu()
    t = host_contiguous(t)
    if not t.numel():
        return crc32c(b"")
    return crc32c(memoryview(flat_bytes(t).numpy()[:block]))  # type: ignore[arg-type]  # numpy's stubs: no __buffer__ before 3.12


def decide(candidates: Candidates, items: Sequence[WriteItem], digests: np.ndarray) -> Reuse:
    """Which of ``items`` equal a candidate row (:func:`find_candidates`) by digest
    (``digests[k]``: item k's, taken for the items :meth:`Candidates.to_digest` names)."""
    base = candidates.base
    if base is None:
        return Reuse([], list(range(len(items))), [], {})
    by_path = {f.path: f for f in base.manifest.data_files}
    reused, changed, rows = [], [], []
    files: dict[str, FileEntry] = {}
    for k, found in enumerate(candidates.rows):
        digest = digests[k].tobytes() if found else b""
        row = next((r for r in found if r[0] == digest), None) if found else None
        if row is None:
            changed.append(k)
            continue
        path = row[1]
        if path not in files:
            owner = by_path[path]
            files[path] = FileEntry(path, owner.nbytes, 0, owner.checkpoint or base.name)
        rows.append((path, row[2], row[3], list(row[4])))
        reused.append(k)
    return Reuse(reused, changed, rows, files)


def match(
    base: BaseRef | None,
    items: Sequence[WriteItem],
    digests: np.ndarray,
    block: int,
    storage_options: object = None,
    prefetched: concurrent.futures.Future | None = None,
) -> Reuse:
    """Which of ``items`` equal a row of ``base``'s catalog (fqn, dtype, global shape,
    box, checksum block size, digest): :func:`find_candidates` then :func:`decide`."""
    return decide(find_candidates(base, items, block, storage_options, prefetched), items, digests)


def with_reuse(report: WriterReport, items: Sequence[WriteItem], reuse: Reuse, digests: np.ndarray) -> WriterReport:
    """This rank's report: the rows the pipeline wrote (the changed items, in order)
    then the reused ones, with every row's digest and, for reused rows, their file."""
    written = report.rows
    reused_rows = pa.table(
        [
            pa.array([items[k].tensor for k in reuse.reused], pa.int32()),
            pa.array([list(items[k].piece.box[0]) for k in reuse.reused], pa.list_(pa.int64())),
            pa.array([list(items[k].piece.box[1]) for k in reuse.reused], pa.list_(pa.int64())),
            pa.array([r[1] for r in reuse.rows], pa.int64()),
            pa.array([r[2] for r in reuse.rows], pa.int64()),
            pa.array([r[3] for r in reuse.rows], pa.list_(pa.uint32())),
        ],
        schema=REPORT_SCHEMA,
    )
    rows = pa.concat_tables([written, reused_rows]) if reuse.reused else written
    order = reuse.changed + reuse.reused
    paths = [""] * written.num_rows + [r[0] for r in reuse.rows]
    tensors = dict(report.tensors)
    tensors.update({items[k].tensor: items[k].plan for k in reuse.reused})
    return dataclasses.replace(
        report,
        rows=rows,
        tensors=tensors,
        digests=digests[order] if order else np.zeros((0, 16), np.uint8),
        row_files=tuple(paths),
        references=tuple(reuse.files.values()),
    )


def committed_rows(report: WriterReport, reuse: Reuse, n: int) -> Looked | None:
    """Per item (``n`` of them, as :func:`with_reuse` ordered ``report``'s rows), the
    row the checkpoint just committed holds for it: the lookup (:func:`base_rows`) of
    that checkpoint as a base, known without reading its catalog. None when the report
    does not hold one row per item."""
    order = reuse.changed + reuse.reused
    table, files = report.rows, report.row_files
    if table.num_rows != len(order) or report.digests is None or files is None or len(report.digests) != len(order):
        return None
    own = report.file.path if report.file is not None else None
    offsets = table.column("byte_offset").to_pylist()
    sizes = table.column("nbytes").to_pylist()
    sums = table.column("checksums").to_pylist()
    out: Looked = [None] * n
    for j, k in enumerate(order):
        path = files[j] or own
        if path is None:
            continue
        size, checks = int(sizes[j]), tuple(sums[j])
        row: BaseRow = (report.digests[j].tobytes(), path, int(offsets[j]), size, checks)
        out[k] = [(checks[0] if size else None, row)]
    return out


def remember_commit(
    kept: OrderedDict[Any, Looked], uri: str, save_id: str, block: int, scopes: dict[object, Looked]
) -> None:
    """Keep the lookups of the checkpoint ``uri`` (saved as ``save_id``) that a save just
    committed, per scope (:func:`find_candidates`): the next save whose base it is
    (the same URI and save id, as the manifest read says) reads no catalog."""
    with _kept_lock:
        for scope, looked in scopes.items():
            kept[(uri, save_id, block, scope)] = looked
            kept.move_to_end((uri, save_id, block, scope))
            while len(kept) > KEEP_LOOKUPS:
                del kept[next(iter(kept))]


def knows_base(kept: OrderedDict[Any, Looked] | None, uri: str) -> bool:
    """Whether ``kept`` holds a lookup of some save of ``uri`` (its manifest says which)."""
    if kept is None:
        return False
    with _kept_lock:
        return any(key[0] == uri for key in kept)


def prefetch_manifest(base: str, storage_options: object) -> concurrent.futures.Future:
    """Start reading only the base's manifest in the background (its catalog is known
    by :func:`remember_commit` if the manifest names that save)."""
    options = dict(storage_options or {})  # type: ignore[call-overload]
    return background(lambda: commit_protocol.read_manifest(resolve_backend(base, options)))


def reference_entries(references: Sequence[FileEntry], rows: Rows, names: Sequence[str]) -> list[FileEntry]:
    """The manifest entries of the referenced files: each file's CRC32C over the block
    checksums of this catalog's rows in it, in file order (a stored fragment once)."""
    code = {n: i for i, n in enumerate(names)}
    out = []
    for ref in {r.path: r for r in references}.values():
        at = np.flatnonzero(rows.file == code[ref.path])
        order = at[np.argsort(rows.byte_offset[at], kind="stable")]
        sums: list[int] = []
        seen: set[int] = set()
        for r in order.tolist():
            off = int(rows.byte_offset[r])
            if off in seen:
                continue
            seen.add(off)
            sums.extend(rows.sums[rows.sum_starts[r] : rows.sum_starts[r + 1]].tolist())
        out.append(dataclasses.replace(ref, crc32c=digest_of_checksums(sums)))
    return out


__all__ = [
    "BaseRef",
    "BaseRow",
    "Candidates",
    "Looked",
    "Reuse",
    "base_rows",
    "check_sibling",
    "committed_rows",
    "decide",
    "drop_unused_holds",
    "find_candidates",
    "first_block_crc",
    "hold_base",
    "is_sibling",
    "knows_base",
    "match",
    "open_base",
    "prefetch_base",
    "prefetch_manifest",
    "reference_entries",
    "release_replaced",
    "remember_commit",
    "with_reuse",
]
