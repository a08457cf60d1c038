"""``python -m bcp.cli``: the same as the ``bcp`` command."""

import sys

from bcp.cli.main import run_program

sys.exit(run_program())
