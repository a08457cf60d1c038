"""The ``bcp`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _conformance(args: argparse.Namespace) -> int:
    from bcp.conformance.runner import run_suite

    return run_suite(args.uri, level="quick" if args.quick else "full", options=args.option, json_path=args.json,
                     imports=args.imports, keyword=args.k, verbose=args.verbose, probe_mib=args.probe_mib)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bcp", description="bcp checkpoints: storage checks and tools")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    conf = sub.add_parser("conformance", help="check that a storage backend keeps bcp's contracts",
                          description="Run the object contract, the checkpoint contract and a performance probe "
                                      "against URI (an empty location), print a report grouped by capability; "
                                      "exit status 1 if any check failed.")
    conf.add_argument("uri", help="root URI of an empty location in the store (query options allowed)")
    level = conf.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_true", help="skip killed-process checks, small probe")
    level.add_argument("--full", action="store_true", help="everything (default)")
    conf.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                      help="storage option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000")
    conf.add_argument("--json", metavar="PATH", help="also write the report as JSON (for CI)")
    conf.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (registers a backend that is not an installed plugin)")
    conf.add_argument("--probe-mib", type=int, metavar="N", help="probe object size (default 256 full, 32 quick)")
    conf.add_argument("-k", metavar="EXPR", help="only checks matching this pytest -k expression")
    conf.add_argument("--verbose", "-v", action="store_true", help="list every check as it runs")
    conf.set_defaults(func=_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
