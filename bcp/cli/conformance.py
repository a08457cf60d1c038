"""``bcp conformance URI``: the backend conformance suite (:mod:`bcp.conformance`)."""

from __future__ import annotations

import argparse

from bcp.cli.common import UsageError, backend_at, imports

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

    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--option needs KEY=VALUE, got {item!r}")
        options[key] = value
    backend_at(args.uri, **options).close()  # a URI or option the store refuses: one line, before the suite
    status = run_suite(
        args.uri,
        level="quick" if args.quick else "full",
        options=args.option,
        json_path=args.json,
        imports=imports(args),
        keyword=args.k,
        verbose=args.verbose,
        probe_mib=args.probe_mib,
    )
    if status == 5:  # pytest: no test collected
        raise UsageError(f"no check matches -k {args.k!r}" if args.k else "no check was collected")
    if status == 2:  # pytest: interrupted
        raise KeyboardInterrupt
    return 0 if status == 0 else 2 if status == 4 else 1
