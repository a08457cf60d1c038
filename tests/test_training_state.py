"""bcp.TrainingState, Stateful objects in a state, bcp.dataloader and the RNG rule
when the world changes; multi-process jobs in tests/training_jobs.py."""

from __future__ import annotations

import pickle
import random
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
import dist_jobs
import training_jobs
from bcp.dataloader import ShardedSampler, reshard_dataloader_states, reshard_sampler_states
from bcp.training import derived_rng_state, reshard_per_rank, reshard_rng_states, rng_state
from helpers import examples

warnings.filterwarnings("ignore", message=".*set_vital.*")

distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


# -- multi-process: FSDP2 + AdamW + scheduler + StatefulDataLoader ---------------------


@pytest.fixture(scope="module")
def fsdp_training(tmp_path_factory):
    d = tmp_path_factory.mktemp("training")
    uri, ref = str(d / "ck"), str(d / "ref.pt")
    dist_jobs.spawn(training_jobs.save_training_job, 2, uri, ref)
    return uri, ref


@distributed
@pytest.mark.parametrize("world", [3, 1])
def test_fsdp2_training_state_saved_on_two_resumes_exactly(fsdp_training, world):
    uri, ref = fsdp_training
    dist_jobs.spawn(training_jobs.load_training_job, world, uri, ref)


@distributed
def test_fsdp2_optimizer_state_dict_mistake_is_refused_before_allocating(tmp_path):
    uri = str(tmp_path / "ck")
    dist_jobs.spawn(training_jobs.save_with_optimizer_state_dict_job, 2, uri)
    dist_jobs.spawn(training_jobs.load_with_optimizer_state_dict_job, 2, uri)
    # FSDP2 on a one-rank mesh: the same mistake, refused the same way
    dist_jobs.spawn(training_jobs.load_with_optimizer_state_dict_job, 1, uri)
    dist_jobs.spawn(training_jobs.load_plain_into_ddp_like_ranks_job, 2, uri)
    # one process, a plain model (no DTensor in the template): the same checkpoint loads
    model = dist_jobs.make_model()
    opt = torch.optim.AdamW(model.parameters())
    state = bcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, uri)
    opt.load_state_dict(state["optim"])
    assert opt.state_dict()["state"][0]["exp_avg"].shape == model[0].weight.shape


@distributed
def test_a_single_process_checkpoint_resumed_with_optimizer_state_dict_on_fsdp2_is_refused(tmp_path):
    """Saved unsharded, the optimizer's tensors would still come back plain and full
    size beside the DTensor parameters: the optimizer-state rule catches it."""
    uri = str(tmp_path / "ck")
    model = dist_jobs.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dist_jobs.train(model, opt, range(1), 0)
    bcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, uri)
    dist_jobs.spawn(training_jobs.load_with_optimizer_state_dict_job, 2, uri)


