"""Module locks that a background thread takes (an async save's commit thread:
``bcp.incremental``'s kept-lookups lock; the thread starter's lock) are new in a forked
child: a fork while one is held would otherwise leave it held forever there, and the
child's first use would hang."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest


@pytest.mark.parametrize(("module", "name"), [("bcp.incremental", "_kept_lock"), ("bcp.async_save", "_starter_lock")])
def test_a_lock_held_at_fork_is_free_in_the_child(module, name):
    mod = importlib.import_module(module)
    lock = getattr(mod, name)
    with lock:  # as a commit thread holds it when another thread forks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process: the child only locks
            pid = os.fork()
        if pid == 0:  # the child: 0 if it took the lock within a second
            code = 1
            try:
                code = 0 if getattr(mod, name).acquire(timeout=1.0) else 1
            finally:
                os._exit(code)
        _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"{module}.{name} was still held in the forked child"
    assert not lock.locked()
