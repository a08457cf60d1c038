"""bcp -> Hugging Face safetensors -> transformers -> bcp (issue 16): --dtype,
--rename and --config, checked with a real (tiny, random) Llama model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.convert import apply_renames, parse_rename, to_safetensors
from cli_runner import cli

transformers = pytest.importorskip("transformers")


def cli_process(*args: str) -> subprocess.CompletedProcess:
    """``bcp ARGS`` in a child process: for what only a real process shows (nothing
    printed but the one line); the other conversions run in this process (cli_runner)."""
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


TOKENS = torch.tensor([[1, 5, 9, 77, 3, 127, 64, 2]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A bcp checkpoint whose model sits under a wrapper's prefix ("backbone."), as a
    training script's wrapped module would name it, with optimizer state beside it."""
    d = tmp_path_factory.mktemp("hf")
    model = tiny_llama()
    config_path = d / "config.json"
    model.config.to_json_file(str(config_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": {f"backbone.{k}": v for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    bcp.save(state, str(d / "ckpt"))
    model.save_pretrained(str(d / "by-transformers"))  # the reference: the same model exported by transformers
    return str(d / "by-transformers"), str(d / "ckpt"), str(config_path)


@pytest.mark.parametrize(("dtype_flag", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_export_loads_in_transformers_with_identical_logits_and_comes_back(trained, tmp_path, dtype_flag, dtype):
    reference, ckpt, config = trained
    out = tmp_path / "hf"
    proc = cli(
        "convert", ckpt, str(out), "--to", "safetensors", "--model-only", "--dtype", dtype_flag,
        "--rename", r"^backbone\.=", "--config", config,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text()) == json.loads(Path(config).read_text())

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
    assert {p.dtype for p in hf.parameters()} == {dtype}
    # what transformers' own export gives at that dtype (it keeps the rotary buffers in fp32)
    expected = logits(transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=dtype).eval())
    assert torch.equal(logits(hf), expected)
    if dtype == torch.float32:
        assert torch.equal(expected, logits(tiny_llama())), "fp32: the trained model's own logits"

    back = tmp_path / "back"
    proc = cli("convert", str(out), str(back), "--to", "bcp")
    assert proc.returncode == 0, proc.stderr
    stored = bcp.open(str(back)).state()
    assert {t.dtype for t in stored.values()} == {dtype}, "the export's dtype is what comes back"
    again = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=dtype).eval()
    again.load_state_dict(stored, strict=True)
    assert torch.equal(logits(again), expected)


def test_dtype_casts_floating_tensors_only(tmp_path):
    state = {"w": torch.randn(4, 4), "ids": torch.arange(5), "mask": torch.tensor([True, False])}
    bcp.save(state, str(tmp_path / "ck"))
    to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"), dtype=torch.float16)
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["w"].dtype == torch.float16 and torch.equal(got["w"], state["w"].half())
    assert torch.equal(got["ids"], state["ids"]) and torch.equal(got["mask"], state["mask"])


def test_two_keys_renamed_to_one_name_is_an_error_naming_both(tmp_path):
    bcp.save({"a.weight": torch.ones(2), "b.weight": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(ValueError, match=r"'a\.weight' and 'b\.weight' to 'x\.weight'"):
        to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"), rename=[r"^[ab]\.=x."])
    assert not (tmp_path / "out").exists(), "nothing is written when the names collide"
    proc = cli_process(
        "convert", str(tmp_path / "ck"), str(tmp_path / "out"), "--to", "safetensors", "--rename", "^[ab]=x"
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "'a.weight'" in proc.stderr


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_a_config_that_is_not_a_json_object_is_refused_before_writing(tmp_path, content):
    bcp.save({"w": torch.ones(2)}, str(tmp_path / "ck"))
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=r"config .*config\.json"):
        to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"), config=str(tmp_path / "config.json"))
    assert not (tmp_path / "out").exists()


names = st.text(st.sampled_from("abc._0123"), min_size=1, max_size=12)


@given(name=names, old=st.sampled_from(["a", "b.", r"\d+", "^c"]), new=st.sampled_from(["", "x", "y."]))
def test_rules_apply_in_order_as_re_sub(name, old, new):
    import re

    rules = [parse_rename(f"{old}={new}"), parse_rename("x=z")]
    assert apply_renames(name, rules) == re.sub("x", "z", re.sub(old, new, name))


def test_a_rule_without_equals_or_with_a_bad_regex_is_refused():
    with pytest.raises(ValueError, match="not REGEX=REPLACEMENT"):
        parse_rename("model")
    with pytest.raises(ValueError, match="bad regular expression"):
        parse_rename("(=x")
