"""Nothing silently lost in the exports (issue 25): per-rank objects keep every rank's
value through ``bcp.open(...).state()``, ``to_torch`` and ``to_dcp`` (and a DCP load
on the saved world size gives each rank its own); checkpoints whose objects hold
tensors export to DCP; transformers' LambdaLR schedules survive DCP -> bcp and
bcp -> DCP; a DCP failure is one line and leaves the output as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import bcp
import dcp_jobs
import dist_jobs
from bcp.convert import from_dcp, rank_key, to_dcp, to_torch
from bcp.errors import ConversionError, CorruptCheckpointError, UnsupportedStateError
from helpers import examples

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


# -- 2 and 3 gloo ranks: a TrainingState with per-rank RNG and positions, a LambdaLR schedule --------


@pytest.fixture(scope="module", params=[(2, "cosine"), (3, "linear")], ids=["2-ranks-cosine", "3-ranks-linear"])
def saved(request, tmp_path_factory):
    """Saved on N ranks by bcp (a TrainingState) and by DCP; exported to DCP and
    imported from DCP in this process; (world, paths, references by rank)."""
    world, schedule = request.param
    d = tmp_path_factory.mktemp(f"per-rank-{world}")
    paths = {name: str(d / name) for name in ("bcp", "dcp", "exported", "imported", "ref")}
    os.makedirs(paths["ref"])
    dist_jobs.spawn(dcp_jobs.per_rank_save_job, world, schedule, paths["bcp"], paths["dcp"], paths["ref"])
    info = to_dcp(paths["bcp"], paths["exported"])
    assert info.per_rank == ("dataloader", "rng"), info
    from_dcp(paths["dcp"], paths["imported"])
    refs = [torch.load(f"{paths['ref']}/rank{r}.pt", weights_only=False) for r in range(world)]
    return world, schedule, paths, refs


def test_dcp_load_on_the_saved_world_size_gives_each_rank_its_own_and_the_schedules_round_trip(saved):
    world, schedule, paths, _refs = saved
    dist_jobs.spawn(
        dcp_jobs.per_rank_load_job, world, schedule, paths["exported"], paths["imported"], paths["ref"], paths["bcp"]
    )


def test_a_per_rank_object_in_a_subtree_is_never_given_from_one_rank_to_all(saved):
    """The template leaves the subtree empty; a load at another world size needs the hook."""
    world, _schedule, paths, _refs = saved
    with pytest.raises(UnsupportedStateError, match=rf"saved by {world} rank\(s\), is loaded by 1.*sub\.pos"):
        bcp.load({"sub": {}}, paths["bcp"] + "-sub")
    seen = []

    def hook(fqn, values, rank, world_size):
        seen.append((fqn, values, rank, world_size))
        return values[world - 1]

    assert bcp.load({"sub": {}}, paths["bcp"] + "-sub", reshard_objects=hook)["sub"]["pos"] == world - 1
    assert seen == [("sub.pos", {r: r for r in range(world)}, 0, 1)]


def test_open_state_keeps_every_ranks_value(saved):
    world, _schedule, paths, refs = saved
    state = bcp.open(paths["bcp"]).state()
    for key in ("dataloader", "rng"):
        assert isinstance(state[key], bcp.RankValues) and sorted(state[key]) == list(range(world))
    for r in range(world):
        assert state["dataloader"][r] == refs[r]["loader"] == {"pos": 1000 * (r + 1), "epoch": 0}
        assert torch.equal(state["rng"][r]["torch"], refs[r]["rng"]["torch"])
    assert len({bytes(state["rng"][r]["torch"].numpy()) for r in range(world)}) == world, "the ranks' RNGs differ"
    last = bcp.open(paths["bcp"]).state(per_rank=world - 1)
    assert last["dataloader"] == refs[world - 1]["loader"] and last["extra"] == {"step": dcp_jobs.STEPS}
    with pytest.raises(KeyError, match=r"'dataloader'.*saved by ranks \[0, 1.*\]"):
        bcp.open(paths["bcp"]).state(per_rank=world)
    with pytest.raises(UnsupportedStateError, match=r"'dataloader' holds a bcp\.RankValues"):
        bcp.save(state, paths["bcp"] + "-copy")  # every rank's values are not one rank's state


def test_to_torch_keeps_every_ranks_value_or_the_one_chosen(saved, tmp_path):
    world, _schedule, paths, refs = saved
    to_torch(paths["bcp"], str(tmp_path / "all.pt"))
    out = torch.load(tmp_path / "all.pt", weights_only=False)
    assert out["dataloader"] == {rank_key(r): refs[r]["loader"] for r in range(world)}
    assert list(out["rng"]) == [f"__rank_{r}__" for r in range(world)]
    assert torch.equal(out["rng"]["__rank_1__"]["torch"], refs[1]["rng"]["torch"])
    to_torch(paths["bcp"], str(tmp_path / "one.pt"), per_rank=1)
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    assert one["dataloader"] == refs[1]["loader"] and torch.equal(one["rng"]["torch"], refs[1]["rng"]["torch"])
    assert one["scheduler"] == refs[1]["sched"]


def test_the_cli_exports_per_rank_objects_and_says_so(saved, tmp_path, capsys):
    from bcp.cli import main

    world, _schedule, paths, refs = saved
    assert main(["convert", paths["bcp"], str(tmp_path / "all.pt"), "--to", "torch"]) == 0
    out = capsys.readouterr().out
    assert f"2 per-rank object(s), saved by {world} ranks" in out and "'__rank_<r>__'" in out, out
    assert main(["convert", paths["bcp"], str(tmp_path / "dcp"), "--to", "dcp", "--per-rank", str(world - 1)]) == 0
    assert f"saved rank {world - 1}'s value only: dataloader, rng" in capsys.readouterr().out
    template = {"dataloader": {"pos": -1, "epoch": -1}}
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # every DCP rank gets rank N's
    assert template["dataloader"] == refs[world - 1]["loader"]
    assert main(["convert", paths["bcp"], str(tmp_path / "x"), "--to", "dcp", "--per-rank", str(world)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'dataloader' was saved by ranks" in err and "(--per-rank)" in err
    assert not (tmp_path / "x").exists()
    # a usage error: one line, exit status 2 (docs/manager.md)
    assert main(["convert", paths["bcp"], str(tmp_path / "y"), "--to", "safetensors", "--per-rank", "0"]) == 2
    assert "--per-rank goes with --to torch and --to dcp" in capsys.readouterr().err


# -- one process ----------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_lambda_lr_schedule_survives_dcp_to_bcp_and_bcp_to_dcp(tmp_path, schedule):
    """The reported case: LambdaLR.state_dict() holds ``lr_lambdas: [{}, {}]`` (a
    functools.partial's empty __dict__ per group), which DCP does not record."""
    model, opt, sched = dcp_jobs.lambda_training(schedule, seed=0)
    for _ in range(3):
        opt.step()
        sched.step()
    state = {"model": model.state_dict(), "sched": sched.state_dict(), "step": 3}
    assert state["sched"]["lr_lambdas"] == [{}, {}]
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from_dcp(str(tmp_path / "dcp"), str(tmp_path / "bcp"))
    assert "lr_lambdas" not in bcp.open(str(tmp_path / "bcp")).state()["sched"], "DCP records no empty dict"
    _model, _opt2, sched2 = dcp_jobs.lambda_training(schedule, seed=1)
    loaded = bcp.load({"model": _model.state_dict(), "sched": sched2.state_dict(), "step": 0}, str(tmp_path / "bcp"))
    assert loaded["sched"] == state["sched"]
    sched2.load_state_dict(loaded["sched"])
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()

    bcp.save({"sched": sched, "model": model.state_dict()}, str(tmp_path / "native"))
    to_dcp(str(tmp_path / "native"), str(tmp_path / "back"))
    _model, _opt3, sched3 = dcp_jobs.lambda_training(schedule, seed=2)
    template = {"sched": sched3.state_dict(), "model": _model.state_dict()}
    dcp.load(template, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    sched3.load_state_dict(template["sched"])
    assert sched3.state_dict() == sched.state_dict()


def test_to_dcp_writes_the_tensors_inside_objects_of_a_training_state(tmp_path):
    """A TrainingState checkpoint: its RNG state holds a tensor (and a numpy array)."""
    model, opt, sched = dcp_jobs.lambda_training("cosine", seed=0)
    torch.manual_seed(5)
    bcp.TrainingState(model, opt, sched, dataloader=dcp_jobs.Position(7), extra={"step": 2}).save(str(tmp_path / "b"))
    saved_rng = torch.get_rng_state()
    info = to_dcp(str(tmp_path / "b"), str(tmp_path / "dcp"))
    assert info.per_rank == () and info.objects >= 4  # saved by one process: job-wide objects
    model2, opt2, sched2 = dcp_jobs.lambda_training("cosine", seed=1)
    fresh = bcp.TrainingState(model2, opt2, sched2, dataloader=dcp_jobs.Position(0), extra={"step": 0})
    state = fresh.state_dict()
    state = {k: v.value if isinstance(v, bcp.PerRank) else v for k, v in state.items()}
    torch.manual_seed(0)
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fresh.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), saved_rng) and fresh.dataloader.state_dict()["pos"] == 7
    assert fresh.extra == {"step": 2} and fresh.scheduler.state_dict() == sched.state_dict()


