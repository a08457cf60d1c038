"""``bcp ls ROOT``: the checkpoints under a root, in any layout
(:func:`bcp.discovery.list_checkpoints`), as a table or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from bcp.backends import Backend
from bcp.cli.common import backend_at, one_line, require_location
from bcp.cli.render import age, human, safe, show
from bcp.commit import read_manifest
from bcp.discovery import FIND_MAX_DEPTH, ListedCheckpoint, list_checkpoints
from bcp.schedule.auto import report_from_metadata
from bcp.schedule.interval import IntervalReport

NAME = "ls"
HELP = "checkpoints under a root, in any layout: committed, incomplete or retired, own and shared bytes, age, kind"
DESCRIPTION = (
    "List the checkpoints under ROOT: ROOT itself, a manager's step_<N> directories, and any "
    "other location up to 3 levels below ROOT (one listing, stopped after 1,000,000 objects)."
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("root")
    p.add_argument("--json", action="store_true")


def as_json(row: ListedCheckpoint) -> dict[str, Any]:
    """One row of ``bcp ls --json``."""
    doc: dict[str, Any] = {
        "path": row.path,
        "kind": row.kind,
        "step": row.step,
        "status": row.status,
        "objects": row.objects,
        "bytes": row.bytes,
        "shared_bytes": row.shared_bytes,
        "held_by": [
            {"checkpoint": k.referrer, "files": k.files, "bytes": k.nbytes, "committed": k.committed}
            for k in row.held_by
        ],
        "created": row.created,
        "latest": row.latest,
    }
    if row.error is not None:
        doc["error"] = one_line(row.error)
    return doc


def interval_of(backend: Backend, row: ListedCheckpoint) -> IntervalReport | Exception | None:
    """The ``interval="auto"`` report kept in a manager's newest step (None: none; the
    error when its estimates are unreadable or not sane)."""
    if not row.latest or row.status != "committed":
        return None
    try:
        manifest = read_manifest(backend, f"{row.path}/" if row.path else "")
        return report_from_metadata(manifest.user_metadata) if manifest is not None else None
    except Exception as e:  # noqa: BLE001 - shown on its line; the listing stands
        return e


def run(args: argparse.Namespace) -> int:
    backend = backend_at(args.root)
    require_location(backend, args.root)
    listing = list_checkpoints(backend)
    rows = listing.checkpoints
    if listing.truncated:
        print(f"bcp ls: stopped listing after {len(rows)} checkpoint(s); there may be more", file=sys.stderr)
    intervals = {id(r): interval_of(backend, r) for r in rows if r.latest}
    if args.json:
        docs = []
        for r in rows:
            doc, found = as_json(r), intervals.get(id(r))
            if isinstance(found, Exception):
                doc["interval"] = {"error": one_line(found)}
            elif found is not None:
                doc["interval"] = dataclasses.asdict(found)
            docs.append(doc)
        print(json.dumps(docs, indent=2))
        return 0
    if not rows:
        print(f"no checkpoints under {show(args.root)} (looked {FIND_MAX_DEPTH} levels deep)")
        return 0
    print(f"{'step':>12}  {'status':<10} {'own':>10} {'shared':>10} {'objects':>7} {'age':>6}  {'kind':<9}  location")
    for r in rows:
        mark = "  <- latest" if r.latest else ""
        why = f"  ({one_line(r.error)})" if r.error is not None else ""
        held = f"  (held by {', '.join(safe(k.referrer) for k in r.held_by)})" if r.held_by else ""
        step = "-" if r.step is None else r.step
        shown_age = age(r.created_at) if r.status == "committed" else "-"
        shared = human(r.shared_bytes) if r.shared_bytes else "-"
        print(
            f"{step:>12}  {r.status:<10} {human(r.bytes):>10} {shared:>10} {r.objects:>7} "
            f"{shown_age:>6}  {r.kind:<9}  {safe(r.path or '.')}{mark}{held}{why}"
        )
    for r in rows:  # interval="auto": what the manager chose, from its newest step
        found = intervals.get(id(r))
        where = safe(r.path.rsplit("/", 1)[0] if "/" in r.path else ".")
        if isinstance(found, Exception):
            print(f"{where}: interval: unreadable ({one_line(found)})")
        elif found is not None:
            print(f"{where}: " + "\n".join(safe(line) for line in found.lines()))
    return 0