@distributed
def test_ddp_training_state_resumes_in_one_plain_process(tmp_path):
    """get_state_dict drops DDP's module. prefix: the same checkpoint fits a plain model."""
    uri, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(training_jobs.ddp_training_save_job, 2, uri, ref_path)
    assert "model.0.weight" in bcp.open(uri).keys()
    ref = torch.load(ref_path, weights_only=True)
    model = dist_jobs.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    extra = {"step": 0}
    bcp.TrainingState(model, opt, sched, extra=extra).load(uri)
    assert extra["step"] == 2 and sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.01 * 0.25
    assert torch.equal(torch.get_rng_state(), ref["rng"]), "one rank resumes with saved rank 0's RNG"
    for key, value in ref["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    for index, state in ref["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(opt.state_dict()["state"][index][key], value), (index, key)


def test_a_one_process_training_state_resumes_on_two_ranks_dealing_the_epoch(tmp_path):
    """Saved by one process, PerRank values (the dataloader's position, the RNG) are stored
    job-wide; loaded on two ranks they are dealt as one rank's: the rest of the epoch split
    between them and RNG states of their own (the one value went to both: a sampler
    error, or twin RNGs)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    n, batch = training_jobs.NUM_SAMPLES, training_jobs.BATCH
    loader = StatefulDataLoader(torch.arange(n), batch_size=batch, sampler=ShardedSampler(n, seed=5))
    batches = iter(loader)
    seen = [int(i) for _ in range(3) for i in next(batches)]
    uri = str(tmp_path / "ck")
    bcp.TrainingState(torch.nn.Linear(2, 2), dataloader=loader).save(uri)
    torch.save(seen, tmp_path / "seen.pt")
    dist_jobs.spawn(training_jobs.load_one_rank_save_on_more_job, 2, uri, str(tmp_path / "seen.pt"))


def test_a_per_rank_one_process_saved_needs_a_hook_on_two_ranks(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save({"rng": bcp.PerRank({"seed": 7}), "w": torch.ones(2)}, uri)
    dist_jobs.spawn(training_jobs.per_rank_without_a_hook_job, 2, uri)


@distributed
def test_tp_training_state_resumes_in_one_plain_process(tmp_path):
    uri, ref_path = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(training_jobs.tp_training_save_job, 2, uri, ref_path)
    ref = torch.load(ref_path, weights_only=True)
    model = dist_jobs.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    extra: dict = {}
    bcp.TrainingState(model, opt, extra=extra).load(uri)
    assert extra == {"step": 2}
    got = dist_jobs.full_reference(model, opt)
    for part in ("model", "optim"):
        want_t, got_t = dist_jobs.flatten_tensors(ref[part]), dist_jobs.flatten_tensors(got[part])
        assert set(want_t) == set(got_t) and want_t
        for key, value in want_t.items():
            assert torch.equal(got_t[key], value), key


# -- one process -------------------------------------------------------------------------


def _parts(seed: int = 0):
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = StatefulDataLoader(torch.arange(20), batch_size=3, sampler=ShardedSampler(20, seed=1))
    return model, opt, sched, loader


def _train(model, opt, sched, batches, steps: int) -> None:
    for _ in range(steps):
        next(batches)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_training_state_one_call_resume_continues_identically(tmp_path):
    model, opt, sched, loader = _parts()
    batches = iter(loader)
    _train(model, opt, sched, batches, 3)
    extra = {"step": 3}
    bcp.TrainingState(model, opt, sched, loader, extra).save(tmp_path / "ck")
    want_rand, want_py, want_np = torch.rand(4), random.random(), np.random.rand()
    want_batch = next(batches)

    model2, opt2, sched2, loader2 = _parts(seed=9)
    extra2 = {"step": 0}
    info = bcp.TrainingState(model2, opt2, sched2, loader2, extra2).load(tmp_path / "ck")
    assert not info.skipped
    assert extra2 == {"step": 3} and sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert torch.equal(torch.rand(4), want_rand) and random.random() == want_py and np.random.rand() == want_np
    assert torch.equal(next(iter(loader2)), want_batch)
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(opt2.state_dict()["state"][i][key], value), key
    assert torch.equal(model2[0].weight, model[0].weight)


def test_stateful_objects_anywhere_in_a_state_are_saved_and_loaded(tmp_path):
    model, opt, sched, _loader = _parts()
    _train(model, opt, sched, iter(range(5)), 2)
    bcp.save({"net": model, "nested": {"sched": sched, "note": "x"}}, tmp_path / "ck")
    assert "net.0.weight" in bcp.open(tmp_path / "ck").keys()

    model2, _opt2, sched2, _ = _parts(seed=3)
    caller_state = {"net": model2, "nested": {"sched": sched2, "note": ""}}
    out = bcp.load(caller_state, tmp_path / "ck")
    assert out["net"] is model2 and out["nested"]["sched"] is sched2 and out["nested"]["note"] == "x"
    assert caller_state["nested"]["note"] == "", "the caller's containers keep their objects"
    assert torch.equal(model2[0].weight, model[0].weight) and sched2.last_epoch == sched.last_epoch


class _Counter:
    """A Stateful holding a tensor; ``Outer`` returns one inside its own state_dict."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((3,), value)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]


class _Outer(_Counter):
    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.inner = _Counter(value * 10)

    def state_dict(self) -> dict:
        return {"t": self.t, "inner": self.inner}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]
        self.inner.load_state_dict(sd["inner"])


