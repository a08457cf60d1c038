"""async_save: returns once staged, training may mutate at once, errors surface in
wait(), two saves in flight do not corrupt each other, memory stays flat, and the
overlap mode stages optimizer-owned tensors during forward/backward."""

from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch

import bcp
from bcp.metadata import MANIFEST_KEY


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)} | {"step": seed}


def test_state_may_change_right_after_return(uri):
    state = state_of(1)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    handle = bcp.async_save(state, uri)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.fill_(float("nan"))
    info = handle.wait()
    assert handle.done() and info.tensors == 8 and handle.blocking_seconds <= info.seconds
    r = bcp.open(uri)
    for k, v in expected.items():
        assert torch.equal(r.read(k), v) if isinstance(v, torch.Tensor) else r.read(k) == v


def test_errors_are_raised_from_wait(tmp_path, monkeypatch):
    def broken(fd, data, offset):
        raise OSError(28, "No space left on device")

    handle = bcp.async_save(state_of(1), str(tmp_path / "ck"))
    handle.wait()
    monkeypatch.setattr(os, "pwrite", broken)
    handle = bcp.async_save(state_of(2), str(tmp_path / "ck2"))
    with pytest.raises(bcp.StorageError, match="No space left"):
        handle.wait()
    assert not (tmp_path / "ck2" / MANIFEST_KEY).exists()
    monkeypatch.undo()
    with pytest.raises(bcp.CheckpointExistsError):  # refused while planning, before returning
        bcp.async_save(state_of(3), str(tmp_path / "ck"))


def test_two_saves_in_flight_do_not_corrupt_each_other(uri_factory):
    a, b = state_of(1), state_of(2)
    ua, ub = uri_factory(), uri_factory()
    ha = bcp.async_save(a, ua)
    hb = bcp.async_save(b, ub)  # while a may still be writing
    for t in list(a.values()) + list(b.values()):
        if isinstance(t, torch.Tensor):
            t.zero_()
    hb.wait(), ha.wait()
    for u, seed in ((ua, 1), (ub, 2)):
        ref, r = state_of(seed), bcp.open(u)
        assert all(torch.equal(r.read(k), ref[k]) for k in ref if k != "step") and r.read("step") == seed


@pytest.mark.slow
def test_memory_stays_flat_over_50_async_saves(tmp_path):
    state = {f"w{i}": torch.randn(512, 512) for i in range(16)}  # 16 MiB
    proc = psutil.Process()
    rss = []
    for k in range(50):
        handle = bcp.async_save(state, str(tmp_path / f"s{k % 3}"), overwrite=True)
        for t in state.values():
            t.add_(1)
        handle.wait()
        if k in (9, 49):
            gc.collect()
            rss.append(proc.memory_info().rss)
    growth = rss[1] - rss[0]
    assert growth < 32 << 20, f"RSS grew {growth / 2**20:.1f} MiB between save 10 and save 50"
    # save k holds the state before its k+1-th increment; save 48 went to s0, save 49 to s1
    assert torch.allclose(bcp.open(str(tmp_path / "s1")).read("w0"), state["w0"] - 1)
    assert torch.allclose(bcp.open(str(tmp_path / "s0")).read("w0"), state["w0"] - 2)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.norm = torch.nn.BatchNorm1d(64)  # forward changes its running stats

    def forward(self, x):
        return self.norm(self.lin(x))


def test_overlap_checkpoint_holds_pre_step_values_while_training_runs_on(uri):
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(8, 64)).sum().backward()
    opt.step()
    snapshot = {
        "model": {k: v.clone() for k, v in net.state_dict().items()},
        "optim": {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state_dict()["state"].items()},
    }
    handle = bcp.async_save({"model": net.state_dict(), "optim": opt.state_dict()}, uri, overlap=opt)
    for _ in range(3):  # training runs on: forward changes BN stats, step changes weights and moments
        net(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    handle.wait()
    r = bcp.open(uri)
    for k, v in snapshot["model"].items():
        assert torch.equal(r.read(f"model.{k}"), v), f"model.{k} is not the pre-step value"
    for p, s in snapshot["optim"].items():
        for k, v in s.items():
            assert torch.equal(r.read(f"optim.state.{p}.{k}"), v), f"optim.state.{p}.{k} is not the pre-step value"
    assert not torch.equal(net.lin.weight, snapshot["model"]["lin.weight"]), "training did not run on"
    assert len(opt._optimizer_step_pre_hooks) == 0, (
        "the step pre-hook was not removed"
    )  # private-ok: test introspection


def test_sources_are_released_once_staged_while_the_write_goes_on(tmp_path, monkeypatch):
    """Memory the caller frees after async_save returns comes back at once, not when
    the save has written it."""
    import threading
    import weakref

    gate = threading.Event()
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):
        gate.wait(timeout=60)
        return real_pwrite(fd, data, offset)

    state = {f"w{i}": torch.randn(512, 512) for i in range(4)}  # 1 MiB each: chunks of their own
    expected = {k: v.clone() for k, v in state.items()}
    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    handle = bcp.async_save(state, str(tmp_path / "ck"))
    refs = [weakref.ref(t) for t in state.values()]
    del state
    gc.collect()
    assert not handle.done(), "the write should still be blocked"
    assert all(r() is None for r in refs), "the save still holds the caller's tensors"
    gate.set()
    handle.wait()
    monkeypatch.undo()
    r = bcp.open(str(tmp_path / "ck"))
    assert all(torch.equal(r.read(k), v) for k, v in expected.items())
