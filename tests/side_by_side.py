"""Child processes started ahead of the tests that check them, a few at a time.

A module whose tests each wait on a slow child process (a CLI run imports torch, about
2-3 s of CPU, then works against a store for seconds) submits them all when its first
test starts; each test then takes its own child's result and checks it exactly as it
did when it ran the child itself. pytest runs tests one at a time in one process, so on
CI's 2 cores one core sat idle while a test waited on its child: here the children
use it. Each child runs the command line, environment, directory and timeout its test
gave it; only when it starts changes.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

#: Children running at once: one more than the cores (they also wait on servers and on
#: their own children), at least 2, at most 4 (each holds torch: a few hundred MB).
WORKERS = max(2, min(4, (os.cpu_count() or 2) + 1))


class SideBySide:
    """Named child processes, run ``workers`` at a time in the order submitted."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="side-by-side")
        self._jobs: dict[str, Future[subprocess.CompletedProcess]] = {}
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cwd: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 600,
    ) -> None:
        """Queue ``argv`` as ``subprocess.run(argv, capture_output=True, text=True, ...)``."""
        if name in self._jobs:
            raise ValueError(f"a child named {name!r} was submitted already")
        self._jobs[name] = self._pool.submit(self._run, list(argv), cwd, None if env is None else dict(env), timeout)

    def result(self, name: str) -> subprocess.CompletedProcess:
        """The child's result once it ended; ``subprocess.TimeoutExpired`` if it ran past
        its timeout (it is killed), as ``subprocess.run`` raises."""
        return self._jobs[name].result()

    def _run(
        self, argv: list[str], cwd: Path | str | None, env: dict[str, str] | None, timeout: float
    ) -> subprocess.CompletedProcess:
        with self._lock:
            if self._closed:
                raise RuntimeError("closed before this child started")
            child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
            self._running.add(child)
        try:
            try:
                stdout, stderr = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise
            return subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)
        finally:
            with self._lock:
                self._running.discard(child)

    def close(self) -> None:
        """Start nothing more, kill the children still running, wait for the threads."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for job in self._jobs.values():
            job.cancel()
        for child in running:
            child.kill()
        self._pool.shutdown(wait=True)
