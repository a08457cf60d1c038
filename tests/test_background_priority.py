"""bcp's background save threads run at a lower CPU priority (BCP_BACKGROUND_NICE),
the caller's thread keeps its own."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

import bcp
from bcp.coordination.priority import background_nice, lower_this_thread

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice_in_thread() -> int:
    seen: list[int] = []

    def run() -> None:
        lower_this_thread()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


@pytest.mark.parametrize(("value", "expected"), [(None, 10), ("0", 0), ("5", 5), ("40", 19), ("-3", 0), ("x", 10)])
def test_the_setting_is_clamped_and_an_invalid_one_is_the_default(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("BCP_BACKGROUND_NICE", raising=False)
    else:
        monkeypatch.setenv("BCP_BACKGROUND_NICE", value)
    assert background_nice() == expected


@linux_only
def test_only_the_background_thread_is_lowered(monkeypatch):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setenv("BCP_BACKGROUND_NICE", "7")
    assert _nice_in_thread() == min(19, base + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base, "the caller's thread is untouched"
    monkeypatch.setenv("BCP_BACKGROUND_NICE", "0")
    assert _nice_in_thread() == base


@linux_only
def test_an_async_saves_writers_run_lowered_and_the_save_is_exact(monkeypatch, tmp_path):
    monkeypatch.setenv("BCP_BACKGROUND_NICE", "4")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, int] = {}
    from bcp.io_scheduler import write_pipeline

    original = write_pipeline.WritePipeline._write_loop

    def spy(self) -> None:
        seen[threading.current_thread().name] = -1
        try:
            original(self)
        finally:
            seen[threading.current_thread().name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    monkeypatch.setattr(write_pipeline.WritePipeline, "_write_loop", spy)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    bcp.async_save(state, str(tmp_path / "ck")).wait()
    assert seen and all(v == min(19, base + 4) for v in seen.values()), seen
    assert torch.equal(bcp.load({"w": torch.zeros(1 << 16)}, str(tmp_path / "ck"))["w"], state["w"])
