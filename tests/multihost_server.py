"""A fork server for one simulated host of tests/test_multihost_network.py.

Started once per host as ``ip netns exec <host> python tests/multihost_server.py``, so it
lives in the host's network namespace and sees its /etc/hosts. It imports torch and bcp
once; each rank of each test case is then a fork of it (a tenth of a second) instead of a
new Python importing torch (seconds, times 4 ranks, times every case).

Protocol, one JSON object per line: on stdin ``{"argv": [...], "env": {...}, "out": path}``
starts a rank: it becomes its own session (its process group can be killed whole), takes
``env`` as its whole environment, writes stdout and stderr to ``out`` and runs
``multihost_jobs.main()`` with ``argv``, then exits as ``python multihost_jobs.py ARGV``
would (the interpreter's normal shutdown). On stdout the server answers ``{"pid": N}`` for
each request, in order, and ``{"exited": N, "rc": R}`` when a rank ends. End of stdin: the
server kills the ranks still running and exits."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys

# the imports a rank must not pay again (multihost_jobs imports torch and torch.distributed)
import bcp.coordination.gloo_network  # noqa: F401
import multihost_jobs


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _answer({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def serve() -> dict:
    """Answer requests until stdin ends (then exit); in a forked rank, return its request."""
    children: set[int] = set()
    # what the imports made is never collected again: a rank's collections (and the one at
    # its exit) then skip it instead of touching, and so copying, every page of the server
    gc.freeze()
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap(children)
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)  # nothing of the server's to keep: no slow interpreter shutdown with torch loaded
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            _answer({"pid": pid})


def become_rank(request: dict) -> None:
    """Make this forked process look like ``python multihost_jobs.py ARGV`` started afresh."""
    os.setsid()
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [multihost_jobs.__file__, *request["argv"]]


if __name__ == "__main__":
    become_rank(serve())
    multihost_jobs.main()
