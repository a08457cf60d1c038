"""``bcp rm URI``: delete one checkpoint, its manifest first. What may be deleted is
decided as for ``bcp.delete`` (:func:`bcp.deletion.deletable`); the deletion is
:func:`bcp.commit.delete_checkpoint`."""

from __future__ import annotations

import argparse
from collections.abc import Collection

from bcp.cli.common import CliError, NotFound, backend_at, one_line, require_location
from bcp.cli.render import human, safe, show
from bcp.deletion import deletable, delete_by_holds, parent_of, remove_emptied_root
from bcp.errors import CheckpointError
from bcp.holds import HoldChecker, Keeper, keepers_of
from bcp.metadata.keys import MANIFEST_KEY

NAME = "rm"
HELP = "delete one checkpoint (its manifest first)"
DESCRIPTION = (
    "Delete the checkpoint at URI: manifest.json first, then its generations (gen-*/), except those newer "
    "incremental checkpoints read: they stay whole (retired), and the checkpoints that keep them are named. "
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
    backend = backend_at(args.uri)
    where = show(args.uri)
    require_location(backend, args.uri)
    try:
        found = deletable(backend, uncommitted=args.force, tool="bcp rm", force="pass --force")
    except CheckpointError as e:  # one line, no traceback hint: the refusal is the answer
        raise CliError(one_line(e)) from e
    if found is None:
        raise NotFound(f"nothing at {where}")

    def what(kept: Collection[str] = ()) -> str:  # a generation kept (retired): neither it nor its objects counted
        keys = [k for k in found.bcp_keys if k.split("/", 1)[0] not in kept]
        gone = [g for g in found.generations if g not in kept]
        return (
            f"{len(keys)} object(s) of {'the' if found.committed else 'an uncommitted'} checkpoint at {where}"
            f" ({MANIFEST_KEY if found.committed else 'no manifest'}; generation(s) {', '.join(gone) or '-'})"
        )

    left = ""
    others = found.other_keys
    if others:
        shown = ", ".join(safe(k) for k in others[:5]) + (", ..." if len(others) > 5 else "")
        left = f"; leaving {len(others)} object(s) that are not bcp's: {shown}"
    if args.dry_run:
        parent, name = parent_of(args.uri, backend, None)
        print(f"would delete {what()}{left}")
        for line in kept_lines(keepers_of(parent, name, HoldChecker(parent)), "would keep"):
            print(line)
        return 0
    done = delete_by_holds(args.uri, backend)  # the manifest first, then unheld gen-*/ (partial files too)
    remove_emptied_root(backend)  # no empty directory left behind
    print(f"deleted {what(done.retired)}{left}")
    for line in kept_lines(done.retired, "kept"):
        print(line)
    for generation in done.collected:
        print(f"collected {safe(generation)}: its last referrer was this checkpoint")
    return 0


def kept_lines(retired: dict[str, list[Keeper]], verb: str) -> list[str]:
    """One line per generation kept whole (retired), naming the newer checkpoints that
    keep it and which of its bytes each reads."""
    lines = []
    for generation, keepers in sorted(retired.items()):
        who = []
        for k in sorted(keepers, key=lambda k: k.referrer):
            if k.committed:
                who.append(f"{safe(k.referrer)} reads {k.files} file(s), {human(k.nbytes)}")
            else:
                who.append(f"{safe(k.referrer)} (a save in progress, or outside what bcp can check)")
        lines.append(f"{verb} {generation} whole (retired): newer checkpoints keep its bytes alive: {'; '.join(who)}")
    return lines
