"""Start the chaos jobs from a process that has already imported torch and bcp.

    python tests/chaos/fork_server.py serve SOCKET
    python tests/chaos/fork_server.py run SOCKET SCRIPT [ARGS...]

ckpt-chaos starts a fresh ``python SCRIPT ARGS`` for every run (the fault-free one, the
control, each crash and each resume): most of each run's time went to importing torch
(its optimizers import torch._dynamo) and bcp, 3-4 s of CPU a run on the CI machine.
``serve`` imports them once and listens on the Unix socket SOCKET; ``run`` (imports only
the standard library) is the command ckpt-chaos starts instead: it hands the server its
arguments, environment, working directory, umask and its stdin/stdout/stderr, the server
forks, and the fork runs SCRIPT as ``python SCRIPT ARGS`` would (``__main__``, the
script's folder first on sys.path, the PYTHONPATH entries after it, a normal interpreter
exit with its atexit handlers). ``run`` then exits as the job did: its exit status, or
killed by the job's signal.

What ckpt-chaos does to the job stays the same: the fork runs ckpt-chaos's own
``sitecustomize`` from the PYTHONPATH ckpt-chaos set, as Python's start-up does, so the
injector arms from the same CKPT_CHAOS_* variables and counts the same file events; a
crash (``os._exit``, SIGTERM) ends the job's process; and when ckpt-chaos kills ``run``
(a time-out, a peer rank's death), the server kills the job with SIGKILL.

One thing differs: a fork's interpreter teardown is much shorter than a process's that
imported torch, so a race with the teardown may not show. With the staging pool's exit
hook removed, a resumed async job aborted ("terminate called without an active
exception") 3 times of 3 as a process and 0 of 3 as a fork: the regression test for
that race (tests/test_crash_consistency.py) runs plain processes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

#: preloaded by the server: what the jobs import (torch.optim's first optimizer imports torch._dynamo)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "bcp")
_HEADER = struct.Struct("!I")


# -- the client ------------------------------------------------------------------------


def run(sock_path: str, argv: list[str]) -> None:
    """Have the server run ``python *argv`` with this process's environment and stdio; exit as it did."""
    env = dict(os.environ)
    # set by ckpt-chaos's sitecustomize when it armed this process (which writes nothing): the job arms itself
    env.pop("CKPT_CHAOS_ARMED", None)
    mask = os.umask(0o022)
    os.umask(mask)
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "umask": mask}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(sock_path)
        socket.send_fds(conn, [_HEADER.pack(len(request))], [0, 1, 2])
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    if not answer:
        print(f"fork_server: the server at {sock_path} ended without the job's status", file=sys.stderr)
        os._exit(70)
    status = json.loads(answer)
    if "signal" in status:  # die of the same signal, as the job did
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
        os._exit(128 + status["signal"])
    os._exit(status["exit"])


# -- the server ------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    while len(data) < _HEADER.size:
        data += conn.recv(65536)
    (size,) = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    while len(body) < size:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        body += chunk
    return json.loads(body), fds


def _watch(conn: socket.socket, pid: int) -> None:
    """Wait for the job or the client: report the job's end to the client; kill the job if the client is gone."""
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                answer = {"signal": os.WTERMSIG(status)}
            else:
                answer = {"exit": os.waitstatus_to_exitcode(status)}
            try:
                conn.sendall(json.dumps(answer).encode())
            except OSError:
                pass  # the client is gone too
            return
        if not conn.recv(1):  # the client was killed (a time-out, a peer's death): so is the job
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return


def serve(sock_path: str) -> dict[str, Any]:
    """Import the jobs' modules, then serve forever; returns only in a job's process, with its request."""
    import gc
    import importlib
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    # the imported objects out of the collector's reach: a job's collections (its exit's
    # included) would otherwise touch, and so copy, every page the fork shares (1 s of CPU a job)
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # watchers are reaped by the kernel
    print("ready", flush=True)
    while True:
        # stdin is a pipe from the test: its end (the test is gone) ends the server
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            os._exit(0)
        conn, _ = listener.accept()
        if threading.active_count() != 1:  # a fork of a threaded process may hold a lock forever
            raise RuntimeError("fork_server: a thread runs in the server: it cannot fork safely")
        if os.fork() != 0:
            conn.close()
            continue
        # the watcher: one per job
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            request, fds = _recv_request(conn)
        except (OSError, ValueError):
            os._exit(0)
        pid = os.fork()
        if pid != 0:
            for fd in fds:
                os.close(fd)
            _watch(conn, pid)
            os._exit(0)
        # the job
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request


def _become(request: dict[str, Any]) -> str:
    """Make this fork look like ``python SCRIPT ARGS`` started in the client's place; the script's path."""
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script)] + extra + [p for p in sys.path[1:] if p not in extra]
    for entry in extra:  # Python's start-up imports the first sitecustomize on the path: ckpt-chaos's arms here
        boot = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(boot):
            import runpy

            runpy.run_path(boot, run_name="sitecustomize")
            break
    return script


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["serve"]:
        path = _become(serve(sys.argv[2]))
        import runpy

        runpy.run_path(path, run_name="__main__")
    else:
        raise SystemExit(__doc__)
