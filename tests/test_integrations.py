"""bcp.integrations with the real frameworks: Lightning's CheckpointIO and Accelerate's
save_state/load_state, resumed bit-identically on 1 and 2 gloo ranks
(tests/integration_jobs.py), and the optional extras."""

from __future__ import annotations

import collections
import importlib
import subprocess
import sys
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends.memory import clear_memory_store
from dist_jobs import spawn
from integration_jobs import accelerate_ranks_differ, accelerate_resume, assert_identical, lightning_resume

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

from bcp.integrations.lightning import LAYOUT_KEY, BcpCheckpointIO

_LEAF = st.one_of(
    st.integers(-(2**40), 2**40),
    st.text(max_size=5),
    st.floats(allow_nan=True),
    st.none(),
    st.booleans(),
    st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 4), st.sampled_from([torch.float32, torch.int8])),
)
_KEYS = st.text("ab.c/_0", min_size=1, max_size=4)


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(_KEYS, children, max_size=3),
        st.dictionaries(_KEYS, children, max_size=3).map(lambda d: collections.OrderedDict(reversed(d.items()))),
        st.dictionaries(st.integers(0, 9), children, max_size=3),
    )


@given(body=st.dictionaries(_KEYS, st.recursive(_LEAF, _containers, max_leaves=12), max_size=4))
def test_lightning_checkpoint_round_trip_is_exact(body):
    """Whatever nesting of dicts, OrderedDicts, lists, tuples, tensors and plain values
    Lightning hands over comes back the same: types, key order, values, bits."""
    store = f"l{uuid.uuid4().hex[:10]}"
    checkpoint = {"state_dict": collections.OrderedDict(w=torch.ones(2, 3)), "epoch": 3, **body}
    io = BcpCheckpointIO()
    try:
        io.save_checkpoint(checkpoint, f"memory://{store}/epoch=3.ckpt")
        assert_identical(checkpoint, io.load_checkpoint(f"memory://{store}/epoch=3.ckpt"))
        io.remove_checkpoint(f"memory://{store}/epoch=3.ckpt")
        assert not bcp.exists(f"memory://{store}/epoch=3.ckpt")
    finally:
        clear_memory_store(store)


def test_lightning_checkpoint_io_details(tmp_path):
    io = BcpCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 0}, path)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)  # ModelCheckpoint's save_last
    loaded = io.load_checkpoint(path, map_location="cpu")
    assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    with pytest.raises(ValueError, match=LAYOUT_KEY):
        io.save_checkpoint({LAYOUT_KEY: 1}, tmp_path / "x.ckpt")
    with pytest.raises(bcp.UnsupportedStateError, match="hyper_parameters"):
        io.save_checkpoint({"hyper_parameters": {"cls": object()}}, tmp_path / "y.ckpt")
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # already gone: nothing to do
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old.ckpt").write_bytes(b"torch.save")  # not bcp's: left, training goes on
    io.remove_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").read_bytes() == b"torch.save"


@pytest.mark.slow
def test_lightning_resume_single_device(tmp_path):
    lightning_resume(0, 1, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_lightning_resume_ddp(tmp_path, world):
    spawn(lightning_resume, world, str(tmp_path))


def test_accelerate_resume_single_process(tmp_path):
    store = f"a{uuid.uuid4().hex[:10]}"
    try:
        accelerate_resume(0, 1, str(tmp_path), f"memory://{store}")
    finally:
        clear_memory_store(store)


@pytest.mark.slow
def test_accelerate_resume_two_ranks(tmp_path):
    spawn(accelerate_resume, 2, str(tmp_path), str(tmp_path / "bcp"))


def test_accelerate_on_two_ranks_saves_what_differs_between_them(tmp_path):
    spawn(accelerate_ranks_differ, 2, str(tmp_path))


def test_import_bcp_imports_no_framework():
    code = (
        "import sys, bcp, bcp.integrations\n"
        "found = {'lightning', 'accelerate'} & set(sys.modules)\n"
        "assert not found, found"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_a_missing_framework_names_its_extra(monkeypatch, framework):
    for name in [m for m in sys.modules if m == framework or m.startswith(framework + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # as if not installed
    monkeypatch.delitem(sys.modules, f"bcp.integrations.{framework}", raising=False)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'bcp-checkpoint\[{framework}\]'"):
        importlib.import_module(f"bcp.integrations.{framework}")


def test_accelerate_enable_disable_and_mismatch(tmp_path):
    from accelerate import Accelerator

    from bcp.integrations.accelerate import disable, enable
    from integration_jobs import Counter

    acc = Accelerator(cpu=True)
    enable(acc, str(tmp_path))
    model = acc.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="automatic_checkpoint_naming is disabled"):
        acc.save_state()
    assert acc.save_state(str(tmp_path / "one")) == str(tmp_path / "one")
    assert bcp.exists(str(tmp_path / "one")) and not (tmp_path / "one" / "model.safetensors").exists()
    with bcp.open(str(tmp_path / "one")) as reader:
        assert "models.0.weight" in reader.tensor_keys()  # unwrapped names
    acc.register_for_checkpointing(Counter())  # one more object than the checkpoint holds
    with pytest.raises(RuntimeError, match="0 custom but 1 are prepared or registered"):
        acc.load_state(str(tmp_path / "one"))
    disable(acc)
    assert acc.save_state.__func__ is Accelerator.save_state
    del model


def test_accelerate_checkpoint_names_go_before_a_query_string():
    """A root with a query string (an S3 endpoint) keeps it at the end: the names land
    where ``saved_iterations`` lists them, not inside the query."""
    from bcp.integrations.accelerate import checkpoint_uri

    assert checkpoint_uri("s3://b/run?endpoint_url=http://h:9", 3) == (
        "s3://b/run/checkpoints/checkpoint_3?endpoint_url=http://h:9"
    )
    assert checkpoint_uri("/data/run/", 0) == "/data/run/checkpoints/checkpoint_0"
