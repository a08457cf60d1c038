"""``bcp ARGS`` run in the test process (``bcp.cli.main``), as a subprocess would see it.

A ``python -m bcp.cli`` child costs seconds of imports (torch) on the 2-core CI machine;
most CLI tests check what a command prints and its exit status, not the process
boundary, and run here. What only a real process shows (the console script, a real
Ctrl-C, an address-space limit, that nothing at all is printed but the one line) keeps
its subprocess in the tests that check it.

Faithful to a fresh process where it matters to the tests: stdout and stderr are
captured separately; argparse's ``SystemExit`` becomes the exit status; the root logger
starts bare, so ``main``'s ``logging.basicConfig`` writes log records to the captured
stderr as it does in a child (the test process's handlers and levels are put back
after); Python's default warning filters apply and warnings are printed to the
captured stderr; bcp's logger level is put back after (``--log-level`` sets it)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import warnings

from bcp.cli import main

#: Python's warning filters in a fresh process (a release build, no -W options).
_FRESH_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


@dataclasses.dataclass(frozen=True)
class Result:
    """What ``subprocess.run(..., capture_output=True, text=True)`` gives, for the fields
    the tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def cli(*args: str, cwd: str | os.PathLike[str] | None = None) -> Result:
    """``bcp ARGS`` in this process (in ``cwd`` if given): its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    root, bcp_logger = logging.getLogger(), logging.getLogger("bcp")
    handlers, root_level, bcp_level = root.handlers[:], root.level, bcp_logger.level
    here = os.getcwd()
    try:
        root.handlers[:] = []
        root.setLevel(logging.WARNING)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_FRESH_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _show
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: --help, --version, usage errors
                if isinstance(e.code, str):  # sys.exit("message"): printed, exit 1
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            finally:
                for handler in root.handlers[:]:  # the one basicConfig added, on the captured stderr
                    root.removeHandler(handler)
                    handler.close()
    finally:
        os.chdir(here)
        root.handlers[:] = handlers
        root.setLevel(root_level)
        bcp_logger.setLevel(bcp_level)
    return Result(list(args), code, out.getvalue(), err.getvalue())
