"""``bcp ls ROOT``: the checkpoints under a root, in any layout
(:func:`bcp.discovery.list_checkpoints`), as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bcp.backends import backend_for
from bcp.cli.common import one_line, require_location
from bcp.cli.render import age, human, safe, show
from bcp.discovery import FIND_MAX_DEPTH, ListedCheckpoint, list_checkpoints

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


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root)
    require_location(backend, args.root)
    listing = list_checkpoints(backend)
    rows = listing.checkpoints
    if listing.truncated:
        print(f"bcp ls: stopped listing after {len(rows)} checkpoint(s); there may be more", file=sys.stderr)
    if args.json:
        print(json.dumps([as_json(r) for r in rows], indent=2))
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
    return 0
