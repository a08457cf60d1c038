"""A checkpoint's description of itself, from its manifest and catalog: what
``bcp inspect`` shows (and prints as JSON), for any tool that wants the same.

Nothing is unpickled (pickled objects are described by their error), and one tensor
whose catalog rows are bad does not hide the others: its entry carries the error.
"""

from __future__ import annotations

import logging
from typing import Any

from bcp.errors import CheckpointError
from bcp.reader import CheckpointReader

log = logging.getLogger(__name__)

#: An object's ``repr`` is cut to this many characters.
OBJECT_REPR_CHARS = 120


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """The checkpoint as a JSON-ready dict: the manifest's fields (``uri``,
    ``save_id``, ``created``, ``world_size``, the versions, ``stats``,
    ``user_metadata``, the number of ``data_files``), ``tensors`` (a list of
    ``{fqn, shape, dtype, fragments, bytes}``, or ``{fqn, error}`` for a tensor whose
    catalog rows cannot be read, the error as one line) and ``objects`` (fqn -> the
    value's ``repr``, cut at :data:`OBJECT_REPR_CHARS`; ``<per rank: N>`` for one saved
    per rank, ``<error>`` for one that cannot be read, a pickled one among them).
    ``references`` lists the data files of sibling checkpoints an incremental
    checkpoint reads (``{path, checkpoint, bytes}``, ``checkpoint`` the owner); when
    there are any, each tensor also says how many of its ``fragments`` lie in them
    (``referenced``).

    ``created``, the versions, ``stats`` and ``user_metadata`` are informative
    (FORMAT.md): they are what the manifest holds, checked only for their JSON types."""
    m = reader.manifest
    referenced = {f.path for f in m.references}
    tensors: list[dict[str, Any]] = []
    for fqn in reader.tensor_keys():
        try:
            meta = reader.meta(fqn)
        except CheckpointError as e:
            log.debug("tensor %r of %s is unreadable", fqn, reader.uri, exc_info=True)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            tensors.append({"fqn": fqn, "error": " | ".join(lines) or type(e).__name__})
            continue
        row: dict[str, Any] = {
            "fqn": fqn,
            "shape": list(meta.shape),
            "dtype": str(meta.dtype).removeprefix("torch."),
            "fragments": meta.entry.num_fragments,
            "bytes": meta.nbytes,
        }
        if referenced:
            names = meta.entry.file_names
            row["referenced"] = sum(names[c] in referenced for c in meta.entry.files.tolist())
        tensors.append(row)
    objects = {}
    for fqn in reader.object_keys():
        per_rank = reader.is_per_rank(fqn)
        try:
            value = reader.read_object(fqn) if not per_rank else f"<per rank: {len(reader.per_rank_objects(fqn))}>"
            text = repr(value)
        except CheckpointError as e:
            text = f"<{e}>"
        except Exception as e:
            log.debug("object %r of %s cannot be shown", fqn, reader.uri, exc_info=True)
            text = f"<object {fqn!r} cannot be shown: {type(e).__name__}: {e}>"
        cut = OBJECT_REPR_CHARS
        objects[fqn] = text if len(text) <= cut else text[: cut - 3] + "..."
    return {
        "uri": reader.uri,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "bcp_version": m.bcp_version,
        "format_version": m.version,
        "torch_version": m.torch_version,
        "stats": m.stats,
        "user_metadata": m.user_metadata,
        "data_files": len(m.data_files),
        "references": [{"path": f.path, "checkpoint": f.checkpoint, "bytes": f.nbytes} for f in m.references],
        "tensors": tensors,
        "objects": objects,
    }
