"""Lossless round trips between PyTorch DCP and bcp (issue 16): nesting rebuilt from
DCP's own metadata, and a streamed, memory-bounded export back to DCP."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

import bcp
import dcp_jobs
import dist_jobs
from bcp.convert import from_dcp, to_dcp
from bcp.errors import FormatError
from cli_runner import cli

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


# -- distributed: FSDP2 on 2 ranks, resumed on 2 and 3 ----------------------------------------------


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    """The same FSDP2 training state saved by DCP and by bcp on 2 ranks, and its reference."""
    d = tmp_path_factory.mktemp("both")
    paths = str(d / "dcp"), str(d / "bcp"), str(d / "ref.pt")
    dist_jobs.spawn(dcp_jobs.save_both_job, 2, *paths)
    return paths


def test_dcp_on_two_ranks_to_bcp_loads_strictly_on_three(saved_on_two_ranks, tmp_path):
    dcp_dir, _bcp_uri, ref = saved_on_two_ranks
    converted = str(tmp_path / "from-dcp")
    _info, skipped = from_dcp(dcp_dir, converted)
    assert skipped == []
    keys = set(bcp.open(converted).keys())
    assert {"optim.param_groups", "sched", "step"} <= keys, "DCP's flat keys were not nested back"
    dist_jobs.spawn(dcp_jobs.bcp_load_job, 3, converted, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_bcp_to_dcp_loads_in_dcp(saved_on_two_ranks, tmp_path, world):
    _dcp_dir, bcp_uri, ref = saved_on_two_ranks
    out = str(tmp_path / "to-dcp")
    info = to_dcp(bcp_uri, out)
    assert info.tensors == len(bcp.open(bcp_uri).tensor_keys()) and info.objects == 3
    dist_jobs.spawn(dcp_jobs.dcp_load_job, world, out, ref)


# -- one process: nesting, bounds, errors --------------------------------------------------------------


def _training_state(lr: float = 0.0022) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": lr / 2}], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "step": 11}
    return state, model, opt


def _fresh_template() -> dict:
    state, _model, _opt = _training_state(lr=0.5)
    for t in dist_jobs.flatten_tensors(state).values():
        t.zero_()
    state["step"] = 0
    return state


def test_the_reported_case_a_strict_load_gets_the_learning_rate_back(tmp_path):
    state, _model, _opt = _training_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from_dcp(str(tmp_path / "dcp"), str(tmp_path / "out"))
    loaded = bcp.load(_fresh_template(), str(tmp_path / "out"))  # strict
    assert [g["lr"] for g in loaded["optim"]["param_groups"]] == [0.0022, 0.0011]
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert loaded["sched"] == state["sched"] and loaded["step"] == 11
    dist_jobs.assert_equal_to_reference(loaded, state, "strict load after DCP -> bcp")


nested_values = st.recursive(
    st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=3), st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(extra=st.dictionaries(st.sampled_from(["a", "b", "cfg"]), nested_values, min_size=1, max_size=3))
def test_any_nesting_of_dicts_and_lists_survives_dcp_to_bcp_to_dcp(tmp_path_factory, extra):
    """DCP -> bcp keeps the nesting; bcp -> DCP gives DCP back what it saved (an empty
    dict aside: DCP records nothing for one, see the gap test below)."""
    d = tmp_path_factory.mktemp("nest")
    state = {"w": torch.arange(6.0).reshape(2, 3), "layers": [{"t": torch.ones(2) * i, "n": i} for i in range(2)]}
    state.update(extra)
    dcp.save(state, checkpoint_id=str(d / "dcp"), no_dist=True)
    from_dcp(str(d / "dcp"), str(d / "bcp"))
    rebuilt = bcp.open(str(d / "bcp")).state()
    kept = {k: v for k, v in extra.items() if not _has_empty_dict(v)}
    assert {k: rebuilt[k] for k in kept} == kept
    assert torch.equal(rebuilt["layers"][1]["t"], torch.ones(2)) and rebuilt["layers"][1]["n"] == 1

    to_dcp(str(d / "bcp"), str(d / "back"))
    template = {"w": torch.zeros(2, 3), "layers": [{"t": torch.zeros(2), "n": None} for _ in range(2)]}
    template.update({k: _blank(v) for k, v in kept.items()})
    dcp.load(template, checkpoint_id=str(d / "back"), no_dist=True)
    assert torch.equal(template["w"], state["w"]) and template["layers"][1]["n"] == 1
    assert {k: template[k] for k in kept} == kept


def _has_empty_dict(value) -> bool:
    if isinstance(value, dict):
        return not value or any(_has_empty_dict(v) for v in value.values())
    return isinstance(value, list) and any(_has_empty_dict(v) for v in value)


def _blank(value):
    """The same nesting with every leaf replaced, as a DCP load template."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    return "unset"


