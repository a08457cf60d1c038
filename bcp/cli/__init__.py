"""The ``bcp`` command line: ls, inspect, verify, convert, rm, gc, bench, conformance.

Exit status, the same for every command:

* 0: done (``verify``: every check passed).
* 1: the location or checkpoint is missing, or bad (a check failed, a tensor is
  unreadable), or the work failed: one line on stderr (``--debug``: the traceback).
* 2: the command line is wrong: an unknown option, a missing argument (argparse's own
  message), an option value out of range or options that do not go together.
* 130: interrupted (Ctrl-C).

The modules: :mod:`~bcp.cli.main` (the parser, the one-line errors and the exit
status), :mod:`~bcp.cli.common` (the refusals, locations, ``--import``),
:mod:`~bcp.cli.render` (what reaches the terminal: escaping, sizes, ages), and one
module per command, which parses and prints: the work is in the library
(:mod:`bcp.housekeeping`, :mod:`bcp.describe`, :mod:`bcp.verify`, :mod:`bcp.convert`,
:mod:`bcp.benchmark`, :mod:`bcp.conformance`).
"""

from bcp.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