def test_a_stateful_inside_another_ones_state_dict_loads_through_the_outer_one(tmp_path):
    bcp.save({"obj": _Outer(1.0)}, tmp_path / "ck")
    target = _Outer(0.0)
    out = bcp.load({"obj": target}, tmp_path / "ck")
    assert out["obj"] is target
    assert torch.equal(target.t, torch.full((3,), 1.0)) and torch.equal(target.inner.t, torch.full((3,), 10.0))


def test_training_state_loads_into_a_plain_bcp_load_as_a_stateful(tmp_path):
    model, opt, sched, _ = _parts()
    _train(model, opt, sched, iter(range(5)), 1)
    bcp.save({"train": bcp.TrainingState(model, opt, sched, rng=False)}, tmp_path / "ck")
    model2, opt2, sched2, _ = _parts(seed=4)
    bcp.load({"train": bcp.TrainingState(model2, opt2, sched2, rng=False)}, tmp_path / "ck")
    assert torch.equal(model2[0].weight, model[0].weight) and sched2.last_epoch == 1


def test_training_state_under_a_checkpoint_manager_with_async_saves(tmp_path):
    model, opt, sched, loader = _parts()
    batches = iter(loader)
    extra = {"step": 0}
    job = bcp.TrainingState(model, opt, sched, loader, extra)
    manager = bcp.CheckpointManager(tmp_path / "run", keep_last=2, async_save=True)
    for step in range(3):
        _train(model, opt, sched, batches, 1)
        extra["step"] = step
        manager.save(step, {"train": job})
    manager.wait()
    want_weight = model[0].weight.detach().clone()
    model2, opt2, sched2, loader2 = _parts(seed=5)
    extra2: dict = {}
    step, _state = manager.load_latest(
        {"train": bcp.TrainingState(model2, opt2, sched2, loader2, extra2)}, reshard_objects=bcp.reshard_per_rank
    )
    assert step == 2 and extra2 == {"step": 2} and sched2.last_epoch == 3
    assert torch.equal(model2[0].weight, want_weight)


