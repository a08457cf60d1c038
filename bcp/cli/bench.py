"""``bcp bench URI``: save and load a synthetic state through a URI
(:func:`bcp.benchmark.save_load`) and print its speeds."""

from __future__ import annotations

import argparse
import sys

from bcp.benchmark import save_load
from bcp.cli.common import UsageError, backend_at, one_line
from bcp.cli.render import human, rate, safe, show

NAME = "bench"
HELP = "save and load a synthetic state through URI; speeds (MiB/s, GiB/s)"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="a location to write scratch checkpoints under (they are deleted)")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)


def _print_run(index: int, nbytes: int, save_seconds: float, load_seconds: float) -> None:
    print(
        f"  run {index + 1}: save {_speed(nbytes, save_seconds)}, load {_speed(nbytes, load_seconds)}",
        flush=True,
    )


def _speed(nbytes: int, seconds: float) -> str:
    return rate(nbytes / seconds) if seconds > 0 else "-"


def _print_cleanup_error(prefix: str, error: Exception) -> None:
    print(f"bcp bench: could not delete the scratch checkpoint {safe(prefix)}: {one_line(error)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if not args.gib > 0:
        raise UsageError(f"--gib must be > 0, got {args.gib:g}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    backend_at(args.uri).close()  # a URI or option no store takes: a usage error, before any work
    result = save_load(
        args.uri, gib=args.gib, repeats=args.repeats, on_run=_print_run, on_cleanup_error=_print_cleanup_error
    )
    print(
        f"{human(result.nbytes)} through {show(args.uri.partition('?')[0])}, median of {args.repeats}: "
        f"save {rate(result.save_gbps * 1e9)}, load {rate(result.load_gbps * 1e9)}"
    )
    return 0
