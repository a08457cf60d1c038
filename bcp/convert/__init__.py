"""Conversion between bcp and the formats people use, tensor by tensor: the public
entry (``bcp.convert.to_safetensors(...)``, ``bcp convert`` on the command line).

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
* bcp -> PyTorch DCP: written by DCP's own writer and planner, the tensors read from
  bcp in bounded batches only when the writer asks for them. Memory: one batch.
* PyTorch DCP checkpoint -> bcp: every tensor is loaded by DCP into a file-backed
  buffer, then saved with the nesting DCP recorded rebuilt; DCP's pickles are read
  with an allow-list (:mod:`bcp.convert.dcp_metadata`) unless ``allow_pickle=True``.

Objects saved per rank keep every rank's value in the torch and DCP exports, under
``__rank_<r>__`` keys (:func:`export_object`), unless one saved rank is chosen. DCP's
own failures are raised as a one-line :class:`~bcp.errors.ConversionError`.

Memory stays bounded by the shard size (safetensors out) or is file-backed page
cache, which the kernel can reclaim (everything else), so a checkpoint larger than
RAM converts.

This package holds the formats, one module per format and job (the frameworks are
:mod:`bcp.integrations`); this module only names their public functions, and imports
neither safetensors nor ``torch.distributed.checkpoint`` until a conversion needs
them. Its modules, one line each, are in docs/architecture.md.
"""

from __future__ import annotations

from bcp.convert.dcp_format import DCP_BATCH_BYTES, DCPExportInfo, from_dcp, to_dcp
from bcp.convert.formats import INDEX_NAME, detect_format
from bcp.convert.per_rank import RANK_KEY, export_object, per_rank_keys, rank_key
from bcp.convert.safetensors import (
    CONFIG_NAME,
    SAFETENSORS_DTYPES,
    from_safetensors,
    map_safetensors,
    read_json_config,
    safetensors_files,
    to_safetensors,
)
from bcp.convert.selection import (
    DTYPE_NAMES,
    Progress,
    RenameRule,
    apply_renames,
    parse_dtype,
    parse_rename,
    plan_shards,
    select,
)
from bcp.convert.torch_save import FILE_BACKED_BATCH_BYTES, from_torch, to_torch

__all__ = [
    "CONFIG_NAME",
    "DCP_BATCH_BYTES",
    "DTYPE_NAMES",
    "FILE_BACKED_BATCH_BYTES",
    "INDEX_NAME",
    "RANK_KEY",
    "SAFETENSORS_DTYPES",
    "DCPExportInfo",
    "Progress",
    "RenameRule",
    "apply_renames",
    "detect_format",
    "export_object",
    "from_dcp",
    "from_safetensors",
    "from_torch",
    "map_safetensors",
    "parse_dtype",
    "parse_rename",
    "per_rank_keys",
    "plan_shards",
    "rank_key",
    "read_json_config",
    "safetensors_files",
    "select",
    "to_dcp",
    "to_safetensors",
    "to_torch",
]
