"""Async saves over a process's life: commits in call order within one process, a child
forked with saves in flight, and a failed save nobody waited for reported at exit even
after later saves took its slot (docs/io.md, "Async saves")."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

import bcp


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_async_saves_of_one_process_commit_in_call_order(tmp_path):
    """A large save, then at once a small one to the same path (overwrite): the later
    call's state is what the path holds. Without a group the small one used to commit
    first, and the large one then replaced it."""
    path = tmp_path / "ckpt"
    large = {"x": torch.randn(12 << 20), "tag": "first"}
    small = {"x": torch.zeros(4), "tag": "second"}
    first = bcp.async_save(large, path, overwrite=True)
    second = bcp.async_save(small, path, overwrite=True)
    second.wait()
    assert first.done(), "the first call's commit comes before the second's"
    first.wait()
    loaded = bcp.open(path).state()
    assert loaded["tag"] == "second" and torch.equal(loaded["x"], small["x"])


def test_a_child_forked_with_a_save_in_flight_saves_and_exits(tmp_path):
    """The parent's save is in flight at the fork: the child's three saves and its exit
    complete (the child used to wait forever for the parent's save, which has no thread
    in it: at its third save, and in the exit hook)."""
    proc = _run(
        f"""
        import faulthandler, os, sys, warnings
        import torch, bcp
        root = {str(tmp_path)!r}
        handle = bcp.async_save({{"x": torch.randn(16 << 20)}}, os.path.join(root, "parent"))
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(60, exit=True)
            for i in range(3):
                state = {{"y": torch.arange(10.0) + i}}
                bcp.async_save(state, os.path.join(root, f"child{{i}}")).wait(timeout=30)
            sys.exit(0)  # the exit hook runs here
        handle.wait()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    assert proc.returncode == 0 and "child 0" in proc.stdout, proc.stdout + proc.stderr
    for i in range(3):
        assert torch.equal(bcp.load({"y": torch.zeros(10)}, tmp_path / f"child{i}")["y"], torch.arange(10.0) + i)


def test_a_failed_save_nobody_waited_for_is_reported_at_exit_after_later_saves(tmp_path):
    """A save fails in the background and is never waited for; two later saves take the
    in-flight slots. At exit the failure is still logged as an ERROR naming it (it used
    to be dropped with its slot)."""
    proc = _run(
        f"""
        import os, time, torch, bcp
        root = {str(tmp_path)!r}
        real = os.pwrite
        def full(fd, data, offset):
            raise OSError(28, "No space left on device (injected)")
        os.pwrite = full
        failed = bcp.async_save({{"x": torch.randn(1000)}}, os.path.join(root, "a"))
        while not failed.done():
            time.sleep(0.01)
        os.pwrite = real
        for i in range(2):
            bcp.async_save({{"x": torch.randn(1000)}}, os.path.join(root, f"b{{i}}")).wait()
        """
    )
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "never waited for" in line]
    assert len(errors) == 1 and f"{tmp_path}/a" in errors[0] and "No space left" in errors[0], proc.stderr


def test_a_ctrl_c_while_the_caller_stages_reaches_it_and_commits_nothing(tmp_path, monkeypatch):
    """KeyboardInterrupt in the caller's staging: async_save raises it at once and the
    save fails in its thread, nothing committed (it was parked for wait() only, and
    training went on)."""
    from bcp.io_scheduler.write_pipeline import WritePipeline

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(WritePipeline, "stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bcp.async_save({"w": torch.ones(8)}, tmp_path / "ckpt")
    monkeypatch.undo()
    importlib.import_module("bcp.async_save").wait_all()
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    bcp.async_save({"w": torch.ones(8)}, tmp_path / "after").wait()  # the next save is not held up
    assert torch.equal(bcp.load({"w": torch.zeros(8)}, tmp_path / "after")["w"], torch.ones(8))