def test_an_empty_dict_inside_a_list_comes_back_from_dcp(tmp_path):
    state = {"layers": [{}, {"t": torch.ones(2)}], "w": torch.zeros(1)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from_dcp(str(tmp_path / "dcp"), str(tmp_path / "bcp"))
    rebuilt = bcp.open(str(tmp_path / "bcp")).state()
    assert rebuilt["layers"][0] == {} and torch.equal(rebuilt["layers"][1]["t"], torch.ones(2))


def test_to_dcp_holds_about_one_batch_at_a_time(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(40)}  # 1 KiB each, 40 KiB in all
    bcp.save({"model": tensors, "step": 3}, str(tmp_path / "b"))
    info = to_dcp(str(tmp_path / "b"), str(tmp_path / "dcp"), batch_bytes=4096)
    assert info.tensors == 40 and info.tensor_bytes == 40 * 1024
    assert info.peak_resident_bytes <= 4096 and info.peak_resident_tensors <= 4, info
    assert len([n for n in os.listdir(tmp_path / "dcp") if n.endswith(".distcp")]) == 10
    template = {"model": {k: torch.zeros(256) for k in tensors}, "step": 0}
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(template["model"][k], tensors[k]) for k in tensors) and template["step"] == 3


def test_a_tensor_larger_than_the_batch_is_a_batch_of_its_own(tmp_path):
    bcp.save({"big": torch.arange(4096.0), "small": torch.ones(4)}, str(tmp_path / "b"))
    info = to_dcp(str(tmp_path / "b"), str(tmp_path / "dcp"), batch_bytes=1024)
    assert info.peak_resident_tensors == 1 and info.peak_resident_bytes == 4096 * 4
    template = {"big": torch.zeros(4096), "small": torch.zeros(4)}
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(template["big"], torch.arange(4096.0)) and torch.equal(template["small"], torch.ones(4))


