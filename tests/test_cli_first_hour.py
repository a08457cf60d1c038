"""What a new user meets first with the command line (issue "A new user's first hour"):
--version, one exit-status convention for every command (0 done, 1 missing or bad,
2 wrong command line, 130 interrupted), verify reporting each problem once and
checking every stored copy of a box, inspect showing any informative manifest value,
bench leaving nothing behind, exported files following the umask.

Most commands run in this process (``bcp.cli.main``: a subprocess costs seconds of
imports); the few that need a real process (``--version``, Ctrl-C) run as users run them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.cli import main
from bcp.commit import commit, write_catalog
from bcp.metadata import MANIFEST_KEY, Catalog
from bcp.metadata.keys import catalog_key, generation_name
from bcp.metadata.manifest import reseal
from bcp.save_phases import build_manifest, decide_objects, open_pipeline, prepare_save, stage
from bcp.verify import verify_checkpoint
from helpers import examples


def run(*argv: str) -> tuple[int, str, str]:
    """``bcp ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse: --version, usage errors
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def five_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "a": torch.randn(300, 64, generator=g),
            "b": torch.randn(64, generator=g),
            "c": torch.arange(50),
            "d": torch.ones(64, dtype=torch.bfloat16),
            "e": torch.randn(200, 64, generator=g),
        },
        "step": 7,
    }


@pytest.fixture
def saved(tmp_path) -> Path:
    root = tmp_path / "ck"
    bcp.save(five_tensors(), str(root))
    return root


def data_files(root: Path) -> list[Path]:
    return sorted(root.glob("gen-*/data/*"))


# -- --version ----------------------------------------------------------------------------------


def test_version_prints_the_version_and_exits_0():
    proc = cli("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"bcp {bcp.__version__}\n", "")


# -- the exit-status convention -----------------------------------------------------------------

MISSING_COMMANDS = {
    "ls": lambda p, tmp: ["ls", p],
    "inspect": lambda p, tmp: ["inspect", p],
    "verify": lambda p, tmp: ["verify", p],
    "rm": lambda p, tmp: ["rm", p],
    "gc": lambda p, tmp: ["gc", p],
    "convert": lambda p, tmp: ["convert", p, str(tmp / "out"), "--to", "safetensors"],
}


@pytest.mark.parametrize("command", sorted(MISSING_COMMANDS))
def test_a_missing_path_is_one_line_and_exit_1_for_every_command(tmp_path, command):
    missing = str(tmp_path / "no-such-dir")
    code, out, err = run(*MISSING_COMMANDS[command](missing, tmp_path))
    assert (code, out, err) == (1, "", f"bcp {command}: {missing}: no such file or directory\n")
    assert sorted(os.listdir(tmp_path)) == [], "a command on a missing path created something"


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "rm", "gc"])
def test_a_file_where_a_location_is_expected_is_exit_1(saved, command):
    path = str(saved / MANIFEST_KEY)
    assert run(command, path) == (1, "", f"bcp {command}: {path}: not a directory\n")


def test_an_empty_directory_lists_nothing_but_rm_finds_nothing_to_delete(tmp_path):
    empty = str(tmp_path)
    assert run("ls", empty) == (0, f"no checkpoints under {empty} (looked 3 levels deep)\n", "")
    assert run("rm", empty) == (1, "", f"bcp rm: nothing at {empty}\n")


def test_an_object_store_prefix_with_nothing_under_it_is_not_found(tmp_path):
    uri = f"memory://first-hour-{uuid.uuid4().hex[:8]}/nothing"
    for command in ("ls", "gc", "rm"):
        assert run(command, uri) == (1, "", f"bcp {command}: nothing at {uri}\n")
    code, out, err = run("inspect", uri)
    assert (code, out) == (1, "") and err.startswith(f"bcp inspect: no checkpoint at {uri}") and err.count("\n") == 1