def test_a_dcp_failure_is_one_line_and_leaves_the_output_as_it_was(tmp_path):
    bcp.save({"w": torch.ones(1000), "step": 1}, str(tmp_path / "b"))
    out = tmp_path / "dcp"
    to_dcp(str(tmp_path / "b"), str(out))
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    data = next(p for p in (tmp_path / "b").rglob("*.bin"))
    with open(data, "r+b") as f:
        f.truncate(100)  # the read inside DCP's write fails
    with pytest.raises(ConversionError, match=r"PyTorch DCP could not write .*CorruptCheckpointError") as caught:
        to_dcp(str(tmp_path / "b"), str(out), overwrite=True)
    assert "\n" not in str(caught.value) and isinstance(caught.value.errors[0], CorruptCheckpointError)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before, "the old export was touched"
    template = {"w": torch.zeros(1000), "step": 0}
    dcp.load(template, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(template["w"], torch.ones(1000))

    proc = _cli("convert", str(tmp_path / "b"), str(tmp_path / "new"), "--to", "dcp")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "PyTorch DCP could not write" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists(), "a failed export left the directory it made"


def test_a_truncated_dcp_file_is_refused_before_dcp_reads_it(tmp_path):
    """Checked against the file's real size before DCP reads (it used to surface as
    DCP's own read failure, wrapped in a ConversionError): one line naming the file."""
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.name.endswith(".distcp"))
    data.write_bytes(data.read_bytes()[:50])
    with pytest.raises(CorruptCheckpointError, match=r"the file has 50 bytes") as caught:
        from_dcp(str(tmp_path / "dcp"), str(tmp_path / "out"))
    assert "\n" not in str(caught.value) and caught.value.file.endswith(data.name)
    assert not (tmp_path / "out").exists()


