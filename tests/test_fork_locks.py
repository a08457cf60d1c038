"""Module locks that a background thread takes (an async save's commit thread:
``bcp.incremental``'s kept-lookups lock; the thread starter's lock) are new in a forked
child: a fork while one is held would otherwise leave it held forever there, and the
child's first use would hang."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest


@pytest.mark.parametrize(
    ("module", "name"),
    [("bcp.incremental", "_kept_lock"), ("bcp.async_save", "_starter_lock"), ("bcp.async_save", "_slots_lock")],
)
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


def test_a_child_forked_while_the_staging_pool_is_locked_saves_with_a_pool_of_its_own(tmp_path):
    """A writer thread holds the process-wide staging pool's lock (releasing a slab) when
    another thread forks: the child's async save used to wait for it forever."""
    import torch

    import bcp
    from bcp.io_scheduler.staging import default_pool

    pool = default_pool()
    with pool._cond:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                state = {"x": torch.arange(10.0)}
                bcp.async_save(state, str(tmp_path / "child")).wait(timeout=20)
                loaded = bcp.load({"x": torch.zeros(10)}, tmp_path / "child")["x"]
                code = 0 if default_pool() is not pool and torch.equal(loaded, torch.arange(10.0)) else 1
            finally:
                os._exit(code)
        _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's save did not complete with its own pool"