USAGE_ERRORS = [
    (["gc", "{root}", "--min-age", "-1"], "bcp gc: --min-age must be >= 0, got -1"),
    (["gc", "{root}", "--keep-last", "0"], "bcp gc: --keep-last must be >= 1, got 0"),
    (["gc", "{root}", "--keep-every", "-2"], "bcp gc: --keep-every must be >= 1, got -2"),
    (
        ["convert", "{root}", "{out}", "--to", "torch", "--dtype", "bf16"],
        "bcp convert: --dtype, --rename and --config go with --to safetensors",
    ),
    (
        ["convert", "{root}", "{out}", "--to", "dcp", "--model-only"],
        "bcp convert: --to dcp keeps the state's nesting: select keys with --prefix, without --strip-prefix",
    ),
    (["convert", "{root}", "{out}", "--to", "safetensors", "--dtype", "fp7"], "bcp convert: --dtype: unknown dtype"),
    (
        ["convert", "{root}", "{out}", "--to", "safetensors", "--max-shard-size", "big"],
        "bcp convert: --max-shard-size='big' is not a size",
    ),
    (["convert", "{root}", "{out}", "--to", "dcp", "--batch-size", "x"], "bcp convert: --batch-size='x' is not a size"),
    (
        ["convert", "{root}", "{out}", "--to", "safetensors", "--rename", "noequals"],
        "bcp convert: --rename: rename rule 'noequals' is not REGEX=REPLACEMENT",
    ),
    (["convert", "{root}", "{out}", "--to", "bcp"], "bcp convert: the source is already a bcp checkpoint"),
    (["bench", "{out}", "--repeats", "0"], "bcp bench: --repeats must be >= 1, got 0"),
    (["bench", "{out}", "--gib", "0"], "bcp bench: --gib must be > 0, got 0"),
    # a location or option no store takes (the docs' "wrong arguments"), in every command that takes one
    (["ls", "s3:/bucket"], "bcp ls: 's3:/bucket' looks like a s3:// URI with a slash missing"),
    (["verify", "file:relative"], "bcp verify: 'file:relative': a file URI names an absolute path"),
    (["rm", "{root}?bogus=1"], "bcp rm: "),
    (["gc", "file://{root}?fsync=maybe"], "bcp gc: option fsync='maybe' is not a boolean"),
    (["inspect", "nosuch://x"], "bcp inspect: unknown storage scheme 'nosuch'"),
    (["convert", "{root}", "nosuch://x", "--to", "dcp"], "bcp convert: unknown storage scheme 'nosuch'"),
    (["bench", "file://{out}?bogus=1"], "bcp bench: unknown option(s) for the file backend"),
    (["conformance", "nosuch://x", "--quick"], "bcp conformance: unknown storage scheme 'nosuch'"),
    (["conformance", "memory://cf", "--quick", "-o", "bogus=1"], "bcp conformance: unknown option(s) for the memory"),
    (["conformance", "memory://cf", "--quick", "-o", "nokv"], "bcp conformance: --option needs KEY=VALUE, got 'nokv'"),
    (["inspect", "{root}", "--world", "2"], "bcp inspect: --world and --tensor go with --layout PNG"),
    (["inspect", "{root}", "--tensor", "w"], "bcp inspect: --world and --tensor go with --layout PNG"),
]


@pytest.mark.parametrize(("argv", "message"), USAGE_ERRORS, ids=[" ".join(a[:1] + a[2:]) for a, _m in USAGE_ERRORS])
def test_a_wrong_option_value_is_one_line_and_exit_2(saved, tmp_path, argv, message):
    out_dir = tmp_path / "out"
    code, out, err = run(*[a.format(root=saved, out=out_dir) for a in argv])
    assert (code, out) == (2, "") and err.startswith(message) and err.count("\n") == 1, err
    assert not out_dir.exists(), "a usage error wrote something"


@pytest.mark.parametrize("argv", [[], ["ls"], ["frobnicate"], ["ls", "x", "--no-such-option"]])
def test_argparse_usage_errors_are_exit_2_in_one_line(argv):
    code, out, err = run(*argv)
    assert (code, out) == (2, "") and err.startswith("bcp") and err.count("\n") == 1, err
    assert "--help)" in err and "usage:" not in err, err


