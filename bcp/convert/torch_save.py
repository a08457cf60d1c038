"""bcp <-> one ``torch.save`` file.

* Out: each tensor is read into a file-backed (mmap) buffer in a scratch directory,
  so ``torch.save`` streams from the page cache; the file keeps the saved nesting and
  the checkpoint's (safe) objects.
* In: ``torch.load(mmap=True, weights_only=True)``: nothing is unpickled beyond
  tensors and plain values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import zipfile
from typing import Any

import torch

from bcp.convert.files import file_backed, publish
from bcp.convert.per_rank import export_object
from bcp.convert.pickle_check import check_archive
from bcp.convert.selection import Progress, select
from bcp.errors import FormatError
from bcp.metadata.geometry import Box
from bcp.reader import CheckpointReader, PerRankChoice, check_per_rank_choice, open_checkpoint
from bcp.saver import SaveInfo, save
from bcp.state import build_nested

log = logging.getLogger(__name__)

#: Tensors are read into their scratch files in batches of about this many bytes (one
#: fill each, so runs that follow each other in a data file coalesce into large reads).
FILE_BACKED_BATCH_BYTES = 1 << 30


def to_torch(
    src: str | CheckpointReader,
    dst_file: str,
    *,
    prefix: str | None = None,
    strip_prefix: bool = False,
    scratch_dir: str | None = None,
    progress: Progress | None = None,
    per_rank: PerRankChoice = "all",
    overwrite: bool = False,
) -> None:
    """One ``torch.save`` file with the checkpoint's nesting (or a flat dict of the
    selected keys when ``prefix`` is given) and its objects, loadable with
    ``torch.load(weights_only=True)``. An object saved per rank is written as
    ``{"__rank_0__": value of rank 0, "__rank_1__": ...}`` (``per_rank="all"``), or as
    one saved rank's value (``per_rank=R``): see :func:`~bcp.convert.per_rank.export_object`.
    An existing ``dst_file`` is replaced only with ``overwrite`` (never a directory); a
    failed write leaves nothing beside it."""
    if os.path.isdir(dst_file) or (os.path.lexists(dst_file) and not overwrite):
        what = "a directory" if os.path.isdir(dst_file) else "exists (pass overwrite=True, --overwrite, to replace it)"
        raise FileExistsError(f"{dst_file}: {what}")
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
        try:
            torch.save(out, tmp)
        except Exception as e:  # torch's own message names no file ("enforce fail ... unexpected pos")
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise OSError(f"writing {dst_file}: {e}") from e
        publish(tmp, dst_file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read_file_backed(
    reader: CheckpointReader, keys: list[str], scratch: str, progress: Progress | None, per_rank: PerRankChoice
) -> dict:
    """key -> value: tensors in file-backed memory, objects decoded (per-rank ones as
    :func:`~bcp.convert.per_rank.export_object` writes them)."""
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
        out[key] = file_backed(scratch, key, meta.shape, meta.dtype)
        batch.append((key, box, out[key]))
        held += meta.nbytes
        if held >= FILE_BACKED_BATCH_BYTES:
            flush()
    flush()
    return out


def _torch_load(src: str, *, allow_pickle: bool = False, **kwargs: Any) -> Any:
    """``torch.load(src, weights_only=not allow_pickle)``; what it refuses, a FormatError naming the file."""
    try:
        return torch.load(src, map_location="cpu", weights_only=not allow_pickle, **kwargs)
    except pickle.UnpicklingError as e:
        raise FormatError(
            f"{src}: holds what torch's weights-only loader refuses (bcp unpickles a torch.save file fully only "
            f"with allow_pickle / --allow-pickle: that runs code from it): {_first_line(e)}"
        ) from None
    # what a crafted data.pkl makes torch's allowed rebuild functions raise, too (TypeError: wrong arguments)
    except (RuntimeError, ValueError, EOFError, KeyError, TypeError, AttributeError, IndexError, OverflowError,
            zipfile.BadZipFile) as e:  # fmt: skip
        if kwargs.get("mmap") and "mmap" in str(e):
            raise  # the legacy format: loaded whole instead (from_torch)
        raise FormatError(f"{src}: not a torch.save file bcp can read: {type(e).__name__}: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    """The line of torch's message that names the cause (its weights-only refusal runs to a
    page of advice around ``WeightsUnpickler error: Unsupported global: ...``), else its first."""
    lines = str(error).strip().splitlines()
    named = [line.strip() for line in lines if "WeightsUnpickler error" in line or "Unsupported global" in line]
    return named[0] if named else lines[0] if lines else type(error).__name__


def from_torch(
    src: str, dst: str, *, overwrite: bool = False, storage_options: dict | None = None, allow_pickle: bool = False
) -> SaveInfo:
    """A ``torch.save`` file into bcp, memory-mapped; loaded with ``weights_only=True``
    after its zip entries are checked (:func:`check_archive`). ``allow_pickle``: loaded
    fully (``weights_only=False``: runs code from the file; numpy arrays such as a
    TrainingState's RNG states need it), and its objects stored by pickle where needed."""
    check_archive(src)
    try:
        state = _torch_load(src, allow_pickle=allow_pickle, mmap=True)
    except RuntimeError:  # only the legacy format's "cannot mmap" comes back as is
        log.warning("%s is in torch's legacy format and cannot be memory-mapped: loading it whole", src)
        state = _torch_load(src, allow_pickle=allow_pickle)
    if not isinstance(state, dict):
        state = {"state": state}
    return save(state, dst, overwrite=overwrite, storage_options=storage_options, allow_pickle=allow_pickle)
