"""Where each object of a checkpoint lives: the key layout (FORMAT.md, top and "Commit").

Every key bcp writes or looks for is built here, so the layout is written down
once and readers, writers, housekeeping and tests agree on it::

    <checkpoint>/manifest.json                      the commit record
    <checkpoint>/gen-<save id>/fragments.arrow      the catalog of one save
    <checkpoint>/gen-<save id>/data/rank<r>-<n>.bin tensor bytes written by rank r
    <checkpoint>/gen-<save id>/holds/<name>.<id>    empty: checkpoint <name> (save <id>)
                                                    refers to bytes of this generation

An incremental checkpoint (FORMAT.md, "References") reads data files of its
*siblings*, the checkpoints beside it under the same parent URI, at
``<sibling>/gen-<id>/data/<file>`` of the parent (:func:`split_parent`,
:func:`reference_key`).

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


#: A sibling checkpoint's name (FORMAT.md, "References"): one path segment, never
#: ``.`` or ``..`` (a name cannot start with a dot), so a reference never leaves the parent.
SIBLING_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
HOLDS_DIR = "holds"
_SAVE_ID_RE = re.compile(r"[0-9a-f]+")
#: ``scheme://authority`` of a URI (the rest is its path), as backends split them.
_URI_HEAD_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?]*")


def is_sibling_name(name: str) -> bool:
    """Whether ``name`` may name a sibling checkpoint (and a referrer in a hold's name)."""
    return SIBLING_NAME_RE.fullmatch(name) is not None


def holds_prefix(generation: str) -> str:
    """Where the holds on ``generation`` live, relative to its checkpoint (ends in ``/``)."""
    return f"{generation}/{HOLDS_DIR}/"


def hold_key(generation: str, referrer: str, save_id: str) -> str:
    """The hold checkpoint ``referrer`` (save ``save_id``) puts on ``generation`` of the
    checkpoint that owns the bytes, relative to that owner: ``gen-<id>/holds/<referrer>.<save_id>``.
    ValueError for a name that would not parse back (:func:`parse_hold_key`)."""
    if not is_generation(generation):
        raise ValueError(f"hold: {generation!r} is not a generation name (gen-<lowercase hex>)")
    if not is_sibling_name(referrer):
        raise ValueError(f"hold: referrer {referrer!r} is not a checkpoint name ([A-Za-z0-9_][A-Za-z0-9._-]*)")
    if not _SAVE_ID_RE.fullmatch(save_id):
        raise ValueError(f"hold: save id {save_id!r} is not lowercase hex digits")
    return f"{holds_prefix(generation)}{referrer}.{save_id}"


def parse_hold_key(key: str) -> tuple[str, str, str] | None:
    """``(generation, referrer, save_id)`` of a hold's key relative to its owner
    checkpoint (:func:`hold_key`'s inverse), or None for any other key. The referrer
    may hold dots: the save id is what follows the last one."""
    generation, sep, rest = key.partition("/")
    if not sep or not is_generation(generation) or not rest.startswith(f"{HOLDS_DIR}/"):
        return None
    name = rest[len(HOLDS_DIR) + 1 :]
    referrer, dot, save_id = name.rpartition(".")
    if not dot or not is_sibling_name(referrer) or not _SAVE_ID_RE.fullmatch(save_id):
        return None
    return generation, referrer, save_id


def reference_key(checkpoint: str, path: str) -> str:
    """Key, relative to the parent, of data file ``path`` (``gen-<id>/data/NAME``) of
    sibling ``checkpoint``. ValueError unless both are as FORMAT.md allows (the manifest
    reader has checked them already: this is the last guard before a read)."""
    generation, sep, rest = path.partition("/")
    data, sep2, name = rest.partition("/")
    if not (
        is_sibling_name(checkpoint)
        and sep
        and sep2
        and is_generation(generation)
        and data == "data"
        and DATA_FILE_NAME_RE.fullmatch(name)
    ):
        raise ValueError(f"reference {checkpoint!r}/{path!r} is not <sibling>/gen-<id>/data/<file>")
    return f"{checkpoint}/{path}"


def split_parent(uri: str) -> tuple[str, str]:
    """``(parent URI, last segment)`` of a checkpoint's URI or path: the inverse of
    joining a name below the parent (``s3://b/run/step_1?region=x`` gives
    ``("s3://b/run?region=x", "step_1")``; ``ckpt`` gives ``(".", "ckpt")``; ``/ckpt``
    gives ``("/", "ckpt")``). Trailing slashes are ignored; the query string stays with
    the parent. ValueError for a URI with no last segment (``s3://bucket``, ``/``) or
    one that is ``.`` or ``..``. The name is not checked against SIBLING_NAME_RE
    (:func:`is_sibling_name` does that where a name must be one)."""
    base, sep, query = uri.partition("?")
    m = _URI_HEAD_RE.match(base)
    if m is not None:
        head, path = m.group(0), base[m.end() :]
    elif base[:5].lower() == "file:":
        head, path = base[:5], base[5:]
    else:
        head, path = "", base
    parent_path, slash, name = path.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise ValueError(f"{uri!r} has no parent: its last path segment {name!r} does not name a checkpoint")
    if slash:
        authority = m is not None and len(head) > head.index("://") + 3  # s3://bucket: its root is the bucket
        parent = head + (parent_path or ("" if authority else "/"))
    else:  # a relative path of one segment
        parent = head + "."
    return parent + sep + query, name


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
    """The step a key under a manager's root belongs to, or None: only under a name the
    manager writes (:func:`step_name`; a user's ``step_1000/`` is not one of its steps)."""
    m = _STEP_RE.match(key)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == f"{STEP_PREFIX}{m.group(1)}" else None
