"""``bcp conformance URI``: the backend conformance suite (:mod:`bcp.conformance`)."""

from __future__ import annotations

import argparse

from bcp.cli.common import imports

NAME = "conformance"
HELP = "check that a storage backend keeps bcp's contracts"
DESCRIPTION = (
    "Run the object contract, the checkpoint contract and a performance probe "
    "against URI (an empty location), print a report grouped by capability; "
    "exit status 1 if any check failed."
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="root URI of an empty location in the store (query options allowed)")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_true", help="skip killed-process checks, small probe")
    level.add_argument("--full", action="store_true", help="everything (default)")
    p.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="storage option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON (for CI)")
    p.add_argument("--probe-mib", type=int, metavar="N", help="probe object size (default 256 full, 32 quick)")
    p.add_argument("-k", metavar="EXPR", help="only checks matching this pytest -k expression")
    p.add_argument("--verbose", "-v", action="store_true", help="list every check as it runs")


def run(args: argparse.Namespace) -> int:
    from bcp.extras import needs_extra

    with needs_extra("conformance", "bcp conformance"):  # the suite is pytest tests
        from bcp.conformance.runner import run_suite

    return run_suite(
        args.uri,
        level="quick" if args.quick else "full",
        options=args.option,
        json_path=args.json,
        imports=imports(args),
        keyword=args.k,
        verbose=args.verbose,
        probe_mib=args.probe_mib,
    )
