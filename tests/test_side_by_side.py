"""tests/side_by_side.py: children run at the same time, each result is what
``subprocess.run`` gives, a child past its timeout is killed, close stops the rest."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import CancelledError

import pytest

from side_by_side import SideBySide

#: A child that waits (up to 30 s) for a file, then prints what it holds.
WAIT_FOR = (
    "import os, sys, time\n"
    "for _ in range(3000):\n    if os.path.exists(sys.argv[1]): break\n    time.sleep(0.01)\n"
    "print(open(sys.argv[1]).read())"
)


def test_children_run_at_the_same_time_and_give_subprocess_run_results(tmp_path):
    """The first child waits for a file that only the second writes: one at a time, it
    would wait its whole 30 s and then fail to open it."""
    runs = SideBySide(workers=2)
    try:
        flag = tmp_path / "flag"
        runs.submit("waits", [sys.executable, "-c", WAIT_FOR, str(flag)], cwd=tmp_path, timeout=60)
        start = time.monotonic()
        write = f"import sys; open({str(flag)!r}, 'w').write('hello'); sys.exit('bye')"
        runs.submit("writes", [sys.executable, "-c", write], env={"LC_ALL": "C"})
        waited = runs.result("waits")
        assert (waited.returncode, waited.stdout, waited.stderr) == (0, "hello\n", "")
        assert time.monotonic() - start < 25, "the children ran one after the other"
        wrote = runs.result("writes")
        assert wrote.returncode == 1 and wrote.stderr == "bye\n" and wrote.args[0] == sys.executable
        with pytest.raises(ValueError, match="submitted already"):
            runs.submit("writes", [sys.executable, "-c", ""])
    finally:
        runs.close()


def test_a_child_past_its_timeout_is_killed_and_close_stops_the_rest(tmp_path):
    runs = SideBySide(workers=1)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    runs.submit("late", sleeper, timeout=0.5)
    runs.submit("queued", sleeper)
    with pytest.raises(subprocess.TimeoutExpired):
        runs.result("late")
    start = time.monotonic()
    runs.close()  # kills "queued" (started once "late" was killed) or cancels it
    assert time.monotonic() - start < 20, "close waited for a child instead of killing it"
    try:
        outcome: object = runs.result("queued").returncode
    except (CancelledError, RuntimeError) as e:
        outcome = type(e).__name__
    assert outcome in (-signal.SIGKILL, "CancelledError", "RuntimeError"), outcome
