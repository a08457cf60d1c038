"""Where each object of a checkpoint lives: the key layout (FORMAT.md, top and "Commit").

Every key bcp writes or looks for is built here, so the layout is written down
once and readers, writers, housekeeping and tests agree on it::

    <checkpoint>/manifest.json                      the commit record
    <checkpoint>/gen-<save id>/fragments.arrow      the catalog of one save
    <checkpoint>/gen-<save id>/data/rank<r>-<n>.bin tensor bytes written by rank r

A root managed by ``CheckpointManager`` holds one checkpoint per step::

    <root>/step_<step, 10 digits>/...               a checkpoint, as above
    <root>/latest.json                              for people and tools only
"""

from __future__ import annotations

import re

#: The commit record of a checkpoint (``manifest.py`` reads and writes it).
MANIFEST_KEY = "manifest.json"
GENERATION_PREFIX = "gen-"
CATALOG_NAME = "fragments.arrow"
#: Written after each manager commit; bcp itself trusts only manifests.
LATEST_KEY = "latest.json"
STEP_PREFIX = "step_"
_STEP_RE = re.compile(r"^step_(\d+)/")


#: A generation's name: ``gen-`` and a save id, lowercase hex digits (FORMAT.md). A
#: ``gen-mine/`` of a user's is not bcp's, and housekeeping and ``bcp rm`` leave it.
GENERATION_RE = re.compile(r"gen-[0-9a-f]+")


def is_generation(name: str) -> bool:
    """Whether ``name`` (one path segment) is a bcp generation's name."""
    return GENERATION_RE.fullmatch(name) is not None


def generation_name(save_id: str) -> str:
    """The prefix (without its slash) under which one save writes all its objects."""
    return f"{GENERATION_PREFIX}{save_id}"


#: What a data file's name (after ``<generation>/data/``) may be: one path segment,
#: so a manifest cannot name an object outside its generation.
DATA_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def catalog_key(generation: str) -> str:
    return f"{generation}/{CATALOG_NAME}"


def data_file_key(generation: str, rank: int, part: int = 0) -> str:
    """The data file rank ``rank`` writes in ``generation`` (one per rank today)."""
    return f"{generation}/data/rank{rank:05d}-{part}.bin"


def generation_of(key: str) -> str | None:
    """The generation a key (relative to its checkpoint) belongs to, or None."""
    head = key.split("/", 1)[0]
    return head if is_generation(head) and "/" in key else None


def manifest_key(prefix: str = "") -> str:
    """``manifest.json`` of the checkpoint under ``prefix`` (``""`` or ending in ``/``)."""
    return f"{prefix}{MANIFEST_KEY}"


def step_name(step: int) -> str:
    """The directory of ``step`` under a manager's root (sorts by step as text)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:010d}"


def step_of(key: str) -> int | None:
    """The step a key under a manager's root belongs to, or None."""
    m = _STEP_RE.match(key)
    return int(m.group(1)) if m else None
