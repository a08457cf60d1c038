"""The ``bcp`` command line: ls, inspect, verify, convert, rm, gc, bench, conformance.

Exit status, the same for every command:

* 0: done (``verify``: every check passed).
* 1: the location or checkpoint is missing, or bad (a check failed, a tensor is
  unreadable), or the work failed: one line on stderr (``--debug``: the traceback).
* 2: the command line is wrong: an unknown option, a missing argument (argparse's own
  message), an option value out of range or options that do not go together.
* 130: interrupted (Ctrl-C).

Each command is one module that parses and prints; the work is in the library.
docs/architecture.md names every module and the library function behind each command.
"""

from bcp.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
