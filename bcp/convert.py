"""Conversion between bcp and the formats people use, tensor by tensor.

* bcp -> Hugging Face-style safetensors: size-capped shards
  (``model-00001-of-00003.safetensors``) plus ``model.safetensors.index.json`` (one
  ``model.safetensors`` when everything fits one shard), with optional renaming
  rules, a floating-point dtype cast and a copied ``config.json``. Memory: one shard.
* bcp -> one ``torch.save`` file: each tensor is read into a file-backed (mmap)
  buffer in a scratch directory, so ``torch.save`` streams from the page cache;
  the file keeps the saved nesting and the checkpoint's (safe) objects.
* safetensors (a file, or a directory of shards) -> bcp: the files are
  memory-mapped and their tensors saved without being copied into memory first.
* ``torch.save`` file -> bcp: ``torch.load(mmap=True, weights_only=True)``.
* bcp -> PyTorch DCP: written by DCP's own writer and planner (so DCP's load finds
  the state's nesting as it flattens it), the tensors read from bcp in bounded
  batches only when the writer asks for them, into a staging directory moved into
  place once complete. Memory: one batch.
* PyTorch DCP checkpoint -> bcp: every tensor is loaded by DCP into a file-backed
  buffer, then saved with the nesting DCP recorded (``planner_data``) rebuilt.
  DCP's ``.metadata`` and its non-tensor entries are pickles:
  without ``allow_pickle=True`` the metadata is unpickled with an allow-list of DCP's
  own types (:mod:`bcp.dcp_metadata`) and the entries with ``weights_only=True``; an
  entry that needs more is skipped (and named).

Objects saved per rank keep every rank's value in the torch and DCP exports, under
``__rank_<r>__`` keys (:func:`export_object`), unless one saved rank is chosen. DCP's
own failures (``CheckpointException``, a ``BaseException``) are raised as a one-line
:class:`~bcp.errors.ConversionError`.

Memory stays bounded by the shard size (safetensors out) or is file-backed page
cache, which the kernel can reclaim (everything else), so a checkpoint larger than
RAM converts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from typing import Any, TypeVar

import torch

from bcp.metadata import MANIFEST_KEY
from bcp.metadata.geometry import Box

from .errors import FormatError
from .extras import needs_extra
from .reader import CheckpointReader, PerRankChoice, check_per_rank_choice, open_checkpoint
from .saver import SaveInfo, save
from .state import KeyPath, build_nested

log = logging.getLogger(__name__)

#: safetensors dtype names (the format's own spelling) <-> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
INDEX_NAME = "model.safetensors.index.json"

Progress = Callable[[int], None]  # called with bytes done
T = TypeVar("T")


def _umask() -> int:
    """The process's umask, read from /proc where Linux shows it (nothing changes); else
    set and restored at once (other threads could create a file in between)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: str, final: str) -> None:
    """Move a finished temporary file into place with the mode a plain ``open()`` gives
    (0666 & ~umask): a writer that creates its file private (safetensors' ``save_file``
    makes it 0600) would leave an export that another user's serving process cannot read."""
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, final)


def select(keys: Iterable[str], prefix: str | None, strip: bool) -> list[tuple[str, str]]:
    """(stored key, output name) for the keys under ``prefix`` (all when None)."""
    out = []
    for key in keys:
        if prefix and not key.startswith(prefix):
            continue
        out.append((key, key[len(prefix) :] if prefix and strip else key))
    return out


# -- per-rank objects ----------------------------------------------------------------------------

#: An export that keeps every rank's value of a per-rank object (``per_rank="all"``)
#: writes ``{rank_key(0): value of rank 0, rank_key(1): ...}`` where the object was.
RANK_KEY = "__rank_{}__"


def rank_key(rank: int) -> str:
    """``__rank_<rank>__``: the key of saved rank ``rank``'s value of a per-rank object
    in a torch or DCP export (the key a DCP load template on rank ``rank`` uses)."""
    return RANK_KEY.format(rank)


def per_rank_keys(reader: CheckpointReader, keys: Iterable[str] | None = None) -> list[str]:
    """The objects among ``keys`` (default: all) that were saved per rank."""
    return [k for k in (reader.object_keys() if keys is None else keys) if reader.is_per_rank(k)]


