"""A new user's first hour (issue 27): every wrong turn gets a clear answer.

A location without a manifest says what it is (a CheckpointManager root, checkpoints
further down, a save that never committed, unrelated files); options are refused on a
plain path and unknown or malformed ones on every URI form; ``file:/abs`` is a file
URI; a missing optional package names the extra that installs it; the version is
0.2.0 everywhere it is shown."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for, join_uri
from bcp.backends.memory import clear_memory_store
from bcp.cli import main as cli_main
from bcp.extras import EXTRAS, install_command, missing_extra, needs_extra
from bcp.metadata.keys import LATEST_KEY, MANIFEST_KEY, data_file_key, generation_name, step_name

ROOT = pathlib.Path(__file__).resolve().parents[1]


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "step": seed}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def memory_uri():
    store = f"fh{uuid.uuid4().hex[:10]}"
    yield f"memory://{store}"
    clear_memory_store(store)


# -- what a location without a manifest is ----------------------------------------------------


@pytest.fixture
def manager_root(tmp_path) -> str:
    root = str(tmp_path / "run")
    manager = bcp.CheckpointManager(root, async_save=False)
    for step in (3, 7):
        manager.save(step, small_state(step))
    # a crashed save of a later step: the newest *committed* one is still 7
    backend_for(root).write(f"{step_name(9)}/{data_file_key(generation_name('0a'), 0)}", b"junk")
    return root


@pytest.mark.parametrize("how", ["load", "open"])
def test_a_manager_root_names_its_newest_committed_step_and_load_latest(manager_root, how):
    call = (lambda: bcp.load(small_state(), manager_root)) if how == "load" else (lambda: bcp.open(manager_root))
    with pytest.raises(bcp.IncompleteCheckpointError) as e:
        call()
    text = str(e.value)
    assert "CheckpointManager root" in text and "never committed" not in text, text
    assert join_uri(manager_root, step_name(7)) in text and step_name(9) not in text, text
    assert f"bcp.CheckpointManager({manager_root!r}).load_latest(state)" in text, text
    # what the message says works
    assert bcp.load(small_state(), join_uri(manager_root, step_name(7)))["step"] == 7
    step, state = bcp.CheckpointManager(manager_root, async_save=False).load_latest(small_state())
    assert step == 7 and state["step"] == 7


def test_bcp_inspect_on_a_manager_root_is_one_line_and_fails(manager_root, capsys):
    code, out, err = run_cli(capsys, "inspect", manager_root)
    assert code == 1 and out == "", (code, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bcp inspect: "), err
    assert join_uri(manager_root, step_name(7)) in lines[0] and "load_latest" in lines[0], err


def test_a_manager_root_without_a_committed_step_says_there_is_nothing_yet(memory_uri):
    backend = backend_for(memory_uri)
    backend.write(LATEST_KEY, b'{"step": 1}')
    backend.write(f"{step_name(1)}/{data_file_key(generation_name('0a'), 0)}", b"junk")
    with pytest.raises(bcp.IncompleteCheckpointError, match=r"CheckpointManager root.*no committed step yet") as e:
        bcp.open(memory_uri)
    assert "load_latest(state) returns (None, state)" in str(e.value)


def test_a_directory_of_checkpoints_names_them(memory_uri):
    for name in ("a", "b", "c", "d"):
        bcp.save(small_state(), f"{memory_uri}/{name}")
    with pytest.raises(bcp.IncompleteCheckpointError) as e:
        bcp.load(small_state(), memory_uri)
    text = str(e.value)
    assert f"{memory_uri}/a, {memory_uri}/b, {memory_uri}/c and 1 more" in text, text
    assert "never committed" not in text and f"bcp ls {memory_uri}" in text, text


def test_a_directory_without_bcp_objects_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(bcp.IncompleteCheckpointError, match="nothing of a bcp checkpoint") as e:
        bcp.open(str(tmp_path))
    assert "never committed" not in str(e.value) and "CheckpointManager root" not in str(e.value)


def test_leftovers_of_a_save_still_say_it_never_committed(memory_uri):
    bcp.save(small_state(), memory_uri)
    backend_for(memory_uri).delete(MANIFEST_KEY)
    with pytest.raises(bcp.IncompleteCheckpointError, match="a save started there and never committed"):
        bcp.open(memory_uri)


def test_nothing_at_all_is_not_found(tmp_path):
    with pytest.raises(bcp.CheckpointNotFoundError, match="no checkpoint at"):
        bcp.open(str(tmp_path / "nothing"))


# -- options on paths and URIs ----------------------------------------------------------------


def test_a_question_mark_in_a_plain_path_is_refused_and_nothing_is_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for target in ("ck/opt?fsynk=false", "ck/opt?fsync=maybe", str(tmp_path / "abs?fsync=false")):
        with pytest.raises(ValueError, match=r"plain path, which takes no options") as e:
            bcp.save(small_state(), target)
        assert "file:///absolute/path?fsync=false" in str(e.value) and "storage_options" in str(e.value)
        assert re.search(r"options (fsynk|fsync)", str(e.value)), str(e.value)
    with pytest.raises(ValueError, match="takes no options"):
        bcp.save(small_state(), pathlib.Path("ck/p?q"))
    assert os.listdir(tmp_path) == []
    # the two ways the message gives work
    bcp.save(small_state(1), "ck/opt", storage_options={"fsync": False})
    assert backend_for("ck/opt", fsync=False).fsync is False
    uri = f"file://{tmp_path}/ck2?fsync=false"
    bcp.save(small_state(2), uri)
    assert bcp.load(small_state(), uri)["step"] == 2 and backend_for(uri).fsync is False


name_chars = st.characters(codec="utf-8", exclude_characters="/\x00", exclude_categories=("Cs",))


@given(head=st.text(name_chars, min_size=1, max_size=8), tail=st.text(name_chars, max_size=8))
def test_any_plain_path_with_a_question_mark_is_refused_and_any_other_is_itself(head, tail):
    path = f"/tmp/bcp-first-hour/{head}"
    with pytest.raises(ValueError, match="takes no options"):
        backend_for(f"{path}?{tail}")
    if "?" not in path:
        assert backend_for(path).root == os.path.abspath(path)


def test_file_uri_with_one_slash_is_the_absolute_path(tmp_path):
    one_slash = f"file:{tmp_path}/ck?fsync=false"
    assert one_slash.startswith("file:/") and not one_slash.startswith("file://")
    backend = backend_for(one_slash)
    assert backend.root == f"{tmp_path}/ck" and backend.fsync is False
    bcp.save(small_state(5), one_slash)
    assert bcp.load(small_state(), str(tmp_path / "ck"))["step"] == 5
    assert bcp.load(small_state(), f"file://{tmp_path}/ck")["step"] == 5
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing under ./file:
    with pytest.raises(ValueError, match="names an absolute path"):
        backend_for("file:relative/ck")
    with pytest.raises(ValueError, match="no #fragment"):
        backend_for(f"file://{tmp_path}/a#b")
    assert backend_for(f"file://{tmp_path}/a%3Fb").root == f"{tmp_path}/a?b"  # a '?' in a name, escaped


@pytest.mark.parametrize("uri", ["s3:/bucket/run", "gs:/bucket/run", "memory:/m/b", "fsspec+memory:/m/b"])
def test_a_known_scheme_with_a_slash_missing_is_refused(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scheme = uri.split(":", 1)[0]
    with pytest.raises(ValueError, match=f"looks like a {re.escape(scheme)}:// URI with a slash missing"):
        bcp.save(small_state(), uri)
    assert os.listdir(tmp_path) == []
    assert backend_for("./s3:/bucket").root == str(tmp_path / "s3:" / "bucket")  # the way out it names


def uri_forms(tmp_path) -> dict[str, str]:
    """One URI of each form every built-in backend is reached by (nothing is contacted:
    options are checked before a client is built)."""
    return {
        "file:///": f"file://{tmp_path}/f",
        "file:/": f"file:{tmp_path}/f",
        "memory": "memory://m/b",
        "fsspec+memory": "fsspec+memory://m/b",
        "fsspec+file": f"fsspec+file://{tmp_path}/g",
        "s3": "s3://bucket/run",
        "gs": "gs://bucket/run",
        "gcs": "gcs://bucket/run",
        "hdfs": "hdfs://namenode:8020/run",
        "webhdfs": "webhdfs://namenode:9870/run",
    }


FORMS = ["file:///", "file:/", "memory", "fsspec+memory", "fsspec+file", "s3", "gs", "gcs", "hdfs", "webhdfs"]


@pytest.mark.parametrize("form", FORMS)
def test_every_uri_form_refuses_an_unknown_option_naming_it(form, tmp_path):
    uri = uri_forms(tmp_path)[form]
    with pytest.raises(TypeError, match=r"unknown option\(s\) for the .* backend .*: fsynk") as e:
        backend_for(f"{uri}?fsynk=false")
    assert "false" not in str(e.value).split(": fsynk", 1)[1].split(";")[0]  # values are never shown
    with pytest.raises(TypeError, match="fsynk"):
        backend_for(uri, fsynk=False)  # the same through storage_options


MALFORMED = {
    "file:///": ("fsync", "maybe"),
    "file:/": ("direct", "perhaps"),
    "fsspec+memory": ("use_listings_cache", "maybe"),
    "fsspec+file": ("auto_mkdir", "sometimes"),
    "s3": ("concurrency", "many"),
    "gs": ("timeout", "soon"),
    "gcs": ("retries", "often"),
    "hdfs": ("replication", "x"),
    "webhdfs": ("retry_base_delay", "brief"),
}


@pytest.mark.parametrize("form", sorted(MALFORMED))
def test_every_uri_form_refuses_a_malformed_value_naming_the_option(form, tmp_path):
    name, value = MALFORMED[form]
    uri = uri_forms(tmp_path)[form]
    with pytest.raises(ValueError, match=rf"{name}='{value}'"):
        backend_for(f"{uri}?{name}={value}")


def test_a_plain_path_checks_its_storage_options_too(tmp_path):
    with pytest.raises(ValueError, match="fsync='maybe'"):
        backend_for(str(tmp_path / "p"), fsync="maybe")
    with pytest.raises(TypeError, match="fsynk; it takes direct, direct_reads, fsync"):
        backend_for(str(tmp_path / "p"), fsynk=False)


def test_fsspec_options_from_the_query_take_their_parameters_types():
    store = f"fh{uuid.uuid4().hex[:8]}"
    backend = backend_for(f"fsspec+memory://{store}/b?use_listings_cache=false&skip_instance_cache=true")
    fs = backend.unwrap().fs
    assert fs.dircache.use_listings_cache is False  # the text "false" would have been true


# -- optional packages and their extras ---------------------------------------------------------


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_extra_bcp_names_is_in_pyproject_and_the_readme():
    extras = pyproject()["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    (everything,) = extras["all"]
    in_all = re.fullmatch(r"bcp-checkpoint\[(.*)\]", everything).group(1).split(",")
    assert sorted(in_all) == sorted(set(extras) - {"all", "test", "lint"}), in_all
    for extra, modules in EXTRAS.items():
        packages = [re.split(r"[<>=\[]", req)[0] for req in extras[extra]]
        assert all(m in packages for m in modules), (extra, packages)
    for extra in [*in_all, "all"]:
        assert install_command(extra) in readme, extra
    assert any(req.startswith("pre-commit==") for req in extras["lint"])  # CONTRIBUTING's pre-commit install


def test_a_missing_safetensors_names_the_hf_extra(monkeypatch, tmp_path, capsys):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.delitem(sys.modules, "safetensors.torch", raising=False)
    from bcp import convert

    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'bcp-checkpoint[hf]'")) as e:
        convert.to_safetensors(uri, str(tmp_path / "out"))
    assert "'safetensors'" in str(e.value)
    code, _out, err = run_cli(capsys, "convert", uri, str(tmp_path / "out2"), "--to", "safetensors")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "pip install 'bcp-checkpoint[hf]'" in err and "Traceback" not in err


def test_a_missing_pytest_names_the_conformance_extra(tmp_path):
    script = (
        "import sys; sys.modules['pytest'] = None\n"
        "from bcp.cli import main\n"
        "sys.exit(main(['conformance', 'memory://x', '--quick']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("bcp conformance: ") and "pip install 'bcp-checkpoint[conformance]'" in lines[0]


def test_a_dataloader_without_state_names_statefuldataloader_and_the_extra(monkeypatch):
    model = torch.nn.Linear(2, 2)
    plain = torch.utils.data.DataLoader(list(range(4)))
    monkeypatch.setitem(sys.modules, "torchdata", None)
    with pytest.raises(TypeError, match="StatefulDataLoader") as e:
        bcp.TrainingState(model, dataloader=plain)
    assert "pip install 'bcp-checkpoint[dataloader]'" in str(e.value) and "DataLoader does not have both" in str(
        e.value
    )
    monkeypatch.delitem(sys.modules, "torchdata")
    if missing_extra("dataloader", "x") is None:  # installed: no install hint
        with pytest.raises(TypeError, match="StatefulDataLoader") as e:
            bcp.TrainingState(model, dataloader=plain)
        assert "pip install" not in str(e.value)


def test_needs_extra_lets_other_missing_modules_through():
    with pytest.raises(ModuleNotFoundError) as e, needs_extra("hf", "x"):
        import bcp_no_such_module_at_all  # noqa: F401
    assert "pip install" not in str(e.value) and e.value.name == "bcp_no_such_module_at_all"


# -- the version -----------------------------------------------------------------------------------


def test_the_version_is_0_2_0_and_inspect_shows_it_with_the_format(tmp_path, capsys):
    assert bcp.__version__ == "0.2.0"
    project = pyproject()
    assert project["dynamic"] == ["version"] and "version" not in project
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "\n## 0.2.0 (unreleased)\n" in changelog and changelog.index("## 0.2.0") < changelog.index("## 0.1.0")
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    assert bcp.open(uri).manifest.bcp_version == "0.2.0"
    code, out, _err = run_cli(capsys, "inspect", uri)
    assert code == 0 and "bcp 0.2.0 (format v2)" in out, out
    code, out, _err = run_cli(capsys, "inspect", uri, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["bcp_version"] == "0.2.0" and doc["format_version"] == 2
    code, out, _err = run_cli(capsys, "inspect", str(ROOT / "tests" / "golden" / "v1"))
    assert code == 0 and "(format v1)" in out, out