# -- verify: each problem once ------------------------------------------------------------------

SUMMARY = re.compile(
    r"(OK|FAILED): (\d+) tensors; (\d+) of (\d+) stored fragment\(s\) \(([^)]*)\) read and matched their checksums "
    r"in [0-9.]+ s; (\d+) problem\(s\)"
)


def test_a_missing_data_file_is_one_problem_not_one_per_tensor(saved):
    (data,) = data_files(saved)
    key = data.relative_to(saved).as_posix()
    data.unlink()
    code, out, err = run("verify", str(saved))
    lines = out.splitlines()
    assert code == 1 and err == "" and len(lines) == 2, out
    assert lines[0] == f"PROBLEM data file '{key}' is missing"
    assert SUMMARY.fullmatch(lines[1]).groups() == ("FAILED", "5", "0", "5", "0 B", "1"), lines[1]


def test_a_truncated_data_file_is_one_problem(saved):
    (data,) = data_files(saved)
    size = data.stat().st_size
    os.truncate(data, 1000)
    key = data.relative_to(saved).as_posix()
    code, out, _err = run("verify", str(saved))
    assert code == 1 and out.splitlines()[:-1] == [
        f"PROBLEM data file '{key}' has 1000 bytes; the manifest says {size}"
    ], out


def test_a_flipped_byte_is_one_problem_naming_file_and_bytes(saved):
    (data,) = data_files(saved)
    at = bcp.open(str(saved)).meta("model.e").fragments[0].byte_offset + 300
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0x10
    data.write_bytes(raw)
    report = verify_checkpoint(str(saved))
    assert not report["ok"] and len(report["problems"]) == 1, report["problems"]
    (problem,) = report["problems"]
    assert f"file '{data.relative_to(saved).as_posix()}'" in problem and "tensor 'model.e'" in problem
    start, end = map(int, re.search(r"bytes \[(\d+), (\d+)\)", problem).groups())
    assert start <= at < end, problem
    assert report["fragments"] == 5 and report["fragments_ok"] == 4


# -- verify: every stored copy ------------------------------------------------------------------


def save_with_replicas(states: list[dict], uri: str, block: int = 64) -> None:
    """A save on len(states) simulated ranks where every rank writes every box it holds:
    the planner stores one copy of a replicated box, but the format allows several rows
    for one box (FORMAT.md, "replicas"), and a reader uses any one of them."""
    backend = backend_for(uri)
    options = bcp.SaveOptions(checksum_block_bytes=block)
    prepared = [prepare_save(s, r, False) for r, s in enumerate(states)]
    layouts = [p.layout for p in prepared]
    save_id = uuid.uuid4().hex[:16]
    gen = generation_name(save_id)
    frags, files = [], []
    for r, p in enumerate(prepared):
        items = [p.pieces[box] for box in layouts[r].boxes()]  # all of them, not plan_save's choice
        pipeline = open_pipeline(backend, r, save_id, items, options, stage_all=False)
        stage(pipeline)
        report = pipeline.finish()
        frags += report.fragments
        files += [report.file] if report.file else []
    catalog = write_catalog(backend, catalog_key(gen), Catalog(frags))
    objects = decide_objects([p.objects for p in prepared])
    manifest = build_manifest(save_id, catalog, frags, tuple(files), objects, len(states), options)
    commit(backend, manifest, overwrite=False)


REPLICATED = {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3)}


