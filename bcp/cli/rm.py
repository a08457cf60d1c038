"""``bcp rm URI``: delete one checkpoint, its manifest first. Which objects are the
checkpoint's is :func:`bcp.housekeeping.checkpoint_objects`; the deletion is
:func:`bcp.commit.delete_checkpoint`."""

from __future__ import annotations

import argparse
import os

from ..backends import backend_for
from ..commit import delete_checkpoint
from ..housekeeping import checkpoint_objects
from ..metadata.layout import MANIFEST_KEY
from .common import CliError, NotFound, require_location
from .render import safe, show

NAME = "rm"
HELP = "delete one checkpoint (its manifest first)"
DESCRIPTION = (
    "Delete the checkpoint at URI: manifest.json first, then its generations (gen-*/). "
    "Other objects there are left and named. A location without manifest.json is refused unless --force; "
    "a local location that is a symbolic link is always refused."
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--force", action="store_true", help="also delete an uncommitted checkpoint (no manifest.json)")


def run(args: argparse.Namespace) -> int:
    """Delete one checkpoint: its manifest first, then its generations (``gen-*/``).
    Nothing else: not other files in the location, not a location without a
    manifest (unless --force), never through a symbolic link."""
    backend = backend_for(args.uri)
    where = show(args.uri)
    root = getattr(backend.unwrap(), "root", None)
    if backend.unwrap().scheme == "file" and isinstance(root, str) and os.path.islink(root):
        raise CliError(f"{where} is a symbolic link; bcp rm does not delete through links (remove the link itself)")
    require_location(backend, args.uri)
    found = checkpoint_objects(backend)
    if not found.keys:
        raise NotFound(f"nothing at {where}")
    generations = found.generations
    if not found.committed and not args.force:
        raise CliError(
            f"{where} has no {MANIFEST_KEY}: not a committed bcp checkpoint ({len(found.keys)} object(s), "
            f"{len(generations)} bcp generation(s)); pass --force to delete its bcp objects "
            f"({MANIFEST_KEY}, gen-*/) anyway"
        )
    what = (
        f"{len(found.bcp_keys)} object(s) of {'the' if found.committed else 'an uncommitted'} checkpoint at {where}"
        f" ({MANIFEST_KEY if found.committed else 'no manifest'}; generation(s) {', '.join(generations) or '-'})"
    )
    left = ""
    others = found.other_keys
    if others:
        shown = ", ".join(safe(k) for k in others[:5]) + (", ..." if len(others) > 5 else "")
        left = f"; leaving {len(others)} object(s) that are not bcp's: {shown}"
    if args.dry_run:
        print(f"would delete {what}{left}")
        return 0
    delete_checkpoint(backend, only_bcp=True)  # the manifest first, then gen-*/ (partial files too)
    print(f"deleted {what}{left}")
    return 0