def export_object(reader: CheckpointReader, key: str, per_rank: PerRankChoice) -> Any:
    """A stored object as an export writes it. A per-rank one: with ``"all"``, a dict
    ``{rank_key(r): value}`` over every saving rank ``r``, in rank order; with a rank,
    that saved rank's value (ValueError naming the key and the ranks that saved it
    when it did not)."""
    if not reader.is_per_rank(key):
        return reader.read_object(key)
    values = reader.per_rank_objects(key)
    if per_rank == "all":
        return {rank_key(r): values[r] for r in sorted(values)}
    if per_rank not in values:
        raise ValueError(
            f"per-rank object {key!r} was saved by ranks {sorted(values)}, not by rank {per_rank} (--per-rank)"
        )
    return values[per_rank]


# -- bcp -> safetensors --------------------------------------------------------------------------


def plan_shards(sizes: Sequence[tuple[T, int]], max_shard_bytes: int) -> list[list[T]]:
    """Greedy, in order: a new shard starts when the next tensor would pass the cap
    (a tensor larger than the cap gets a shard of its own). Also how ``to_dcp``
    batches its writes."""
    shards: list[list[T]] = []
    current: list[T] = []
    used = 0
    for name, n in sizes:
        if current and used + n > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


def to_safetensors(
    src: str | CheckpointReader,
    dst_dir: str,
    *,
    prefix: str | None = None,
    strip_prefix: bool = False,
    rename: Sequence[RenameRule | str] = (),
    dtype: torch.dtype | None = None,
    config: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> dict:
    """Write the checkpoint's tensors as safetensors shards in ``dst_dir``; returns the index.

    Names: the stored keys under ``prefix`` (``prefix`` dropped with ``strip_prefix``),
    then each ``rename`` rule (``"REGEX=REPLACEMENT"`` or a compiled pair, see
    :func:`parse_rename`) applied in order with ``re.sub``; two keys that end with one
    name are a ValueError naming both. ``dtype`` casts the floating-point tensors
    (only those), shard by shard. ``config`` is a JSON file (a Hugging Face
    ``config.json``) checked and copied into ``dst_dir`` as ``config.json``, so that
    ``from_pretrained(dst_dir)`` finds it. Memory: one shard (plus one tensor cast).

    ``dst_dir`` must be empty or absent (FileExistsError otherwise), so that no old
    shard is left beside the new index. With ``overwrite``, the old index and the
    ``*.safetensors`` files this export does not write are removed (and
    ``config.json`` replaced when ``config`` is given); nothing else in ``dst_dir`` is
    touched. Everything is checked before the first file is written."""
    with needs_extra("hf", "exporting to safetensors (bcp convert --to safetensors)"):
        from safetensors.torch import save_file

    reader = src if isinstance(src, CheckpointReader) else open_checkpoint(src)
    chosen = select(reader.tensor_keys(), prefix, strip_prefix)
    if not chosen:
        raise ValueError(f"no tensors under prefix {prefix!r} in {reader.uri}")
    rules = [parse_rename(rule) if isinstance(rule, str) else rule for rule in rename]
    key_of = _output_names([(key, apply_renames(name, rules)) for key, name in chosen], renamed=bool(rules))
    names = list(key_of)
    out_dtype = {name: _cast_dtype(reader.meta(key).dtype, dtype) for name, key in key_of.items()}
    for name, key in key_of.items():
        if out_dtype[name] not in SAFETENSORS_DTYPES.values():
            raise ValueError(f"tensor {key!r} has dtype {out_dtype[name]}, which safetensors cannot store")
    config_text = read_json_config(config) if config is not None else None
    sizes = [(name, torch.Size(reader.meta(key_of[name]).shape).numel() * out_dtype[name].itemsize) for name in names]
    shards = plan_shards(sizes, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stale = _stale_files(
        dst_dir,
        kind="safetensors",
        wanted=lambda name: name == INDEX_NAME or name.endswith(".safetensors"),
        overwrite=overwrite,
        keep=set(files),
    )
    if INDEX_NAME in stale:  # first: while shards are replaced, no index names a mix of old and new
        os.remove(os.path.join(dst_dir, INDEX_NAME))
    os.makedirs(dst_dir, exist_ok=True)
    weight_map, total = {}, 0
    for file, shard in zip(files, shards, strict=True):
        read = reader.read_tensors([key_of[name] for name in shard])  # one batch: contiguous runs coalesce
        tensors = {name: read.pop(key_of[name]).to(out_dtype[name]) for name in shard}
        del read
        for name in shard:
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
        tmp = os.path.join(dst_dir, f".{file}.partial")
        save_file(tensors, tmp, metadata={"format": "pt"})
        _publish(tmp, os.path.join(dst_dir, file))
        if progress:
            progress(sum(reader.meta(key_of[name]).nbytes for name in shard))  # stored bytes, as the total counts
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(shards) > 1:
        tmp = os.path.join(dst_dir, f".{INDEX_NAME}.partial")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        _publish(tmp, os.path.join(dst_dir, INDEX_NAME))
    for name in stale:
        if name != INDEX_NAME:
            log.info("removing %s from %s: the new export does not write it", name, dst_dir)
            os.remove(os.path.join(dst_dir, name))
    if config_text is not None:
        tmp = os.path.join(dst_dir, f".{CONFIG_NAME}.partial")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(config_text)
        _publish(tmp, os.path.join(dst_dir, CONFIG_NAME))
    return index


RenameRule = tuple["re.Pattern[str]", str]

#: --dtype spellings -> torch dtypes.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
CONFIG_NAME = "config.json"


def parse_dtype(text: str) -> torch.dtype:
    """A ``--dtype`` value (``bf16``, ``fp16``, ``fp32``, ``fp64`` or torch's names)."""
    try:
        return DTYPE_NAMES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}; choose one of {', '.join(sorted(DTYPE_NAMES))}") from None


def parse_rename(rule: str) -> RenameRule:
    """``"REGEX=REPLACEMENT"`` -> (compiled REGEX, REPLACEMENT). The split is at the
    last ``=``, so a regex may hold one (``(?<=x)``) and the replacement may not."""
    pattern, sep, replacement = rule.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"rename rule {rule!r} is not REGEX=REPLACEMENT")
    try:
        return re.compile(pattern), replacement
    except re.error as e:
        raise ValueError(f"rename rule {rule!r}: bad regular expression: {e}") from None