# -- a fresh run, and a save before the first step, change nothing ------------------------


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, cloned (the optimizer's step included)."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in opt.state_dict()["state"].items():
        out.update({f"optim.{index}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _plain_run(steps: int) -> dict[str, torch.Tensor]:
    model, opt, sched, loader = _parts()
    _train(model, opt, sched, iter(loader), steps)
    return _snapshot(model, opt)


@pytest.mark.parametrize("kind", ["training_state", "plain"])
def test_a_fresh_runs_load_latest_leaves_every_object_untouched(tmp_path, kind):
    """load_latest on an empty root returns (None, state) and changes nothing: the run
    then equals the same loop without bcp bit for bit (the optimizer's step 5, not 6)."""
    want = _plain_run(5)
    model, opt, sched, loader = _parts()
    if kind == "training_state":
        state: dict = {"train": bcp.TrainingState(model, opt, sched, loader)}
    else:
        state = {"model": model, "optim": opt, "sched": sched}
    manager = bcp.CheckpointManager(tmp_path / "run", async_save=True)
    step, out = manager.load_latest(state)
    assert step is None and out is state
    assert opt.state_dict()["state"] == {} and all(p.grad is None for p in model.parameters())
    _train(model, opt, sched, iter(loader), 5)
    got = _snapshot(model, opt)
    assert got["optim.0.step"] == 5
    _assert_same(got, want)


def test_saving_before_the_first_step_leaves_the_optimizer_fresh_and_resumes_bit_identical(tmp_path):
    """TrainingState.save before any optimizer step: no optimizer state appears (no
    dummy step survives), and a resume from that checkpoint, even into an optimizer
    that has stepped, continues exactly as the run that never stopped."""
    model, opt, sched, _loader = _parts()
    bcp.TrainingState(model, opt, sched).save(tmp_path / "ck")
    assert opt.state_dict()["state"] == {} and all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == 0.1
    _train(model, opt, sched, iter(range(4)), 4)
    want = _snapshot(model, opt)
    assert want["optim.0.step"] == 4

    model2, opt2, sched2, _loader2 = _parts(seed=9)
    _train(model2, opt2, sched2, iter(range(1)), 1)  # a stepped optimizer: the load empties it
    bcp.TrainingState(model2, opt2, sched2).load(tmp_path / "ck")
    assert opt2.state_dict()["state"] == {}
    assert all("bcp_unstepped" not in group for group in opt2.param_groups)
    _train(model2, opt2, sched2, iter(range(4)), 4)
    _assert_same(_snapshot(model2, opt2), want)


class _WithUnusedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)  # the head never gets a gradient

    def forward(self, x):
        return self.body(x)


def _steps(model, opt, n: int) -> None:
    for i in range(n):
        opt.zero_grad()
        model(torch.full((2, 4), float(i))).square().sum().backward()
        opt.step()


def test_a_parameter_that_never_had_a_gradient_resumes_into_a_fresh_optimizer(tmp_path):
    """AdamW keeps no state for a parameter that never got a gradient; a fresh run's
    template (torch's dummy step) has state for every one. The resume fits the template
    to the checkpoint: exact, with no state for the unused head (it raised a mismatch)."""
    model = _WithUnusedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 3)
    bcp.TrainingState(model, opt).save(tmp_path / "ck")
    _steps(model, opt, 2)
    want = _snapshot(model, opt)

    model2 = _WithUnusedHead()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    bcp.TrainingState(model2, opt2).load(tmp_path / "ck")
    assert len(opt2.state) == 2 and all(p not in opt2.state for p in model2.unused.parameters())
    _steps(model2, opt2, 2)
    _assert_same(_snapshot(model2, opt2), want)


@pytest.mark.parametrize("how", ["bcp.load", "load_latest"])
def test_a_never_gradded_parameter_resumes_through_bcp_load_and_the_manager_too(tmp_path, how):
    """The README's recipe (``load_latest({"train": TrainingState(...)})``) and ``bcp.load``
    of a state holding a TrainingState: the fitting of a fresh optimizer's template ran in
    TrainingState.load only, so these raised a StateMismatchError for the unused head."""
    model = _WithUnusedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 3)
    manager = bcp.CheckpointManager(tmp_path / "root", async_save=False)
    manager.save(3, {"train": bcp.TrainingState(model, opt)})
    _steps(model, opt, 2)
    want = _snapshot(model, opt)

    model2 = _WithUnusedHead()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    state = {"train": bcp.TrainingState(model2, opt2)}
    if how == "bcp.load":
        bcp.load(state, manager.uri(3))
    else:
        assert manager.load_latest(state)[0] == 3
    assert len(opt2.state) == 2 and all(p not in opt2.state for p in model2.unused.parameters())
    _steps(model2, opt2, 2)
    _assert_same(_snapshot(model2, opt2), want)


def test_a_rollback_into_a_stepped_optimizer_with_a_never_gradded_parameter(tmp_path):
    """Loading an earlier step into the running job (after a loss spike): torch's strict
    check refused its own state of a parameter with none, after the weights had been
    loaded (the scheduler and the rest not): a half-restored job."""
    model = _WithUnusedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _steps(model, opt, 3)
    sched.step()
    extra: dict = {"step": 3}
    bcp.TrainingState(model, opt, scheduler=sched, extra=extra).save(tmp_path / "ck")
    want = (_snapshot(model, opt), sched.state_dict())
    _steps(model, opt, 2)
    sched.step()
    extra["step"] = 5
    bcp.TrainingState(model, opt, scheduler=sched, extra=extra).load(tmp_path / "ck")
    _assert_same(_snapshot(model, opt), want[0])
    assert sched.state_dict() == want[1] and extra == {"step": 3}