@pytest.fixture
def replicated(tmp_path) -> Path:
    root = tmp_path / "replicated"
    save_with_replicas([REPLICATED, REPLICATED], str(root))
    rows = bcp.open(str(root)).meta("w").fragments
    assert [(f.writer_rank, f.offsets, f.lengths) for f in rows] == [(0, (0, 0), (8, 8)), (1, (0, 0), (8, 8))]
    return root


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_verify_checks_every_copy_of_a_replicated_box(replicated, bad_rank):
    ok = verify_checkpoint(str(replicated))
    assert ok["ok"] and (ok["fragments"], ok["fragments_ok"], ok["bytes_read"]) == (4, 4, 2 * (256 + 12)), ok
    data = next(replicated.glob(f"gen-*/data/rank{bad_rank:05d}-*"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1  # in w's second 64-byte checksum block
    data.write_bytes(raw)
    # a load reads one copy; only the one verify reads every copy of could show the damage
    if bad_rank == 1:
        assert bcp.open(str(replicated)).read("w").equal(REPLICATED["w"])
    code, out, err = run("verify", str(replicated))
    lines = out.splitlines()
    assert code == 1 and err == "" and len(lines) == 2, out
    key = data.relative_to(replicated).as_posix()
    assert lines[0].startswith(f"PROBLEM CorruptCheckpointError: checksum mismatch in tensor 'w': file '{key}'")
    assert "bytes [64, 128)" in lines[0] and f"written by rank {bad_rank})" in lines[0], lines[0]
    assert SUMMARY.fullmatch(lines[1]).groups()[:4] == ("FAILED", "2", "3", "4"), lines[1]


def test_tied_weights_are_checked_once(tmp_path):
    shared = torch.randn(16, 16)
    bcp.save({"embed": shared, "head": shared}, str(tmp_path / "tied"))
    reader = bcp.open(str(tmp_path / "tied"))
    assert reader.meta("embed").fragments[0].byte_offset == reader.meta("head").fragments[0].byte_offset
    report = verify_checkpoint(str(tmp_path / "tied"))
    assert report["ok"] and (report["fragments"], report["bytes_read"]) == (1, 16 * 16 * 4), report


def test_large_fragments_are_read_in_bounded_pieces_with_the_progress_bar(tmp_path, monkeypatch):
    import bcp.io_scheduler.read_exec as read_exec
    import bcp.verify

    state = {"big": torch.randn(64, 64), "small": torch.randn(10), "other": torch.randn(32, 32)}
    root = tmp_path / "ck"
    bcp.save(state, str(root), checksum_block_bytes=256)
    monkeypatch.setattr(bcp.verify, "SLICE_BYTES", 1000)  # pieces of 768 bytes: 3 whole blocks
    largest: list[int] = []
    real = read_exec.execute_reads

    def spy(backend, plans, views, **kwargs):
        largest.append(sum(len(v) for v in views))
        return real(backend, plans, views, **kwargs)

    monkeypatch.setattr(bcp.verify, "execute_reads", spy)
    updates: list[int] = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total = total

        def update(self, n: int) -> None:
            updates.append(n)

        def close(self) -> None:
            pass

    report = verify_checkpoint(str(root), progress=Bar)
    total = sum(t.numel() * 4 for t in state.values())
    assert report["ok"] and report["bytes_read"] == total == sum(updates), report
    assert max(largest) <= 1000 and len(largest) >= total // 1000, largest
    data = data_files(root)[0]
    raw = bytearray(data.read_bytes())
    big = bcp.open(str(root)).meta("big").fragments[0]
    raw[big.byte_offset + 5000] ^= 4  # one block in the middle of a fragment read in many pieces
    data.write_bytes(raw)
    report = verify_checkpoint(str(root))
    assert (
        len(report["problems"]) == 1
        and f"[{big.byte_offset + 4864}, {big.byte_offset + 5120})" in (report["problems"][0])
    ), report["problems"]


@pytest.fixture(scope="module")
def replicated_for_flips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flips") / "ck"
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(6, 10, generator=g), "v": torch.randn(33, generator=g), "i": torch.arange(7)}
    save_with_replicas([state, state], str(root), block=32)
    return root


@settings(max_examples=examples(60))
@given(data=st.data())
def test_any_flipped_stored_byte_is_found_once_in_any_copy(replicated_for_flips, data):
    """Property: flip one byte of any data file. Inside a stored fragment (either copy):
    exactly one problem, naming that file and a byte range holding the byte; in the
    writers' padding (checksums do not cover it): verify passes."""
    root = replicated_for_flips
    files = data_files(root)
    path = data.draw(st.sampled_from(files))
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    key = path.relative_to(root).as_posix()
    stored = [
        f
        for fqn in ("w", "v", "i")
        for f in bcp.open(str(root)).meta(fqn).fragments
        if f.file == key and f.byte_offset <= at < f.byte_offset + f.nbytes
    ]
    raw[at] ^= 0x80
    path.write_bytes(raw)
    try:
        report = verify_checkpoint(str(root))
    finally:
        raw[at] ^= 0x80
        path.write_bytes(raw)
    if not stored:
        assert report["ok"], report["problems"]
        return
    assert len(report["problems"]) == 1, report["problems"]
    (problem,) = report["problems"]
    start, end = map(int, re.search(r"bytes \[(\d+), (\d+)\)", problem).groups())
    assert f"file '{key}'" in problem and start <= at < end, (at, problem)
    assert f"written by rank {stored[0].writer_rank})" in problem


# -- inspect: informative manifest values -------------------------------------------------------


def edit_manifest(root: Path, **fields) -> None:
    doc = json.loads((root / MANIFEST_KEY).read_bytes())
    for name, value in fields.items():
        if "." in name:
            outer, inner = name.split(".")
            doc[outer][inner] = value
        else:
            doc[name] = value
    (root / MANIFEST_KEY).write_bytes(reseal(doc))


def test_inspect_shows_a_tensor_bytes_that_is_not_a_number(saved):
    code, out, err = run("inspect", str(saved))
    assert (code, err) == (0, "") and "stats:" not in out
    assert out.splitlines()[2] == "  5 tensors, 125.8 KiB; 1 data file(s); 1 objects", out
    edit_manifest(saved, **{"stats.tensor_bytes": "lots"})
    code, out, err = run("inspect", str(saved))
    assert (code, err) == (0, ""), err
    lines = out.splitlines()
    assert lines[2] == "  5 tensors, 125.8 KiB; 1 data file(s); 1 objects"  # the catalog's sizes
    assert lines[3].startswith('  stats: {"tensors": 5, "fragments": 5, "tensor_bytes": "lots"'), lines[3]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
#: informative manifest fields (metadata/FORMAT.md) and the JSON type the format gives each
INFORMATIVE = {
    "created": str,
    "bcp_version": str,
    "torch_version": str,
    "user_metadata": dict,
    "stats": dict,
    "stats.tensors": object,
    "stats.fragments": object,
    "stats.tensor_bytes": object,
}


@pytest.fixture(scope="module")
def inspect_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect") / "ck"
    bcp.save(five_tensors(), str(root), metadata={"run": "first hour"})
    return root


@settings(max_examples=examples(150))
@given(
    field=st.sampled_from(sorted(INFORMATIVE)),
    value=JSON_VALUES | st.text() | st.dictionaries(st.text(), JSON_VALUES),
)
def test_inspect_shows_any_value_of_an_informative_field(inspect_root, field, value):
    """Property: any JSON value in an informative field of a valid (re-sealed) manifest.
    Of the field's JSON type: exit 0, one report (text and --json), never a traceback.
    Of another type: the manifest's reader refuses it, exit 1 and one line naming the field."""
    original = (inspect_root / MANIFEST_KEY).read_bytes()
    try:
        edit_manifest(inspect_root, **{field: value})
        code, out, err = run("inspect", str(inspect_root))
        jcode, jout, jerr = run("inspect", str(inspect_root), "--json")
    finally:
        (inspect_root / MANIFEST_KEY).write_bytes(original)
    assert "Traceback" not in err + jerr
    if not isinstance(value, INFORMATIVE[field]):
        assert (code, out) == (1, "") and err.count("\n") == 1 and field in err, err
        return
    assert (code, err, jcode, jerr) == (0, "", 0, ""), err + jerr
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {inspect_root}" and lines[2].startswith("  5 tensors, 125.8 KiB;"), out
    assert out.count("\ncheckpoint ") == 0 and len(lines) >= 10
    doc = json.loads(jout)
    outer, _, inner = field.partition(".")
    assert (doc[outer][inner] if inner else doc[outer]) == value


# -- bench ---------------------------------------------------------------------------------------


def test_bench_removes_the_directories_it_made(tmp_path):
    target = tmp_path / "new" / "deeper" / "bench"
    code, out, err = run("bench", str(target), "--gib", "0.005", "--repeats", "2")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and err == "", out + err
    assert lines[0].startswith("  run 1: save ") and lines[2].startswith(f"5.1 MiB through {target}, median of 2:")
    assert sorted(os.listdir(tmp_path)) == [], "bench left directories behind"


def test_bench_leaves_what_was_there_and_cleans_up_on_failure_and_ctrl_c(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, out, _err = run("bench", str(mine), "--gib", "0.002", "--repeats", "1")
    assert code == 0 and "iB/s" in out and "GB/s" not in out
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(bcp, "load", broken)
    target = tmp_path / "fails"
    code, _out, err = run("bench", str(target), "--gib", "0.002")
    assert code == 1 and err.startswith("bcp bench: disk on fire") and not target.exists(), err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bcp, "load", interrupted)
    assert run("bench", str(target), "--gib", "0.002") == (130, "", "bcp bench: interrupted\n")
    assert not target.exists()


def test_a_ctrl_c_during_the_scratch_deletion_finishes_it_then_stops(tmp_path, monkeypatch):
    """The interrupt that cut the real Ctrl-C run below short one time in three: it
    landed while the scratch checkpoint was being deleted, and the deletion stopped."""
    from bcp.benchmark import save_load

    cls = type(backend_for(str(tmp_path)))
    real, calls = cls.delete_prefix, []

    def interrupted_once(self, prefix):
        calls.append(prefix)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, prefix)

    monkeypatch.setattr(cls, "delete_prefix", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        save_load(str(tmp_path / "b"), gib=0.001, repeats=3)
    assert len(calls) == 2 and calls[0] == calls[1]  # the first run's deletion, finished once more
    assert not (tmp_path / "b").exists(), list((tmp_path / "b").rglob("*"))


def _sigint_as_from_a_shell() -> None:
    """(in the child, before exec) SIGINT at its default and unblocked, as a shell starts a
    command: an ignored or blocked SIGINT would be inherited from the test process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_bench_cleans_up_after_a_real_ctrl_c(tmp_path):
    target = tmp_path / "b"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bcp.cli", "bench", str(target), "--gib", "0.05", "--repeats", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_from_a_shell,
    )
    try:
        deadline = time.monotonic() + 120
        while not (target.exists() and any(target.iterdir())):  # a scratch checkpoint is being written
            assert proc.poll() is None and time.monotonic() < deadline, "bench never started"
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.endswith("bcp bench: interrupted\n"), err
    assert not target.exists(), list(target.rglob("*"))


# -- exported files follow the umask -------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_exported_files_get_the_mode_open_gives(saved, tmp_path, umask):
    from bcp import convert
    from bcp.convert.files import current_umask

    config = tmp_path / "config.json"
    config.write_text("{}")
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        reader = bcp.open(str(saved))
        convert.to_safetensors(reader, str(tmp_path / "shards"), max_shard_bytes=40_000, config=str(config))
        convert.to_safetensors(reader, str(tmp_path / "one"))
        convert.to_torch(reader, str(tmp_path / "state.pt"))
        convert.to_dcp(reader, str(tmp_path / "dcp"))
    finally:
        os.umask(old)
    files = [p for d in ("shards", "one", "dcp") for p in (tmp_path / d).iterdir()] + [tmp_path / "state.pt"]
    names = {p.name for p in files}
    assert {"model.safetensors.index.json", "config.json", "model.safetensors", ".metadata"} <= names
    assert any(n.startswith("model-00003-of-") for n in names), names
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_conformance_with_no_check_selected_is_a_usage_error():
    """pytest's own status 5 (nothing collected) used to be bcp's exit status, which the
    CLI documents no meaning for."""
    code, _out, err = run("conformance", f"memory://cf{uuid.uuid4().hex[:8]}", "--quick", "-k", "nothingmatches")
    assert code == 2 and err.strip().endswith("no check matches -k 'nothingmatches'"), err