def test_the_cli_boundary_turns_any_checkpoint_exception_into_one_line(monkeypatch, capsys, tmp_path):
    """Whatever DCP call raises its BaseException, the CLI prints one line, exit 1."""
    from torch.distributed.checkpoint.api import CheckpointException

    import bcp.cli
    import bcp.convert

    def failing(*args, **kwargs):
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise CheckpointException("save failed", {0: (e, None), 1: (e, None)}) from None

    bcp.save({"w": torch.ones(2)}, str(tmp_path / "b"))
    monkeypatch.setattr(bcp.convert, "to_dcp", failing)
    assert bcp.cli.main(["convert", str(tmp_path / "b"), str(tmp_path / "d"), "--to", "dcp"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "PyTorch DCP failed: OSError: [Errno 28] No space left on device (rank 0; 1 more ranks failed)" in err


# -- DCP records no empty dict: a strict load puts back what the template has ---------------------------

empty_or_value = st.recursive(
    st.one_of(st.integers(-3, 3), st.text("xy", max_size=2), st.just({})),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
    ),
    max_leaves=6,
)


def _gaps_are_empty_dicts(value) -> bool:
    """No list item before the list's last recorded one holds nothing but is not ``{}``
    (the DCP import rebuilds such a gap as ``{}``, its only guess, and a load keeps it)."""
    from bcp.loader import holds_nothing

    if isinstance(value, dict):
        return all(_gaps_are_empty_dicts(v) for v in value.values())
    if isinstance(value, list):
        last = max((i for i, v in enumerate(value) if not holds_nothing(v)), default=-1)
        gaps_ok = all(v == {} for v in value[:last] if holds_nothing(v))
        return gaps_ok and all(_gaps_are_empty_dicts(v) for v in value)
    return True


@settings(max_examples=examples(25))
@given(value=empty_or_value)
def test_a_strict_load_of_a_dcp_import_gives_back_every_empty_dict(tmp_path_factory, value):
    assume(_gaps_are_empty_dicts(value))
    d = tmp_path_factory.mktemp("empty")
    state = {"w": torch.ones(2), "obj": {"kept": 1, "v": value}}
    dcp.save(state, checkpoint_id=str(d / "dcp"), no_dist=True)
    from_dcp(str(d / "dcp"), str(d / "bcp"))
    loaded = bcp.load({"w": torch.zeros(2), "obj": {"kept": 0, "v": value}}, str(d / "bcp"))
    assert loaded["obj"] == state["obj"]


def test_a_native_checkpoint_loads_as_saved(tmp_path):
    """bcp stores empty dicts: no stored value is replaced, and a template member is
    added only where the stored value lacks it and it holds nothing DCP records."""
    bcp.save({"obj": {"a": {}, "l": [{}, 1]}}, str(tmp_path / "b"))
    loaded = bcp.load({"obj": {"a": [{}], "l": [{"z": 5}, 0], "n": 2}}, str(tmp_path / "b"))
    assert loaded["obj"] == {"a": {}, "l": [{}, 1]}
    loaded = bcp.load({"obj": {"a": {}, "l": [{"z": {}}, 1, {}], "new": [{}]}}, str(tmp_path / "b"))
    assert loaded["obj"] == {"a": {}, "l": [{"z": {}}, 1, {}], "new": [{}]}


@pytest.mark.parametrize("choice", [-1, True, "one", 1.0])
def test_a_per_rank_choice_is_all_or_a_rank(tmp_path, choice):
    bcp.save({"w": torch.ones(2), "step": 1}, str(tmp_path / "b"))
    for export in (
        lambda: to_torch(str(tmp_path / "b"), str(tmp_path / "t.pt"), per_rank=choice),
        lambda: to_dcp(str(tmp_path / "b"), str(tmp_path / "dcp"), per_rank=choice),
        lambda: bcp.open(str(tmp_path / "b")).state(per_rank=choice),
    ):
        with pytest.raises(ValueError, match="per_rank must be 'all' or a saved rank"):
            export()
    assert not (tmp_path / "t.pt").exists() and not (tmp_path / "dcp").exists()
    assert bcp.open(str(tmp_path / "b")).state(per_rank=5)["step"] == 1, "a job-wide object is every rank's"