def test_a_save_between_backward_and_the_first_step_loads_into_a_fresh_run(tmp_path):
    """Gradients present, no step yet (the first micro-batch of accumulation): torch
    skips its dummy step then, and the optimizer's state took another form than a
    fresh template's (a load failed). Saved in the usual form; the grads stay."""
    model, opt, sched, _loader = _parts()
    model(torch.ones(1, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    bcp.TrainingState(model, opt, sched).save(tmp_path / "ck")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert opt.state_dict()["state"] == {}
    model2, opt2, sched2, _loader2 = _parts(seed=9)
    bcp.TrainingState(model2, opt2, sched2).load(tmp_path / "ck")
    assert opt2.state_dict()["state"] == {} and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _assert_same(_snapshot(model2, opt2), _snapshot(model, opt))


def test_one_stepped_and_one_fresh_optimizer_each_resume_as_saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    first, second = (torch.optim.AdamW(layer.parameters(), lr=0.1) for layer in model)
    model(torch.randn(2, 4)).sum().backward()
    first.step()
    model.zero_grad(set_to_none=True)
    bcp.TrainingState(model, [first, second], rng=False).save(tmp_path / "ck")
    assert first.state and not second.state
    want = _snapshot(model, first)

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    first2, second2 = (torch.optim.AdamW(layer.parameters(), lr=0.1) for layer in model2)
    bcp.TrainingState(model2, [first2, second2], rng=False).load(tmp_path / "ck")
    assert not second2.state and first2.state
    _assert_same(_snapshot(model2, first2), want)


@distributed
def test_fsdp2_fresh_run_and_a_save_before_the_first_step_resume_bit_identical(tmp_path):
    dist_jobs.spawn(training_jobs.fresh_fsdp_resume_job, 2, str(tmp_path / "run"))


# -- RNG when the world changes ---------------------------------------------------------


def _saved_rngs(n: int) -> dict[int, dict]:
    states = {}
    for r in range(n):
        torch.manual_seed(r)
        random.seed(r)
        np.random.seed(r)
        states[r] = rng_state()
    return states


@settings(max_examples=examples(20), deadline=None)
@given(saved=st.integers(1, 5), world=st.integers(1, 9))
def test_rng_reshard_gives_every_rank_a_distinct_state(saved, world):
    values = _saved_rngs(saved)
    got = [reshard_rng_states(values, r, world) for r in range(world)]
    torch_states = {bytes(g["torch"].numpy()) for g in got}
    python_states = {repr(g["python"]) for g in got}
    assert len(torch_states) == world and len(python_states) == world
    for r in range(min(saved, world)):
        assert torch.equal(got[r]["torch"], values[r]["torch"]), "a rank that existed keeps its state"
    assert reshard_rng_states(values, world - 1, world)["python"] == got[-1]["python"], "deterministic"


def test_derived_rng_state_is_a_valid_state_for_every_generator():
    state = derived_rng_state(_saved_rngs(2), 5)
    bcp.training.set_rng_state(state)
    a = (torch.rand(3), random.random(), np.random.rand())
    bcp.training.set_rng_state(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_reshard_per_rank_refuses_objects_it_cannot_deal():
    with pytest.raises(bcp.UnsupportedStateError, match=r"'mine'.*reshard_objects"):
        reshard_per_rank("mine", {0: {"a": 1}, 1: {"a": 2}}, 2, 3)


# -- the sampler ------------------------------------------------------------------------


@settings(max_examples=examples(25), deadline=None)
@given(
    num=st.integers(0, 60),
    saved=st.integers(1, 5),
    world=st.integers(1, 6),
    progress=st.lists(st.integers(0, 15), min_size=5, max_size=5),
    epoch=st.integers(0, 3),
)
def test_sampler_reshard_loses_and_repeats_nothing(num, saved, world, progress, epoch):
    samplers = [ShardedSampler(num, r, saved, seed=7, epoch=epoch) for r in range(saved)]
    seen = []
    for s, n in zip(samplers, progress, strict=False):
        it = iter(s)
        seen += [next(it) for _ in range(min(n, len(s)))]
    states = {r: pickle.loads(pickle.dumps(s.state_dict())) for r, s in enumerate(samplers)}
    rest = []
    for r in range(world):
        s = ShardedSampler(num, r, world)
        s.load_state_dict(reshard_sampler_states(states, r, world))
        rest += list(s)
    assert sorted(seen + rest) == list(range(num))


def test_stateful_dataloader_state_reshards_to_more_ranks():
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(rank: int, world: int):
        return StatefulDataLoader(torch.arange(30), batch_size=4, sampler=ShardedSampler(30, rank, world, seed=2))

    saved = [loader(r, 2) for r in range(2)]
    seen = []
    for dl, n in zip(saved, (2, 3), strict=True):
        it = iter(dl)
        seen += [int(i) for _ in range(n) for i in next(it)]
    states = {r: dl.state_dict() for r, dl in enumerate(saved)}
    rest = []
    for r in range(3):
        dl = loader(r, 3)
        dl.load_state_dict(reshard_dataloader_states(states, r, 3))
        rest += [int(i) for batch in dl for i in batch]
    assert sorted(seen + rest) == list(range(30))


def test_sampler_refuses_a_state_of_another_world():
    with pytest.raises(ValueError, match="reshard_sampler_states"):
        ShardedSampler(10, 0, 3).load_state_dict(ShardedSampler(10, 0, 2).state_dict())


def test_the_unstepped_mark_is_in_what_bcp_saves_never_in_a_template():
    """A fresh optimizer's param groups carry the mark only when bcp takes the state to
    save it: in a template (state_dict() called by anyone else) it would be a key that a
    strict DCP load finds missing from a checkpoint of a stepped optimizer."""
    import torch.distributed.checkpoint as dcp

    from bcp.state import taking_for_save
    from bcp.training import UNSTEPPED_MARK

    model = torch.nn.Linear(4, 3)
    fresh = bcp.TrainingState(model, torch.optim.AdamW(model.parameters()), rng=False)
    template = fresh.state_dict()
    assert all(UNSTEPPED_MARK not in group for group in template["optim"]["param_groups"])
    with taking_for_save():
        saved = fresh.state_dict()
    assert all(group[UNSTEPPED_MARK] is True for group in saved["optim"]["param_groups"])
    stepped_model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(stepped_model.parameters())
    stepped_model(torch.ones(2, 4)).sum().backward()
    opt.step()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        dcp.save(bcp.TrainingState(stepped_model, opt, rng=False).state_dict(), checkpoint_id=d, no_dist=True)
        dcp.load(template, checkpoint_id=d, no_dist=True)  # strict: every template key is in the checkpoint
    assert torch.equal(template["optim"]["state"]["weight"]["exp_avg"], opt.state[stepped_model.weight]["exp_avg"])


def _unfreezing_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # frozen at the start, as a fresh run builds it
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train_unfreezing(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        model[0].requires_grad_(i >= 3)  # the first layer unfrozen from step 3
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize("strict", [True, False])
def test_a_layer_unfrozen_after_the_start_resumes_into_a_fresh_run_exactly(tmp_path, strict):
    """Progressive unfreezing: saved at step 5 with AdamW state for the first layer,
    loaded into a fresh run that builds it frozen. Its state is restored (a strict load
    used to refuse it as unexpected; strict=False dropped it) and the run goes on
    bit-identical; a checkpoint saved before the unfreezing gives it none."""
    model, optim = _unfreezing_run()
    _train_unfreezing(model, optim, range(5))
    bcp.TrainingState(model, optim).save(tmp_path / "unfrozen")
    resumed, resumed_optim = _unfreezing_run()
    bcp.TrainingState(resumed, resumed_optim).load(tmp_path / "unfrozen", strict=strict)
    assert resumed[0].weight in resumed_optim.state and not resumed[0].weight.requires_grad
    _train_unfreezing(model, optim, range(5, 9))
    _train_unfreezing(resumed, resumed_optim, range(5, 9))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    early, early_optim = _unfreezing_run()
    _train_unfreezing(early, early_optim, range(2))
    bcp.TrainingState(early, early_optim).save(tmp_path / "frozen")
    fresh, fresh_optim = _unfreezing_run()
    bcp.TrainingState(fresh, fresh_optim).load(tmp_path / "frozen")
    assert fresh[0].weight not in fresh_optim.state and len(fresh_optim.state) == 2


@pytest.mark.parametrize("cut", [0, 3, 8])  # 8: the end of the first epoch
def test_a_resume_with_a_stateful_dataloader_keeps_the_global_rng_in_step(tmp_path, cut):
    """A dropout model fed by a shuffling StatefulDataLoader, saved after ``cut`` steps
    and resumed in a fresh run that calls iter(loader) after the load, as
    docs/distributed.md does: every loss equals the uninterrupted run's (the new
    iterator's draw from the global RNG used to put the resumed run one draw off)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optim, StatefulDataLoader(data, batch_size=4, shuffle=True)

    def losses(model, optim, loader, n, it):
        out = []
        while len(out) < n:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                continue
            loss = model(batch).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            out.append(loss.item())
        return out, it

    model, optim, loader = make()
    whole, _ = losses(model, optim, loader, 20, iter(loader))
    model, optim, loader = make()
    first, _it = losses(model, optim, loader, cut, iter(loader)) if cut else ([], None)
    bcp.TrainingState(model, optim, dataloader=loader).save(tmp_path / "ckpt")
    model, optim, loader = make()
    bcp.TrainingState(model, optim, dataloader=loader).load(tmp_path / "ckpt")
    rest, _ = losses(model, optim, loader, 20 - cut, iter(loader))
    assert first + rest == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_the_set_epoch_idiom_resumes_mid_epoch_without_repeating(tmp_path, workers):
    """set_epoch(epoch) at the top of every epoch, as with DistributedSampler: after a
    resume mid-epoch it is called with the epoch the sampler is in, which must keep the
    resumed position (it restarted the epoch: 2 batches seen twice)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    uri, n, batch, epochs, cut = str(tmp_path / "ck"), 16, 4, 2, 2

    def run(resume: bool) -> list[list[int]]:
        sampler = ShardedSampler(n, rank=0, world_size=1, seed=3)
        loader = StatefulDataLoader(torch.arange(n), batch_size=batch, sampler=sampler, num_workers=workers)
        extra = {"epoch": 0, "step": 0}
        job = bcp.TrainingState(torch.nn.Linear(1, 1), dataloader=loader, extra=extra, rng=False)
        if resume:
            job.load(uri)
        seen = []
        for epoch in range(extra["epoch"], epochs):
            sampler.set_epoch(epoch)
            extra["epoch"] = epoch
            for ids in loader:
                seen.append(ids.tolist())
                extra["step"] += 1
                if not resume and extra["step"] == cut:
                    job.save(uri)
                    return seen
        return seen

    reference = ShardedSampler(n, rank=0, world_size=1, seed=3)
    expected = []
    for epoch in range(epochs):
        reference.set_epoch(epoch)
        ids = list(reference)
        expected += [ids[i : i + batch] for i in range(0, n, batch)]
    assert run(False) + run(True) == expected
    reference.set_epoch(1)  # the epoch it is in, run to its end: the next iteration starts it over
    assert list(reference) == ids


def test_a_grad_scaler_kept_in_extra_loads_into_itself(tmp_path):
    """extra's values were replaced by what was loaded: a GradScaler became a dict, and
    the job's own scaler kept its fresh scale."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    for _ in range(3):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    bcp.TrainingState(model, opt, extra={"scaler": scaler, "step": 3}).save(str(tmp_path / "ck"))
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    extra = {"scaler": fresh, "step": 0}
    bcp.TrainingState(torch.nn.Linear(2, 2), extra=extra).load(str(tmp_path / "ck"), strict=False)
    assert extra["scaler"] is fresh and extra["step"] == 3
    assert fresh.get_scale() == scaler.get_scale() == 8192.0


@pytest.mark.parametrize("groups", ["merged", "split"])
def test_a_load_into_other_parameter_groups_is_refused_not_given_other_hyperparameters(tmp_path, groups):
    """The same parameters in other groups: torch's set_optimizer_state_dict took them,
    and training went on with another group's lr and weight decay (or failed at the
    first step). A different set of parameters (a head added, loaded non-strictly) is
    not compared."""

    def job(grouping: str, head: bool = False) -> bcp.TrainingState:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), *([torch.nn.Linear(1, 1)] if head else [])
        )
        first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
        if grouping == "two":
            param_groups = [{"params": first, "lr": 1e-3, "weight_decay": 0.1}, {"params": rest, "lr": 5e-3}]
        elif grouping == "merged":
            param_groups = [{"params": first + rest, "lr": 5e-3}]
        else:
            param_groups = [{"params": first[:1]}, {"params": first[1:]}, {"params": rest}]
        opt = torch.optim.AdamW(param_groups, lr=1e-3)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return bcp.TrainingState(model, opt)

    uri = str(tmp_path / "ck")
    job("two").save(uri)
    with pytest.raises(bcp.UnsupportedStateError, match=r"parameter groups differ from the checkpoint's: it saved 2"):
        job(groups).load(uri)
    job("two").load(uri)  # the saved groups: loads
    job("two", head=True).load(uri, strict=False)  # other parameters: not compared
