"""``bcp verify URI``: every fragment re-read and checked (:mod:`bcp.verify`); a folder
of checkpoints (a manager root) or ``--all``: every committed checkpoint under it, each
shared byte read once (``verify.verify_root``)."""

from __future__ import annotations

import argparse
import json

from bcp import verify
from bcp.backends.storage_errors import redact
from bcp.cli.common import backend_at, require_location
from bcp.cli.render import human, progress, safe
from bcp.discovery import find_checkpoints
from bcp.metadata.keys import MANIFEST_KEY

NAME = "verify"
HELP = "re-read every fragment; check checksums, sizes and coverage"
DESCRIPTION = (
    "Re-read every stored fragment of the checkpoint at URI and check it. When URI holds no "
    "checkpoint but checkpoints below it (a manager root), or with --all, check every committed "
    "checkpoint at or below URI: bytes that checkpoints share (incremental checkpoints) are read "
    "once, and a bad block is reported for every checkpoint that uses it."
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri")
    p.add_argument(
        "--all",
        action="store_true",
        help="check every committed checkpoint at or below URI (the default when URI itself is none)",
    )
    p.add_argument("--json", action="store_true")


def _is_root(uri: str) -> bool:
    """No checkpoint at ``uri`` but a committed one below it."""
    backend = backend_at(uri)
    try:
        if backend.exists(MANIFEST_KEY):
            return False
        return any(c.committed for c in find_checkpoints(backend).checkpoints)
    finally:
        backend.close()


def run(args: argparse.Namespace) -> int:
    require_location(backend_at(args.uri), args.uri, list_objects=args.all)
    if args.all or _is_root(args.uri):
        return _run_root(args)
    report = verify.verify_checkpoint(args.uri, progress=progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for problem in report["problems"]:
            print(f"PROBLEM {safe(redact(problem))}")
        print(
            f"{'OK' if report['ok'] else 'FAILED'}: {report['tensors']} tensors; "
            f"{report['fragments_ok']} of {report['fragments']} stored fragment(s) ({human(report['bytes_read'])}) "
            f"read and matched their checksums in {report['seconds']:.1f} s; {len(report['problems'])} problem(s)"
        )
    return 0 if report["ok"] else 1


def _run_root(args: argparse.Namespace) -> int:
    """One ``PROBLEM PATH: ...`` line per problem of each checkpoint, one ``DAMAGED`` line
    per bad stored fragment or file naming every checkpoint that uses it, then the total."""
    report = verify.verify_root(args.uri, progress=progress)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    for problem in report["problems"]:
        print(f"PROBLEM {safe(redact(problem))}")
    for bad in report["damaged"]:
        at = "" if bad["offset"] is None else f" at byte {bad['offset']}"
        print(f"DAMAGED {safe(redact(bad['file']))}{at}: used by {safe(', '.join(bad['checkpoints']))}")
    checked = report["checkpoints"]
    failed = sum(not r["ok"] for r in checked)
    more = "; stopped listing: there may be more" if report["truncated"] else ""
    print(
        f"{'OK' if report['ok'] else 'FAILED'}: {len(checked)} committed checkpoint(s), {failed} with problems; "
        f"{report['fragments_ok']} of {report['fragments']} stored fragment(s) matched their checksums, "
        f"{human(report['bytes_read'])} read (each shared fragment once: {report['fragments_known']} reused "
        f"a check) in {report['seconds']:.1f} s; {len(report['problems'])} problem(s){more}"
    )
    return 0 if report["ok"] else 1
