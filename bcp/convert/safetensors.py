"""bcp <-> safetensors, the Hugging Face format.

* Out: size-capped shards (``model-00001-of-00003.safetensors``) plus
  ``model.safetensors.index.json`` (one ``model.safetensors`` when everything fits one
  shard), with optional renaming rules, a floating-point dtype cast and a copied
  ``config.json``. Memory: one shard.
* In: the files are memory-mapped and their tensors saved without being copied into
  memory first.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import mmap
import os
import re
from collections.abc import Sequence
from typing import BinaryIO

import torch

from bcp.convert.files import open_regular, publish, stale_files
from bcp.convert.formats import INDEX_NAME
from bcp.convert.selection import (
    Progress,
    RenameRule,
    apply_renames,
    cast_dtype,
    output_names,
    parse_rename,
    plan_shards,
    select,
)
from bcp.errors import FormatError
from bcp.extras import needs_extra
from bcp.metadata.ties import first_of_each
from bcp.reader import CheckpointReader, open_checkpoint
from bcp.saver import SaveInfo, save

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
CONFIG_NAME = "config.json"


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
    :func:`~bcp.convert.selection.parse_rename`) applied in order with ``re.sub``; two
    keys that end with one name are a ValueError naming both. ``dtype`` casts the
    floating-point tensors (only those), shard by shard. ``config`` is a JSON file (a
    Hugging Face ``config.json``) checked and copied into ``dst_dir`` as
    ``config.json``, so that ``from_pretrained(dst_dir)`` finds it. Memory: one shard
    (plus one tensor cast).

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
        where = f"under prefix {prefix!r} " if prefix else ""
        raise ValueError(f"no tensors {where}in {reader.uri}: a safetensors file holds tensors only")
    rules = [parse_rename(rule) if isinstance(rule, str) else rule for rule in rename]
    key_of = output_names([(key, apply_renames(name, rules)) for key, name in chosen], renamed=bool(rules))
    names = list(key_of)
    out_dtype = {name: cast_dtype(reader.meta(key).dtype, dtype) for name, key in key_of.items()}
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
    stale = stale_files(
        dst_dir,
        kind="safetensors",
        wanted=lambda name: name == INDEX_NAME or name.endswith(".safetensors"),
        overwrite=overwrite,
        keep=set(files),
    )
    os.makedirs(dst_dir, exist_ok=True)
    weight_map, total = {}, 0
    written: list[str] = []  # every shard is written beside the old export before any replaces a file of it
    try:
        for file, shard in zip(files, shards, strict=True):
            read = reader.read_tensors([key_of[name] for name in shard])  # one batch: contiguous runs coalesce
            tensors = {name: read.pop(key_of[name]).to(out_dtype[name]) for name in shard}
            for name in tensors.keys() - first_of_each(tensors).keys():  # tied: safetensors stores no shared memory
                tensors[name] = tensors[name].clone()
            del read
            for name in shard:
                total += tensors[name].numel() * tensors[name].element_size()
                weight_map[name] = file
            written.append(file)
            save_file(tensors, os.path.join(dst_dir, f".{file}.partial"), metadata={"format": "pt"})
            if progress:
                progress(sum(reader.meta(key_of[name]).nbytes for name in shard))  # stored bytes, as the total counts
            del tensors
    except BaseException:  # nothing published: an export --overwrite replaces is as it was
        for file in written:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(dst_dir, f".{file}.partial"))
        raise
    if INDEX_NAME in stale:  # first: while shards are replaced, no index names a mix of old and new
        os.remove(os.path.join(dst_dir, INDEX_NAME))
    for file in written:
        publish(os.path.join(dst_dir, f".{file}.partial"), os.path.join(dst_dir, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(shards) > 1:
        tmp = os.path.join(dst_dir, f".{INDEX_NAME}.partial")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        publish(tmp, os.path.join(dst_dir, INDEX_NAME))
    for name in stale:
        if name != INDEX_NAME:
            log.info("removing %s from %s: the new export does not write it", name, dst_dir)
            os.remove(os.path.join(dst_dir, name))
    if config_text is not None:
        tmp = os.path.join(dst_dir, f".{CONFIG_NAME}.partial")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(config_text)
        publish(tmp, os.path.join(dst_dir, CONFIG_NAME))
    return index


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


# -- into bcp ------------------------------------------------------------------------------------


def safetensors_files(src: str) -> list[str]:
    """The shard files of a safetensors checkpoint: a file, or a directory with an
    index (or a single ``*.safetensors``). The index names files in the directory
    itself: a path out of it (``../x``, ``/x``) is a FormatError."""
    if os.path.isfile(src):
        return [src]
    weight_map = index_weight_map(src)
    if weight_map is not None:
        return [os.path.join(src, name) for name in sorted(set(weight_map.values()))]
    found = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors files in {src}")
    if any(_SHARD_NAME.search(n) for n in found):
        raise FormatError(f"{src}: holds shards ({found[0]}, ...) but no {INDEX_NAME}: an export cut short?")
    return [os.path.join(src, n) for n in found]


def index_weight_map(src: str) -> dict[str, str] | None:
    """The index's tensor name -> shard file of a safetensors directory ``src`` (None
    without one): every file in ``src`` itself (``../x``, ``/x``: FormatError)."""
    index = os.path.join(src, INDEX_NAME)
    if not os.path.isdir(src) or not os.path.exists(index):
        return None
    try:
        with open_regular(index) as f:  # a link (a hub cache's) followed; a FIFO refused, not waited on
            weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        files = set(weight_map.values())
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise FormatError(f"{index}: weight_map names {name!r}, not a file in {src}")
    return weight_map


#: a shard of a sharded export (``model-00001-of-00002.safetensors``): only read through its index
_SHARD_NAME = re.compile(r"-\d+-of-\d+\.safetensors$")

#: the largest header read (the safetensors library's own limit is 100 MB)
MAX_HEADER_BYTES = 100 << 20


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object without repeated keys (json.loads keeps the last; safetensors refuses them)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def read_header(path: str, f: BinaryIO, size: int) -> tuple[int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """(where the data starts, {name: (dtype, shape, start, end)}) of an open safetensors
    file of ``size`` bytes, every field checked before anything is allocated: the header
    inside the file, a JSON object without repeated keys, each tensor's bytes inside the
    data, exactly its shape's, apart from every other tensor's. FormatError otherwise,
    naming the file and the tensor."""
    head = f.read(8)
    header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < header_len <= min(size - 8, MAX_HEADER_BYTES):
        raise FormatError(f"{path}: a safetensors header of {header_len} bytes does not fit its {size}-byte file")
    try:
        header = json.loads(f.read(header_len), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise FormatError(f"{path}: the safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    data, out = size - 8 - header_len, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise FormatError(f"{where} is described by a JSON {type(info).__name__}, not an object")
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise FormatError(f"{where} has dtype {info.get('dtype')!r}, which bcp does not know")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (
            not isinstance(shape, list)
            or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
            or math.prod(d for d in shape if d) >= 2**63  # an empty tensor's strides too
        ):
            raise FormatError(f"{where} has shape {shape!r}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise FormatError(f"{where} has data_offsets {offsets!r}, not [start, end]")
        lo, hi = offsets
        if not 0 <= lo <= hi <= data:
            raise FormatError(f"{where} has data_offsets [{lo}, {hi}] outside the file's {data} data bytes")
        if hi - lo != math.prod(shape) * dtype.itemsize:
            raise FormatError(
                f"{where} has {hi - lo} bytes at data_offsets [{lo}, {hi}]; its shape {shape} needs "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        out[name] = (dtype, shape, lo, hi)
    spans = sorted((lo, hi, name) for name, (_d, _s, lo, hi) in out.items() if hi > lo)
    for (_lo, end, first), (lo, _hi, second) in itertools.pairwise(spans):
        if lo < end:
            raise FormatError(f"{path}: tensors {first!r} and {second!r} share bytes at data offset {lo}")
    return 8 + header_len, out


def map_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private memory map: nothing
    is read until used. (The format is an 8-byte header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the data.)"""
    with open_regular(path) as f:
        start, header = read_header(path, f, os.fstat(f.fileno()).st_size)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out = {}
    for name, (dtype, shape, lo, hi) in header.items():
        if hi == lo:  # no element: nothing to read
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def from_safetensors(
    src: str, dst: str, *, prefix: str = "", overwrite: bool = False, storage_options: dict | None = None
) -> SaveInfo:
    """Save every tensor of a safetensors checkpoint into bcp as flat keys (``prefix`` prepended)."""
    state: dict[str, torch.Tensor] = {}
    weight_map, index = index_weight_map(src), os.path.join(src, INDEX_NAME)
    for path in safetensors_files(src):
        for name, t in map_safetensors(path).items():
            if prefix + name in state:
                raise FormatError(f"{path}: tensor {name!r} is in another shard too")
            if weight_map is not None and weight_map.get(name) != os.path.basename(path):
                raise FormatError(f"{index} puts {name!r} in {weight_map.get(name)!r}, but {path} holds it")
            state[prefix + name] = t
    if weight_map is not None and len(state) != len(weight_map):  # each held name is in it: the rest are not held
        unheld = [name for name in weight_map if prefix + name not in state]
        raise FormatError(f"{index} names tensors no shard holds: {', '.join(map(repr, unheld[:5]))}")
    return save(state, dst, overwrite=overwrite, storage_options=storage_options)
