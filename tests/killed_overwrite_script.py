"""An overwrite killed while writing, run as a real process by
tests/test_killed_overwrite.py: it saves over the checkpoint at URI with
``overwrite=True``, its save id dated AGO seconds back (a kill that happened that
long ago), and stops before its data file is renamed into place; the test kills it
with SIGKILL once it prints "writing".

Usage: python killed_overwrite_script.py URI AGO
"""

from __future__ import annotations

import sys
import time

import torch

import bcp
import bcp.save_phases
from bcp.backends import file


def main() -> None:
    uri, ago = sys.argv[1], float(sys.argv[2])
    real_id = bcp.save_phases.new_save_id
    bcp.save_phases.new_save_id = lambda: real_id(now=time.time() - ago)

    def hang(self) -> None:
        print("writing", flush=True)  # the partial file holds the data: kill here
        time.sleep(600)

    file._FileWriter._commit = hang  # type: ignore[method-assign]
    bcp.save({"w": torch.full((4096,), 2.0), "step": 2}, uri, overwrite=True)


if __name__ == "__main__":
    main()