def apply_renames(name: str, rules: Sequence[RenameRule]) -> str:
    """``name`` after every rule, in order (``re.sub``: every match is replaced)."""
    for pattern, replacement in rules:
        try:
            name = pattern.sub(replacement, name)
        except re.error as e:
            raise ValueError(f"rename rule {pattern.pattern!r}={replacement!r}: {e}") from None
    return name


def _output_names(pairs: list[tuple[str, str]], *, renamed: bool) -> dict[str, str]:
    """output name -> stored key; ValueError naming both keys when two share a name."""
    key_of: dict[str, str] = {}
    for key, name in pairs:
        if not name:
            raise ValueError(f"tensor {key!r} gets an empty name; check the rename rules")
        if name in key_of:
            cause = "the rename rules map" if renamed else "stripping the prefix maps"
            raise ValueError(f"{cause} both {key_of[name]!r} and {key!r} to {name!r}")
        key_of[name] = key
    return key_of


def _cast_dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """``wanted`` for a floating-point tensor, the stored dtype for every other one."""
    return wanted if wanted is not None and stored.is_floating_point else stored


def read_json_config(path: str) -> str:
    """The text of a JSON object file (a model's ``config.json``), checked."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        doc = json.loads(text)
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"config {path} holds a JSON {type(doc).__name__}, not an object")
    return text


def _stale_files(
    dst_dir: str, *, kind: str, wanted: Callable[[str], bool], overwrite: bool, keep: Set[str] = frozenset()
) -> list[str]:
    """Names in ``dst_dir`` that an export of ``kind`` files must remove before it
    writes (``keep`` excepted): those ``wanted`` picks, regular files or links, never
    followed. FileExistsError when ``dst_dir`` is not empty and not ``overwrite``, or
    is not a directory. Nothing is removed here: the caller does, once it knows the
    export can be written."""
    try:
        entries = list(os.scandir(dst_dir))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise FileExistsError(f"{dst_dir} exists and is not a directory") from None
    if entries and not overwrite:
        shown = ", ".join(sorted(e.name for e in entries)[:5])
        raise FileExistsError(
            f"{dst_dir} is not empty ({shown}{', ...' if len(entries) > 5 else ''}); choose an empty directory, "
            f"or pass overwrite=True (--overwrite) to replace the {kind} files in it"
        )
    return sorted(
        e.name
        for e in entries
        if wanted(e.name) and e.name not in keep and (e.is_symlink() or e.is_file(follow_symlinks=False))
    )


# -- bcp -> torch.save ---------------------------------------------------------------------------


def _file_backed(scratch: str, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory is a file in ``scratch`` (mmap, shared)."""
    nbytes = max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
    path = os.path.join(scratch, f"{len(os.listdir(scratch)):08d}-{abs(hash(name)) % 10**8}.bin")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    strides = torch.empty(shape, device="meta").stride()
    # torch's stubs type from_file's result as _StorageBase | TypedStorage; it is an UntypedStorage
    return torch.empty(0, dtype=dtype).set_(storage, 0, torch.Size(shape), strides)  # type: ignore[arg-type]


