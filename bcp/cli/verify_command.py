"""``bcp verify URI``: every fragment re-read and checked (:mod:`bcp.verify`)."""

from __future__ import annotations

import argparse
import json

from bcp import verify
from bcp.backends import backend_for
from bcp.backends.storage_errors import redact
from bcp.cli.common import require_location
from bcp.cli.render import human, progress, safe

NAME = "verify"
HELP = "re-read every fragment; check checksums, sizes and coverage"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    require_location(backend_for(args.uri), args.uri, list_objects=False)
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
