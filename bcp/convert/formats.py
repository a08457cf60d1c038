"""Telling the formats apart: the file names that identify each one, and
:func:`detect_format` for ``bcp convert``'s source. Imports no format's library, so
that the names are cheap to use (DCP's modules load ``torch.distributed``)."""

from __future__ import annotations

import os

from bcp.metadata import MANIFEST_KEY

#: The index of a sharded safetensors checkpoint (Hugging Face's name).
INDEX_NAME = "model.safetensors.index.json"
#: The file a PyTorch DCP checkpoint is committed by: its (pickled) metadata.
DCP_METADATA_FILE = ".metadata"


def detect_format(src: str) -> str:
    """``bcp``, ``safetensors``, ``dcp`` or ``torch`` for a local source; bcp for URIs."""
    if "://" in src and not src.startswith("file://"):
        return "bcp"
    path = src.removeprefix("file://")
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if MANIFEST_KEY in names:
            return "bcp"
        if DCP_METADATA_FILE in names:
            return "dcp"
        if INDEX_NAME in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise ValueError(f"cannot tell the format of directory {src}")
    if path.endswith(".safetensors"):
        return "safetensors"
    return "torch"
