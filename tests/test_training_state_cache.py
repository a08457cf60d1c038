"""TrainingState.state_dict()'s cache of get_state_dict's FQN mapping: after the
first call it does not call get_state_dict again, and whatever changes between
saves (a param group, the first step, the lr, a load, new parameters, FSDP2 unshard)
its result equals the uncached path's, with the live tensors."""

from __future__ import annotations

import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
import training_jobs
from helpers import examples

warnings.filterwarnings("ignore", message=".*set_vital.*")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def _step(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    model(torch.randn(5, 4)).pow(2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def assert_same_state(got: Any, want: Any, where: str = "", live: bool = True) -> None:
    """Equal structure and key order; tensors equal and (``live``) the same storage.
    An optimizer that has not stepped gives get_state_dict's dummy state: not live."""
    assert type(got) is type(want), where
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}", live)
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]", live)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        local_g = got.to_local() if hasattr(got, "to_local") else got
        local_w = want.to_local() if hasattr(want, "to_local") else want
        assert not live or local_g.data_ptr() == local_w.data_ptr(), f"{where}: not the live tensor"
        assert torch.equal(local_g, local_w), where
    else:
        assert got == want, where


def uncached(ts: bcp.TrainingState) -> dict[str, Any]:
    """The same objects through a fresh TrainingState: the full get_state_dict path."""
    return bcp.TrainingState(ts.model, list(ts.optimizers), ts.scheduler, rng=False).state_dict()


def test_after_the_first_call_get_state_dict_is_not_called_and_the_result_is_the_same():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, [opt])
    ts = bcp.TrainingState(model, opt, rng=False)
    from torch.distributed.checkpoint import state_dict as dsd

    with mock.patch.object(dsd, "get_state_dict", wraps=dsd.get_state_dict) as full:
        ts.state_dict()
        assert full.call_count == 1
        for _ in range(3):
            _step(model, [opt])
            got = ts.state_dict()
        assert full.call_count == 1, "later calls use the cache"
    assert_same_state(got, uncached(ts))


OPS = ["step", "group", "lr", "sched", "load", "new_param", "new_module", "swap_opt", "fresh_opt"]


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=7))
def test_every_call_equals_the_uncached_path_whatever_changed_between(ops):
    model = _model()
    opt = torch.optim.AdamW(list(model[0].parameters()) + list(model[1].parameters()), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ts = bcp.TrainingState(model, opt, sched, rng=False)
    saved = None
    for op in ops:
        if op == "step":
            _step(model, list(ts.optimizers))
        elif op == "group":
            if not any(model[2].weight is p for g in opt.param_groups for p in g["params"]):
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.01})
                _step(model, list(ts.optimizers))  # a load needs state for every parameter
        elif op == "lr":
            opt.param_groups[0]["lr"] *= 0.5
        elif op == "sched":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # before the first step: not what is tested
                sched.step()
        elif op == "load" and saved is not None:
            ts.load_state_dict(saved)
        elif op == "new_param":
            old = model[0].weight
            model[0].weight = torch.nn.Parameter(old.detach().clone())
            for o in ts.optimizers:
                for g in o.param_groups:
                    g["params"] = [model[0].weight if p is old else p for p in g["params"]]
                if old in o.state:
                    o.state[model[0].weight] = o.state.pop(old)
        elif op == "new_module":
            model.add_module(str(len(model)), torch.nn.Linear(2, 2))
        elif op == "swap_opt":
            opt = torch.optim.SGD(list(model[0].parameters()), lr=0.1, momentum=0.9)
            _step(model, [opt])
            ts.optimizers = (opt,)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            ts.scheduler = sched
        elif op == "fresh_opt":
            opt = torch.optim.AdamW(list(model[0].parameters()), lr=0.2)
            ts.optimizers = (opt,)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            ts.scheduler = sched
        stepped = all(o.state for o in ts.optimizers)
        got = ts.state_dict()
        assert_same_state(got, uncached(ts), op, live=stepped)
        saved = _clone(got) if len(model) == 3 else None


def _clone(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def test_each_save_of_a_cached_state_is_the_checkpoint_the_uncached_path_writes(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ts = bcp.TrainingState(model, opt, sched, rng=False)
    for i in range(3):
        _step(model, [opt])
        sched.step()
        ts.save(tmp_path / f"a{i}")
        bcp.TrainingState(model, opt, sched, rng=False).save(tmp_path / f"b{i}")
        loaded = []
        for name in ("a", "b"):
            m2 = _model()
            o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
            s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
            bcp.TrainingState(m2, o2, s2, rng=False).load(tmp_path / f"{name}{i}")
            loaded.append(_clone(bcp.TrainingState(m2, o2, s2, rng=False).state_dict()))
        assert_values_equal(loaded[0], loaded[1])
        assert_values_equal(loaded[0], _clone(uncached(ts)))


def assert_values_equal(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_values_equal(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_values_equal(g, w)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


def test_fsdp1_is_never_cached():
    """A model with FullyShardedDataParallel wrappers goes through get_state_dict each time."""
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, [opt])
    ts = bcp.TrainingState(model, opt, rng=False)
    with (
        mock.patch.object(FullyShardedDataParallel, "fsdp_modules", return_value=[]) as fsdp_modules,
        mock.patch.object(
            dsd, "get_state_dict", return_value=({"x": torch.zeros(1)}, {"state": {}, "param_groups": []})
        ) as full,
    ):
        fsdp_modules.return_value = [model]
        ts.state_dict()
        ts.state_dict()
        assert full.call_count == 2


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_fsdp2_cached_state_equals_the_uncached_path_on_two_ranks():
    dist_jobs.spawn(training_jobs.fsdp_cached_state_job, 2)