def test_to_dcp_refuses_a_non_empty_directory_and_overwrite_replaces_only_dcp_files(tmp_path):
    bcp.save({"w": torch.ones(3)}, str(tmp_path / "b"))
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "__9_0.distcp").write_bytes(b"stale")
    with pytest.raises(FileExistsError, match="not empty"):
        to_dcp(str(tmp_path / "b"), str(out))
    to_dcp(str(tmp_path / "b"), str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me" and not (out / "__9_0.distcp").exists()


def test_a_planner_path_that_does_not_spell_its_key_is_a_format_error(tmp_path):
    from bcp.convert.dcp_metadata import key_paths, read_metadata

    dcp.save({"a": {"b": torch.ones(2)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    metadata = read_metadata(str(tmp_path / "dcp"))
    assert key_paths(metadata, where="x") == {"a.b": (("d", "a"), ("d", "b"))}
    metadata.planner_data = {"a.b": ("a", "c")}
    with pytest.raises(FormatError, match=r"x: DCP planner_data for 'a.b'"):
        key_paths(metadata, where="x")
    metadata.planner_data = {"a.b": ("a", 10**9)}
    with pytest.raises(FormatError, match=r"'a\.b'"):
        key_paths(metadata, where="x")
    metadata.planner_data = None  # saved with flatten_state_dict=False: flat keys stay
    assert key_paths(metadata, where="x") == {"a.b": (("d", "a.b"),)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_the_cli_converts_both_ways_and_refuses_what_dcp_cannot_keep(tmp_path):
    """The conversions run in this process (tests/cli_runner.py: a child costs seconds of
    imports); the first refusal in a real process, whose stderr is the one line."""
    state, _model, _opt = _training_state()
    bcp.save(state, str(tmp_path / "b"))
    proc = cli("convert", str(tmp_path / "b"), str(tmp_path / "dcp"), "--to", "dcp", "--batch-size", "1KiB")
    assert proc.returncode == 0 and "wrote DCP checkpoint" in proc.stdout, proc.stderr
    template = _fresh_template()
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert template["optim"]["param_groups"] == state["optim"]["param_groups"] and template["step"] == 11
    dist_jobs.assert_equal_to_reference(template, state, "DCP load after bcp convert --to dcp")

    proc = cli("convert", str(tmp_path / "dcp"), str(tmp_path / "again"), "--to", "bcp")
    assert proc.returncode == 0, proc.stderr
    assert bcp.load(_fresh_template(), str(tmp_path / "again"))["sched"] == state["sched"]

    for run, extra in ((_cli, ["--model-only"]), (cli, ["--dtype", "bf16"])):
        proc = run("convert", str(tmp_path / "b"), str(tmp_path / "x"), "--to", "dcp", *extra)
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "x").exists()


def test_tensors_inside_a_tuple_reach_dcp(tmp_path):
    """DCP stores a tuple whole (pickled bytes), so its tensors are read, not placeholders."""
    state = {"w": torch.ones(3), "pair": (torch.arange(3), "label")}
    bcp.save(state, str(tmp_path / "b"))
    to_dcp(str(tmp_path / "b"), str(tmp_path / "dcp"))
    template = {"w": torch.zeros(3), "pair": None}
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(template["pair"][0], torch.arange(3)) and template["pair"][1] == "label"


def test_planner_data_that_puts_a_value_under_another_value_is_a_format_error(tmp_path):
    import pickle

    from bcp.convert.dcp_metadata import read_metadata

    src = tmp_path / "dcp"
    dcp.save({"a": torch.ones(2), "b": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    metadata = read_metadata(str(src))
    # entry "b" renamed "a.b" with the path ("a", "b"): it would sit inside the tensor "a"
    metadata.state_dict_metadata["a.b"] = metadata.state_dict_metadata.pop("b")
    metadata.planner_data = {"a": ("a",), "a.b": ("a", "b")}
    for index in list(metadata.storage_data):
        if index.fqn == "b":
            metadata.storage_data[dataclasses.replace(index, fqn="a.b")] = metadata.storage_data.pop(index)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(FormatError, match=r"planner_data puts 'a\.b' inside the value of 'a'"):
        from_dcp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_to_dcp_reads_each_batch_in_few_requests(tmp_path):
    import uuid

    from bcp.backends import backend_for
    from test_read_coalescing import CountingBackend

    layers = [{"w": torch.randn(33, 7), "b": torch.randn(7)} for _ in range(40)]
    uri = f"memory://to-dcp-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"layers": layers, "step": 4}, uri)
    counting = CountingBackend(backend_for(uri))
    reader = bcp.open(counting)
    counting.requests = 0
    info = to_dcp(reader, str(tmp_path / "dcp"))  # one batch: everything fits the default
    assert counting.requests <= 2, f"to_dcp issued {counting.requests} requests for {info.tensors} tensors"
    template = {"layers": [{"w": torch.zeros(33, 7), "b": torch.zeros(7)} for _ in range(40)], "step": 0}
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for got, saved in zip(template["layers"], layers, strict=True):
        assert torch.equal(got["w"], saved["w"]) and torch.equal(got["b"], saved["b"])