def to_torch(
    src: str | CheckpointReader,
    dst_file: str,
    *,
    prefix: str | None = None,
    strip_prefix: bool = False,
    scratch_dir: str | None = None,
    progress: Progress | None = None,
    per_rank: PerRankChoice = "all",
) -> None:
    """One ``torch.save`` file with the checkpoint's nesting (or a flat dict of the
    selected keys when ``prefix`` is given) and its objects, loadable with
    ``torch.load(weights_only=True)``. An object saved per rank is written as
    ``{"__rank_0__": value of rank 0, "__rank_1__": ...}`` (``per_rank="all"``), or as
    one saved rank's value (``per_rank=R``): see :func:`export_object`."""
    check_per_rank_choice(per_rank)
    reader = src if isinstance(src, CheckpointReader) else open_checkpoint(src)
    scratch = tempfile.mkdtemp(prefix="bcp-convert-", dir=scratch_dir or os.path.dirname(os.path.abspath(dst_file)))
    try:
        if prefix:
            chosen = select(reader.keys(), prefix, strip_prefix)
            values = _read_file_backed(reader, [key for key, _name in chosen], scratch, progress, per_rank)
            out: Any = {name: values[key] for key, name in chosen}
        else:
            values = _read_file_backed(reader, reader.keys(), scratch, progress, per_rank)
            out = build_nested((reader.key_path(k), values[k]) for k in reader.keys())
        tmp = dst_file + ".partial"
        torch.save(out, tmp)
        _publish(tmp, dst_file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


#: Tensors are read into their scratch files in batches of about this many bytes (one
#: fill each, so runs that follow each other in a data file coalesce into large reads).
FILE_BACKED_BATCH_BYTES = 1 << 30


def _read_file_backed(
    reader: CheckpointReader, keys: list[str], scratch: str, progress: Progress | None, per_rank: PerRankChoice
) -> dict:
    """key -> value: tensors in file-backed memory, objects decoded (per-rank ones as
    :func:`export_object` writes them)."""
    out: dict[str, Any] = {}
    batch: list[tuple[str, Box, torch.Tensor]] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if batch:
            reader.fill(batch)
            if progress:
                progress(held)
        batch.clear()
        held = 0

    for key in keys:
        if key not in reader.catalog.tensors:
            out[key] = export_object(reader, key, per_rank)
            continue
        meta = reader.meta(key)
        box = ((0,) * len(meta.shape), tuple(meta.shape))
        # the data files hold what the manifest declares, before a scratch file that size is made
        reader.check_sizes([(key, box)])
        out[key] = _file_backed(scratch, key, meta.shape, meta.dtype)
        batch.append((key, box, out[key]))
        held += meta.nbytes
        if held >= FILE_BACKED_BATCH_BYTES:
            flush()
    flush()
    return out


# -- bcp -> DCP ----------------------------------------------------------------------------------


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

    from .dcp_metadata import METADATA_FILE, BatchedFileSystemWriter, StreamingSavePlanner, conversion_error

    check_per_rank_choice(per_rank)
    reader = src if isinstance(src, CheckpointReader) else open_checkpoint(src)
    keys = [key for key, _name in select(reader.keys(), prefix, strip=False)]
    if not keys:
        raise ValueError(f"no entries under prefix {prefix!r} in {reader.uri}")
    stale = _stale_files(
        dst_dir, kind="DCP", wanted=lambda name: name == METADATA_FILE or name.endswith(".distcp"), overwrite=overwrite
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
        _publish_dir(staging, dst_dir, stale, last=METADATA_FILE)
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


def _publish_dir(staging: str, dst_dir: str, stale: list[str], *, last: str) -> None:
    """Move every file of ``staging`` into ``dst_dir`` and remove the ``stale`` ones:
    the old ``last`` (the index) first, so that no index names a mix of old and new
    files, the new one at the end, so that it names only files in place."""
    written = sorted(os.listdir(staging))
    if last in stale:
        os.remove(os.path.join(dst_dir, last))
    for name in written:
        if name != last:
            _publish(os.path.join(staging, name), os.path.join(dst_dir, name))
    for name in stale:
        if name != last and name not in written:
            os.remove(os.path.join(dst_dir, name))
    if last in written:
        _publish(os.path.join(staging, last), os.path.join(dst_dir, last))


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


def safetensors_files(src: str) -> list[str]:
    """The shard files of a safetensors checkpoint: a file, or a directory with an
    index (or a single ``*.safetensors``)."""
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(src, name) for name in files]
    found = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors files in {src}")
    return [os.path.join(src, n) for n in found]


def map_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private memory map: nothing
    is read until used. (The format is an 8-byte header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the data.)"""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which bcp does not know")
        lo, hi = info["data_offsets"]
        if hi - lo == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        out[name] = flat.view(dtype).reshape(info["shape"])
    return out


def from_safetensors(
    src: str, dst: str, *, prefix: str = "", overwrite: bool = False, storage_options: dict | None = None
) -> SaveInfo:
    """Save every tensor of a safetensors checkpoint into bcp as flat keys (``prefix`` prepended)."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(src):
        for name, t in map_safetensors(path).items():
            state[prefix + name] = t
    return save(state, dst, overwrite=overwrite, storage_options=storage_options)


def from_torch(src: str, dst: str, *, overwrite: bool = False, storage_options: dict | None = None) -> SaveInfo:
    """A ``torch.save`` file into bcp, memory-mapped; loaded with ``weights_only=True``."""
    try:
        state = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        log.warning("%s is in torch's legacy format and cannot be memory-mapped: loading it whole", src)
        state = torch.load(src, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        state = {"state": state}
    return save(state, dst, overwrite=overwrite, storage_options=storage_options)


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

    from .dcp_metadata import METADATA_FILE, DCPReader, SafeBytesPlanner, conversion_error, key_paths, read_metadata

    metadata = read_metadata(src, allow_pickle=allow_pickle)
    paths = key_paths(metadata, where=os.path.join(src, METADATA_FILE))
    _check_nesting(paths, where=src)  # from .metadata alone: a bad one fails before anything is loaded
    reader = DCPReader(src, metadata)
    planner = SafeBytesPlanner(allow_pickle=allow_pickle)
    scratch = tempfile.mkdtemp(prefix="bcp-convert-", dir=scratch_dir)
    try:
        state: dict[str, Any] = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                state[fqn] = _file_backed(scratch, fqn, meta.size, meta.properties.dtype)
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


def detect_format(src: str) -> str:
    """``bcp``, ``safetensors``, ``dcp`` or ``torch`` for a local source; bcp for URIs."""
    if "://" in src and not src.startswith("file://"):
        return "bcp"
    path = src.removeprefix("file://")
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if MANIFEST_KEY in names:
            return "bcp"
        if ".metadata" in names:  # dcp_metadata.METADATA_FILE (not imported: it loads DCP)
            return "dcp"
        if INDEX_NAME in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise ValueError(f"cannot tell the format of directory {src}")
    if path.endswith(".safetensors"):
        return "safetensors"
    return "torch"
