"""The command line and the trace reader against hostile input: empty locations, a
user's gen-mine/, planted links, FIFOs and huge files in a trace directory, escape
codes in a trace, absurd --world values; and the size and speed formatters.

Commands run in this process (tests/cli_runner.py) except where a hang or the process
is what is checked (a FIFO in a trace directory)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import unicodedata

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.cli import main as cli_main
from bcp.cli.render import human, rate, safe
from bcp.metadata.manifest import reseal
from bcp.trace_report import TraceError, read_traces
from cli_runner import cli

#: a size or speed that reads as nothing: 0.0 MiB, 0.00 GB/s
ZERO = re.compile(r"(?<![\d.])0\.0+ (\w+/s|([KMGTPE]i)?B)")
STATE = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
EMPTY = ["", " ", "\t\n"]


def cli_process(*args: str, cwd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``bcp ARGS`` as users run it, in a child process (a hang ends at ``timeout``)."""
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )


@pytest.fixture
def in_process(monkeypatch):
    bcp_logger = logging.getLogger("bcp")
    monkeypatch.setattr(bcp_logger, "level", bcp_logger.level)
    return cli_main


def one_error_line(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _a_checkpoint_here(directory) -> set[str]:
    """The current directory as a victim: a checkpoint at its top plus a user's gen-mine/."""
    bcp.save(STATE, str(directory))
    (directory / "gen-mine").mkdir()
    (directory / "gen-mine" / "notes.txt").write_text("mine")
    return set(os.listdir(directory))


# -- the empty location -------------------------------------------------------------------------

CALLS = {
    "save": lambda u: bcp.save(STATE, u, overwrite=True),
    "async_save": lambda u: bcp.async_save(STATE, u, overwrite=True).wait(),
    "load": lambda u: bcp.load({"w": torch.zeros(3, 4), "step": 0}, u),
    "open": lambda u: bcp.open(u),
    "delete": lambda u: bcp.delete(u),
    "exists": lambda u: bcp.exists(u),
    "CheckpointManager": lambda u: bcp.CheckpointManager(u, async_save=False),
    "backend_for": backend_for,
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("uri", EMPTY)
def test_an_empty_uri_is_refused_by_every_call(tmp_path, monkeypatch, call, uri):
    before = _a_checkpoint_here(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is empty") as info:
        CALLS[call](uri)
    assert "\n" not in str(info.value)
    assert set(os.listdir(tmp_path)) == before and (tmp_path / "gen-mine" / "notes.txt").exists()


COMMANDS = [
    ["rm", "{}"],
    ["rm", "{}", "--force"],
    ["ls", "{}"],
    ["inspect", "{}"],
    ["verify", "{}"],
    ["gc", "{}"],
    ["bench", "{}"],
    ["trace", "{}"],
    ["convert", "{}", "out", "--to", "torch"],
    ["convert", "src", "{}", "--to", "bcp"],
    ["inspect", ".", "--layout", "{}"],
    ["conformance", "{}"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_an_empty_location_is_refused_by_every_command(tmp_path, monkeypatch, capsys, in_process, command):
    before = _a_checkpoint_here(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert in_process([part.format("") for part in command]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "is empty" in err
    assert set(os.listdir(tmp_path)) == before


# -- what delete and rm remove --------------------------------------------------------------------


def test_delete_leaves_a_users_gen_directory(tmp_path):
    uri = tmp_path / "ckpt"
    bcp.save(STATE, str(uri))
    (uri / "gen-mine").mkdir()
    (uri / "gen-mine" / "notes.txt").write_text("mine")
    assert bcp.delete(str(uri)) == ["gen-mine/notes.txt"]
    assert (uri / "gen-mine" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(uri)) == ["gen-mine"]


def test_rm_leaves_a_users_gen_directory_and_no_empty_directory(tmp_path):
    mine, bare = tmp_path / "mine", tmp_path / "bare"
    for uri in (mine, bare):
        bcp.save(STATE, str(uri))
    (mine / "gen-mine").mkdir()
    (mine / "gen-mine" / "notes.txt").write_text("mine")
    proc = cli("rm", str(mine))
    assert proc.returncode == 0 and "gen-mine/notes.txt" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(os.listdir(mine)) == ["gen-mine"] and (mine / "gen-mine" / "notes.txt").read_text() == "mine"
    proc = cli("rm", str(bare))
    assert proc.returncode == 0, proc.stderr
    assert not bare.exists()  # the directory it emptied is gone


def test_a_failed_convert_leaves_no_directory_it_created(tmp_path, capsys, in_process):
    src = tmp_path / "ckpt"
    bcp.save(STATE, str(src))
    (data,) = src.glob("gen-*/data/*.bin")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    for to in ("safetensors", "dcp"):
        dst = tmp_path / f"new-{to}" / "a" / "b"
        assert in_process(["convert", str(src), str(dst), "--to", to]) == 1
        one_error_line(capsys.readouterr().err)
        assert not (tmp_path / f"new-{to}").exists(), to


# -- bcp trace against a hostile directory ----------------------------------------------------------


def _trace(directory, rank: int = 0, *, kind: str = "save", label: str = "s1", nbytes: int = 3 << 20) -> None:
    doc = {
        "traceEvents": [
            {"name": kind, "ph": "X", "ts": 0.0, "dur": 2e6, "pid": rank, "tid": 1, "args": {"bytes": nbytes}},
            {"name": "write", "ph": "X", "ts": 0.0, "dur": 1e6, "pid": rank, "tid": 1, "args": {"bytes": nbytes}},
        ],
        "otherData": {"rank": rank, "kind": kind, "label": label, "uri": "/ckpt"},
    }
    (directory / f"{kind}-x.rank{rank}.json").write_text(json.dumps(doc))


def test_trace_does_not_write_through_a_planted_link(tmp_path, capsys, in_process):
    _trace(tmp_path)
    victim = tmp_path.parent / f"{tmp_path.name}-victim.txt"
    victim.write_text("precious")
    (tmp_path / "merged.json").symlink_to(victim)
    assert in_process(["trace", str(tmp_path)]) == 0
    assert victim.read_text() == "precious"
    merged = tmp_path / "merged.json"
    assert not merged.is_symlink() and json.loads(merged.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_trace_skips_a_fifo_and_a_link_to_dev_zero_without_hanging(tmp_path):
    _trace(tmp_path, 0)
    os.mkfifo(tmp_path / "save-x.rank1.json")
    (tmp_path / "save-x.rank2.json").symlink_to("/dev/zero")
    proc = cli_process("trace", str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "rank1.json" in warnings[0] and "not a regular file" in warnings[0]
    assert "rank2.json" in warnings[1] and "symbolic link" in warnings[1]
    assert "1 rank(s)" in proc.stdout


def test_trace_skips_a_file_over_the_limit(tmp_path, caplog):
    _trace(tmp_path, 0)
    with open(tmp_path / "save-x.rank1.json", "wb") as f:
        f.truncate(300 << 20)  # sparse: over the 256 MiB limit, costs no disk
    with caplog.at_level(logging.WARNING, logger="bcp.trace_report"):
        docs = read_traces(tmp_path)
    assert [d["otherData"]["rank"] for d in docs] == [0]
    assert any("rank1.json" in r.getMessage() and "limit" in r.getMessage() for r in caplog.records)
    with pytest.raises(TraceError, match="no trace files"):  # a limit below every file: none is read
        read_traces(tmp_path, max_file_bytes=100)


@pytest.mark.parametrize(
    "doc",
    [
        {"traceEvents": [], "otherData": {"rank": "zero"}},
        {"traceEvents": [{"name": "w", "ph": "X", "ts": "0", "dur": 1}]},
        {"traceEvents": [{"name": 5, "ph": "X", "ts": 0, "dur": 1}]},
        {"traceEvents": [{"name": "w", "ph": "X", "ts": 0, "dur": -1}]},
        {"traceEvents": [{"name": "w", "ph": "X", "ts": 0, "dur": 1, "args": {"bytes": "1"}}]},
        {"traceEvents": ["x"]},
        {"traceEvents": [], "otherData": []},
    ],
)
def test_trace_refuses_a_malformed_file_in_one_line(tmp_path, capsys, in_process, doc):
    (tmp_path / "save-x.rank0.json").write_text(json.dumps(doc))
    assert in_process(["trace", str(tmp_path)]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert "rank0.json" in err and "--debug" not in err


def test_trace_escapes_a_traces_strings(tmp_path, capsys, in_process):
    _trace(tmp_path, kind="\x1b[2Jsave", label="lab\x1b]0;owned\x07el")
    assert in_process(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2Jsave" in out and "lab\\x1b]0;owned\\x07el" in out


def test_trace_prints_speeds_as_people_read_them(tmp_path, capsys, in_process):
    _trace(tmp_path, nbytes=3 << 20)  # 3 MiB in 1 s of write, 2 s of save
    assert in_process(["trace", str(tmp_path), "--disk-gbps", "1"]) == 0
    out = capsys.readouterr().out
    assert "GB/s" not in out and not ZERO.search(out), out
    assert "3.0 MiB/s" in out and "1.5 MiB/s" in out and "953.7 MiB/s" in out, out


# -- inspect --layout --world ----------------------------------------------------------------------


@pytest.mark.parametrize("world", ["0", "65537", "100000000"])
def test_inspect_world_is_bounded(tmp_path, capsys, in_process, world):
    bcp.save(STATE, str(tmp_path / "ckpt"))
    assert in_process(["inspect", str(tmp_path / "ckpt"), "--layout", str(tmp_path / "w.png"), "--world", world]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "--world must be 1 to 65,536" in err
    assert not (tmp_path / "w.png").exists()


def test_inspect_collapses_readers_that_get_nothing(tmp_path, capsys, in_process):
    pytest.importorskip("matplotlib")
    bcp.save(STATE, str(tmp_path / "ckpt"))  # w has 3 rows
    png = tmp_path / "w.png"
    assert in_process(["inspect", str(tmp_path / "ckpt"), "--layout", str(png), "--world", "1000"]) == 0
    out = capsys.readouterr().out
    assert "readers 3-999: nothing" in out and out.count("nothing") == 1 and png.exists(), out


def test_layout_help_names_its_argument():
    proc = cli("inspect", "--help")
    assert "--layout PNG" in proc.stdout and "--world N" in proc.stdout, proc.stdout


# -- the formatters ------------------------------------------------------------------------------------

_SIZE = re.compile(r"^-?(\d+ B|\d+\.\d (KiB|MiB|GiB|TiB|PiB|EiB))$")
_FACTOR = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60}


@given(st.one_of(st.integers(min_value=0, max_value=2**66), st.floats(min_value=0, max_value=2**66)))
def test_human_reads_as_people_read_sizes(n):
    text = human(n)
    assert _SIZE.match(text), text
    number, unit = text.split()
    value = float(number)
    assert value < 1024 or unit == "EiB", text
    assert not (value == 0 and unit != "B"), text  # never 0.0 MiB
    back = value * _FACTOR[unit]
    assert math.isclose(back, n, rel_tol=0.05, abs_tol=0.5), (n, text)


@given(st.floats(min_value=0, max_value=1e15))
def test_rate_is_a_size_per_second(bps):
    text = rate(bps)
    assert text.endswith("/s") and _SIZE.match(text[:-2]) and not ZERO.search(text), text


def test_rate_of_nothing_known():
    assert rate(float("nan")) == "-" and rate(-1.0) == "-" and rate(float("inf")) == "-"


@given(st.text())
def test_safe_leaves_nothing_a_terminal_acts_on(text):
    shown = safe(text)
    acts = [ch for ch in shown if unicodedata.category(ch)[0] == "C" or unicodedata.category(ch) in ("Zl", "Zp")]
    assert acts == [], repr(shown)  # no control, format (bidi), line or paragraph separator is left
    if text.isprintable():
        assert shown == text


def test_bench_prints_speeds_as_people_read_them(tmp_path):
    proc = cli("bench", str(tmp_path / "b"), "--gib", "0.0005", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    assert "GB/s" not in proc.stdout and re.search(r"save \d+\.\d [KMG]iB/s, load \d+\.\d [KMG]iB/s", proc.stdout), (
        proc.stdout
    )


# -- inspect of an object whose repr fails -------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"$bcp": "tensor", "dtype": "bits1x8", "shape": [1], "v": "AA=="},  # no CPU op prints it
        {"$bcp": "tensor", "dtype": "float32", "shape": [1] * 1000, "v": "AAAAAA=="},  # repr recurses too deep
    ],
)
def test_inspect_shows_an_object_it_cannot_print_and_goes_on(tmp_path, capsys, in_process, value):
    """A value that decodes (a load returns it) but whose repr raises: inspect shows that
    object as one it cannot show, naming it, and every other entry as usual."""

    bcp.save({**STATE, "cfg": {"a": 1}}, str(tmp_path / "ck"))
    manifest = tmp_path / "ck" / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc["objects"]["cfg"][0]["value"] = value
    manifest.write_bytes(reseal(doc))
    assert in_process(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "cfg = <object 'cfg' cannot be shown: " in out and "step = 7" in out and "w " in out


def test_convert_of_a_checkpoint_without_tensors_to_safetensors_says_why(tmp_path, capsys, in_process):
    bcp.save({"step": 3}, str(tmp_path / "ck"))
    assert in_process(["convert", str(tmp_path / "ck"), str(tmp_path / "out"), "--to", "safetensors"]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert f"no tensors in {tmp_path / 'ck'}" in err and "holds tensors only" in err and "None" not in err
