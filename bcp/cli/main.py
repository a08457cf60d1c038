"""``bcp``'s entry point: the parser (the global options, each command's own from its
module), and the one-line error handling that gives every command the same exit
status (0 done, 1 missing / bad / failed, 2 a wrong command line, 130 interrupted)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import NoReturn

from bcp.backends.registry import import_plugins
from bcp.backends.storage_errors import redact
from bcp.cli import bench, conformance, convert_command, gc, inspect, ls, rm, trace_command, verify_command
from bcp.cli.common import CliError, UsageError, add_import_option, imports, one_line, refuse_empty_locations
from bcp.cli.render import safe
from bcp.errors import CheckpointNotFoundError

#: The commands, in the order --help lists them.
COMMANDS = (conformance, ls, inspect, verify_command, convert_command, rm, gc, bench, trace_command)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, with a wrong command line as one line, exit 2 (the usage block is
    ``--help``'s); subcommands' parsers are made of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from bcp import __version__

    parser = OneLineParser(
        prog="bcp",
        description="bcp checkpoints: storage checks and tools",
        epilog="exit status: 0 done; 1 the location or checkpoint is missing or bad, a check failed, "
        "or the work failed; 2 a wrong command line; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"bcp {__version__}")
    parser.add_argument(
        "--log-level",
        type=_log_level,
        help="level of bcp's own log messages (default WARNING); other libraries stay at WARNING",
    )
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback, not one line")
    add_import_option(parser, "imports")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.configure(p)
        p.set_defaults(func=command.run)
    for p in sub.choices.values():  # every subcommand takes it too, after its name
        add_import_option(p, "command_imports")
    return parser


def _log_level(text: str) -> int:
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(f"unknown log level {text!r} (DEBUG, INFO, WARNING, ERROR)")
    return level


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # --log-level is for bcp's own loggers: the root stays at WARNING, so other
    # libraries (botocore prints request headers at DEBUG) stay quiet
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.log_level is not None:  # unset, bcp's loggers follow the root (and a caller's set-up is kept)
        logging.getLogger("bcp").setLevel(args.log_level)
    try:
        refuse_empty_locations(args)
        import_plugins(imports(args))  # before the command uses any URI
        return args.func(args)
    except KeyboardInterrupt:
        print(f"bcp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error: one line (the traceback with --debug), exit 1
        return _report(args, e)
    except BaseException as e:  # DCP's CheckpointException, the one BaseException reported as an error
        converted = _library_failure(e)
        if converted is None:
            raise
        return _report(args, converted)


def run_program() -> int:
    """The ``bcp`` program (console script, ``python -m bcp.cli``): :func:`main`, and after
    Ctrl-C (the command has cleaned up and said so) an immediate exit with 130: the
    interpreter's shutdown with library threads still inside C++ code (torch's, Arrow's)
    sometimes ended in ``terminate called without an active exception`` and SIGABRT."""
    status = main()
    if status == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return status


def _library_failure(error: BaseException) -> Exception | None:
    """PyTorch DCP's ``CheckpointException`` (a ``BaseException``, so ``except
    Exception`` misses it, with every failed rank's traceback as its message) as
    bcp's one-line ConversionError; None for anything else."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is None or not isinstance(error, api.CheckpointException):
        return None
    from bcp.convert.dcp_format import conversion_error

    converted = conversion_error(error, "PyTorch DCP failed")
    converted.__cause__ = error
    return converted


def _report(args: argparse.Namespace, e: BaseException) -> int:
    """Print ``e`` as one line (its traceback with --debug); the exit status: 2 for a
    usage error, else 1."""
    if args.debug:
        text = "".join(traceback.format_exception(e))
        print("\n".join(safe(redact(line)) for line in text.splitlines()), file=sys.stderr)
    else:
        hint = "" if isinstance(e, CliError | CheckpointNotFoundError) else " (--debug shows the traceback)"
        print(f"bcp {args.command}: {one_line(e)}{hint}", file=sys.stderr)
    return 2 if isinstance(e, UsageError) else 1
