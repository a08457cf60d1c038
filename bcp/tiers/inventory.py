"""What one host's local tier can serve, and which local step a recovery uses
(docs/tiers.md, "Files on one host" and "Recovering", steps 1-2).

Pure file-system reads and pure decisions: no collectives. A host's first rank runs
:func:`list_local` on its local root; the coordinator runs :func:`choose_local` on
every host's listing and :func:`local_wins` against the persistent tier's newest step.

A host's copy of a step counts only through what it has checked: its manifest (which
carries its own CRC32C) and the data files listed in ``holding.json``, each found
with the manifest's size. Files are named by their index in the manifest's
``data_files``: manifests that agree (same save id and CRC) list the same files in
the same order, so the indices of agreeing hosts can be pooled, and a host's listing
stays a few integers per step however many files the job writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
from collections.abc import Sequence

from bcp.metadata import FileEntry, Manifest
from bcp.metadata.checksum import crc32c
from bcp.metadata.keys import MANIFEST_KEY, step_name, step_of
from bcp.tiers.holding import read_holding
from bcp.tiers.incremental_local import held_size
from bcp.tiers.job import JOB_NAME, read_job
from bcp.tiers.paths import HOLDING_NAME, read_regular

log = logging.getLogger(__name__)

#: Manifests larger than this are not read (a local manifest is a few KiB to MiB).
MAX_MANIFEST_BYTES = 256 << 20
_CRC = re.compile(rb'"manifest_crc32c"[ \t\n\r]*:[ \t\n\r]*"([0-9a-f]{8})"[ \t\n\r]*\}[ \t\n\r]*\Z')


@dataclasses.dataclass(frozen=True)
class StepCopy:
    """One host's copy of one local step: what agrees with other hosts' copies and
    which data files (indices into the manifest's ``data_files``) it can serve."""

    step: int
    save_id: str
    manifest_crc32c: int
    #: how many data files the manifest lists
    n_files: int
    #: indices of the data files held whole and checked, ascending
    held: tuple[int, ...]
    #: the catalog is there with the manifest's size: this host can serve the metadata
    has_catalog: bool


@dataclasses.dataclass(frozen=True)
class LocalChoice:
    """The local step a recovery uses: which copies agree, and who holds each file."""

    step: int
    save_id: str
    manifest_crc32c: int
    #: per data file (manifest order): the hosts (indices into the listings) holding it
    holders: tuple[tuple[int, ...], ...]
    #: the host whose first rank sends the manifest and the catalog
    source: int


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_<10 digits>`` directory under ``root`` (not links),
    newest first."""
    out: list[tuple[int, str]] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        step = step_of(entry.name + "/")
        if step is None or entry.name != step_name(step) or not entry.is_dir(follow_symlinks=False):
            continue
        out.append((step, entry.path))
    out.sort(reverse=True)
    return out


def manifest_crc(data: bytes) -> int:
    """The manifest's own ``manifest_crc32c`` (FORMAT.md), or for a version 1 manifest
    without one the CRC32C of its bytes: equal values mean the same manifest."""
    found = _CRC.search(data)
    return int(found.group(1), 16) if found else crc32c(data)


def read_step(step: int, path: str, job: str | None = None) -> StepCopy | None:
    """This host's copy of ``step`` at ``path``: None without a readable manifest, or
    (with ``job``, this job's id) when its ``job.json`` does not name ``job`` (a
    WARNING: another job's step, or one bcp did not stamp; job.py). A data file counts
    when ``holding.json`` (``holding.read_holding``) lists it for the manifest's save,
    with the manifest's size and digest, and it is a regular file of that size."""
    if job is not None:
        owner = read_job(path)
        if owner != job:
            log.warning(
                "local tier: ignoring step %d on this host: %s %s, not this job's (%s); it is never loaded",
                step,
                os.path.join(path, JOB_NAME),
                "is missing or unreadable" if owner is None else f"names job {owner}",
                job,
            )
            return None
    data = read_regular(os.path.join(path, MANIFEST_KEY), MAX_MANIFEST_BYTES)
    if data is None:
        return None
    where = os.path.join(path, MANIFEST_KEY)
    try:
        manifest = Manifest.from_json(data, where=where)
    except Exception as e:  # noqa: BLE001 - an unreadable copy is no copy; the others may do
        log.warning("local tier: ignoring step %d on this host: %s", step, e)
        return None
    holding = read_holding(path)
    listed = holding.files if holding is not None else {}
    if holding is not None and holding.save_id != manifest.save_id:
        log.warning(
            "local tier: step %d: %s is of save %s, the manifest of save %s; nothing of it is held",
            step,
            HOLDING_NAME,
            holding.save_id,
            manifest.save_id,
        )
        listed = {}
    held = {
        i
        for i, f in enumerate(manifest.data_files)
        if _listed(listed.get(f.path), f) and held_size(path, f) == f.nbytes
    }
    catalog = manifest.catalog
    has_catalog = _size_of(os.path.join(path, catalog.path)) == catalog.nbytes
    return StepCopy(
        step=step,
        save_id=manifest.save_id,
        manifest_crc32c=manifest_crc(data),
        n_files=len(manifest.data_files),
        held=tuple(sorted(held)),
        has_catalog=has_catalog,
    )


def _size_of(path: str) -> int | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None  # not another user's


def _listed(held: FileEntry | None, entry: FileEntry) -> bool:
    """Whether ``holding.json``'s ``held`` is ``entry`` (its size and digest; a reference's
    owner is the manifest's, ``incremental_local.py``)."""
    return held is not None and (held.path, held.nbytes, held.crc32c) == (entry.path, entry.nbytes, entry.crc32c)


def list_local(root: str, job: str | None = None) -> list[StepCopy]:
    """Every local step under ``root`` this host has a manifest for, newest first: only
    this job's (``job``, by default the id the tier stamped on the local root; a root
    without one, not made by a tier, lists every step; one whose ``job.json`` is there
    but unreadable lists none)."""
    if job is None:
        job = read_job(root)
        if job is None and os.path.lexists(os.path.join(root, JOB_NAME)):
            job = "unreadable"  # fail closed: no step's job.json names it
    out = []
    for step, path in step_dirs(root):
        copy = read_step(step, path, job)
        if copy is not None:
            out.append(copy)
    return out


def choose_local(listings: Sequence[Sequence[StepCopy] | None]) -> LocalChoice | None:
    """The newest local step some agreeing copies hold entirely (``listings``: one per
    surviving host, None for a host that could not list). Per step, copies agree when
    their save id and manifest CRC32C are equal; copies of other saves of the same step
    number never contribute a file (a stale copy is never mixed with a newer one).
    When several saves of one step are each complete, the newest save id (save ids
    start with their save's start time) wins."""
    copies: dict[int, dict[tuple[str, int, int], list[tuple[int, StepCopy]]]] = {}
    for host, listing in enumerate(listings):
        for copy in listing or ():
            key = (copy.save_id, copy.manifest_crc32c, copy.n_files)
            copies.setdefault(copy.step, {}).setdefault(key, []).append((host, copy))
    for step in sorted(copies, reverse=True):
        complete = []
        for (save_id, crc, n_files), group in copies[step].items():
            holders: list[list[int]] = [[] for _ in range(n_files)]
            for host, copy in group:
                for i in copy.held:
                    if 0 <= i < n_files:
                        holders[i].append(host)
            sources = [host for host, copy in group if copy.has_catalog]
            if all(holders) and sources:
                complete.append(LocalChoice(step, save_id, crc, tuple(tuple(h) for h in holders), sources[0]))
            else:
                missing = sum(1 for h in holders if not h)
                log.info(
                    "local tier: step %d (save %s) is incomplete on the surviving hosts: %d of %d data files held "
                    "by none%s",
                    step,
                    save_id,
                    missing,
                    n_files,
                    "" if sources else ", no catalog",
                )
        if complete:
            return max(complete, key=lambda c: (_save_time(c.save_id), c.save_id))
    return None


def _save_time(save_id: str) -> int:
    """The start time in a 24-digit bcp save id (0 for others)."""
    return int(save_id[:8], 16) if len(save_id) == 24 else 0


def local_wins(local_step: int | None, persistent_step: int | None) -> bool:
    """Whether to recover from the local tier: it has a complete step and it is not
    older than the persistent tier's newest (a tie goes to the local one: faster)."""
    if local_step is None:
        return False
    return persistent_step is None or local_step >= persistent_step
