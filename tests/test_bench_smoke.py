"""The benchmark states (bench/shapes.py) are what they say, and each benchmark script
or option on them runs end to end at a tiny size and prints its rows (structure, never
speed: the figures are the lead's, measured on a quiet machine)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


shapes = _module("shapes")


def run(script: str, *args: str, timeout: float = 300) -> list[str]:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def run_here(script: str, *args: str, capsys, monkeypatch) -> list[str]:
    """``python bench/SCRIPT ARGS`` with its ``main()`` in this process: for the scripts
    whose own process only starts a fresh process per case and prints the table (the
    cases, where the measuring happens, still run in processes of their own), and for
    those that only save and load in their own process and print what they measured
    (nothing there depends on a fresh process); saves the seconds of one torch import."""
    module = _module(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *args])
    module.main()
    return capsys.readouterr().out.strip().splitlines()


def run_imported(script: str, *args: str, capsys, monkeypatch) -> list[str]:
    """:func:`run_here` for a script whose ranks start from bench/ranks.py's fork server:
    imported under its own name with bench/ on sys.path, which each rank (a fresh process
    given this process's sys.path) needs to find the script's functions. The fork server
    is this process's, shared with every multi-process test: started here, if no test has
    yet, with tests/dist_jobs.py's preload (what the script's would be, and more), so that
    the later tests' ranks find all of theirs imported."""
    import multiprocessing.forkserver

    import dist_jobs

    dist_jobs.fork_context()
    multiprocessing.forkserver.ensure_running()
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *args])
    module.main()
    return capsys.readouterr().out.strip().splitlines()


# -- bench/shapes.py ------------------------------------------------------------------------------


def test_transformer_state_is_laid_out_as_a_real_model_and_adamw_save_it():
    spec = shapes.transformer_spec(0.002, layers=2)
    state = shapes.transformer_state(0.002, layers=2)
    model = shapes.llama_module(spec)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    real_model, real_optim = model.state_dict(), opt.state_dict()
    assert list(state) == ["model", "optim"]
    assert [(k, v.shape) for k, v in state["model"].items()] == [(k, v.shape) for k, v in real_model.items()]
    assert list(state["optim"]["state"]) == list(real_optim["state"])
    for i, entry in real_optim["state"].items():
        mine = state["optim"]["state"][i]
        assert list(mine) == list(entry), i
        assert [(t.shape, t.dtype) for t in mine.values()] == [(t.shape, t.dtype) for t in entry.values()], i
    assert mine["step"].dim() == 0 and mine["step"].dtype == torch.float32
    assert state["optim"]["param_groups"] == [{**real_optim["param_groups"][0], "lr": 1e-4}]
    # every kind of tensor the issue names is there
    names = " ".join(state["model"])
    for part in ("embed_tokens", "q_proj.weight", "q_proj.bias", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert part in names, part
    for part in ("input_layernorm", "post_attention_layernorm", "model.norm.weight", "lm_head.weight"):
        assert part in names, part
    assert sum(1 for _ in shapes.tensors(state)) == spec.tensors() == 4 * len(real_model)
    assert shapes.nbytes(state) == spec.nbytes()


def test_the_documented_size_table_is_what_the_code_builds():
    docs = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    for row in shapes.size_table([1, 2, 4, 8]):
        assert row in shapes.__doc__, row
        assert row in docs, row
    for gib in (1, 2, 4, 8):
        spec = shapes.transformer_spec(gib)
        assert abs(spec.nbytes() / 2**30 - gib) / gib < 0.1, (gib, spec)
        assert spec.tensors() >= 400, spec  # hundreds of tensors, not 48


@given(st.integers(1, 3000), st.integers(0, 1 << 22))
def test_count_state_sizes_add_to_the_same_bytes_at_any_count(n, extra):
    total = 4 * n + extra
    sizes = shapes.count_sizes(total, n)
    assert len(sizes) == n and min(sizes) >= 1
    assert sum(sizes) * 4 == total // 4 * 4
    if n >= 50 and total // 4 >= 2000 * n:  # room for the spread: sizes of every magnitude
        assert max(sizes) / min(sizes) > 100


def test_count_state_and_equal_state():
    state = shapes.count_state(1 << 20, 100)
    assert len(state) == 100 and shapes.nbytes(state) == 1 << 20
    assert list(state)[:2] == ["layers.0.w0", "layers.0.w1"] and "layers.12.w3" in state  # dotted, as a model's
    assert len({t.numel() for t in state.values()}) > 50
    equal = shapes.equal_state(0.01, tensors=6)
    assert len(equal) == 6 and len({t.shape for t in equal.values()}) == 1
    with pytest.raises(ValueError, match="cannot make 10 float32 tensors"):
        shapes.count_sizes(12, 10)


def test_flatten_and_map_tensors_keep_the_nesting():
    state = shapes.transformer_state(0.002, layers=1)
    flat = shapes.flatten(state)
    assert "optim.state.0.exp_avg" in flat and "model.lm_head.weight" in flat
    assert len(flat) == sum(1 for _ in shapes.tensors(state))
    zeros = shapes.map_tensors(state, torch.zeros_like)
    assert zeros["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert all(not t.any() for t in shapes.tensors(zeros))


# -- the scripts, tiny ------------------------------------------------------------------------------


def tiny_peers(tmp_path, capsys, monkeypatch, *args: str) -> list[str]:
    """The lines ``peers.py`` prints for a tiny state with ``args``; no case failed."""
    lines = run_here(
        "peers.py",
        *("--gib", "0.004", "--repeats", "1", "--settle", "0", "--dir", str(tmp_path / "peers"), *args),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    assert "case failed" not in "\n".join(lines), lines
    return lines


@pytest.mark.slow
def test_peers_prints_a_table_per_shape_with_the_async_rows_beside_their_memcpy(tmp_path, capsys, monkeypatch):
    args = ("--async-calls", "1", "--save-pairs", "2", "--load-pairs", "2", "--only", "raw,bcp")
    lines = tiny_peers(tmp_path, capsys, monkeypatch, *args)
    out = "\n".join(lines)
    heads = [ln for ln in lines if ln.startswith("shape ")]
    assert [h.split(":")[0] for h in heads] == ["shape equal", "shape transformer"], heads
    assert re.search(r"shape transformer: \d+ tensors \(model \d+", heads[1]), heads[1]
    for table in out.split("\nshape ")[1:]:
        for row in ("raw O_DIRECT write", "memcpy into warm buffers", "bcp save", "bcp load (cold cache)"):
            assert f"| {row} " in table, row
        assert re.search(r"\| bcp async_save blocking \(first call\) .*x the memcpy into fresh memory time", table)
        assert re.search(r"\| bcp async_save blocking \(steady state\) .*x the memcpy into warm memory time", table)
        assert "| memcpy into fresh memory (beside async first call) " in table
        # the sync save against raw writes of the state's own memory, interleaved with it
        assert "| raw O_DIRECT write, one 64 MiB buffer reused " in table
        assert "| raw O_DIRECT read, one 64 MiB buffer reused " in table  # the read limit fills the state's shapes
        assert re.search(r"\| raw O_DIRECT write \(beside the bcp saves\) +\| +\d+\.\d+ \|", table), table
        assert re.search(r"\| bcp save +\|.*x the raw write speed beside it \(\d+\.\d+x the raw case's\)", table)
        # each cold load beside raw reads of its own files and a cold safetensors load, in rotation
        for row in ("raw read of bcp's files, O_DIRECT, 1 thread", "raw read of bcp's files, buffered, 4 threads"):
            assert re.search(rf"\| {re.escape(row)} \(beside\) +\| +\d+\.\d+ \|", table), row
        assert re.search(r"\| bcp load \(cold cache\) +\|.*x the faster raw read beside it \(", table), table
        assert re.search(r"\| safetensors load_file\+copy \(cold, beside bcp's\) .*x the faster raw read", table)
    assert not any((tmp_path / "peers").rglob("*")), "peers left files behind"


@pytest.mark.slow
def test_peers_memory_case_puts_each_in_memory_load_beside_its_limits_in_its_own_tensors(tmp_path, capsys, monkeypatch):
    """The in-memory loads beside the memcpy, the bare verified read into one buffer and
    the same into the state's own tensors (the load's destinations), with both ratios."""
    args = ("--rounds", "2", "--only", "memory", "--shm", str(tmp_path))
    out = "\n".join(tiny_peers(tmp_path, capsys, monkeypatch, *args))
    for table in out.split("\nshape ")[1:]:
        for where in ("page cache", "/dev/shm"):
            own = re.escape(f"the same into the state's tensors ({where})")
            assert re.search(rf"\| {own} +\| +\d+\.\d+ \|.*\(limit\) [0-9.]+x the memcpy beside it", table), table
        assert re.search(r"\| bcp load \(warm page cache\) .*x its verified preadv, [0-9.]+x into its tensors", table)


@pytest.mark.slow
def test_training_state_bench_prints_its_rows_and_last_line(capsys, monkeypatch):
    lines = run_imported(
        *("training_state_bench.py", "--layers", "1", "--d", "16", "--calls", "1", "--worlds", "2"),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    rows = [ln for ln in lines if ln.startswith(("| plain", "| FSDP2"))]
    assert [r.split("|")[1].strip() for r in rows] == ["plain, 1 process", "FSDP2, 2 ranks"], lines
    assert all(len(r.strip("|").split("|")) == 9 for r in rows), rows
    assert re.fullmatch(
        r"training_state_bench: plain -?[0-9.]+ ms/1000 tensors, fsdp2 -?[0-9.]+ ms/1000 tensors \(target 5\)",
        lines[-1],
    ), lines[-1]


@pytest.mark.slow
def test_tensor_count_scale_prints_each_count_and_the_ratio(tmp_path, capsys, monkeypatch):
    lines = run_here(
        "tensor_count_scale.py",
        *("--gib", "0.001", "--counts", "10,100", "--repeats", "1", "--calls", "1", "--dir", str(tmp_path)),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    counts = [ln.split("|")[1].strip() for ln in lines if ln.startswith("| ") and "GB/s" in ln]
    assert counts == ["10", "100"], lines
    assert any(ln.startswith("| 100 / 10 |") for ln in lines), lines
    assert re.fullmatch(
        r"tensor_count_scale: save [0-9.]+x, async [0-9.]+x, load [0-9.]+x \(target 1\.3x\)", lines[-2]
    ), lines[-2]
    # the same bytes through peers, beside (what a tensor costs them), and the load's limit
    beside = r"peers beside: safetensors [0-9.]+x, torch [0-9.]+x, copy [0-9.]+x, raw ([0-9.]+|nan)x, verified [0-9.]+x"
    beside += r", verified_own [0-9.]+x"  # the same into the state's own tensors
    assert re.fullmatch(beside, lines[-1]), lines[-1]
    assert any("| safetensors load_file+copy (page cache) s |" in ln for ln in lines), lines
    assert any("| bare verified read of each tensor (page cache) s |" in ln for ln in lines), lines
    assert list(tmp_path.iterdir()) == [], "the scratch directory was left behind"


@pytest.mark.slow
def test_tensor_count_scale_times_the_load_row_alone(tmp_path, capsys, monkeypatch):
    """Failed before (no --cases): the load row alone, after one untimed save."""
    lines = run_here(
        "tensor_count_scale.py",
        *("--gib", "0.001", "--counts", "10,100", "--repeats", "1", "--calls", "1", "--dir", str(tmp_path)),
        *("--cases", "load"),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    assert any(ln.startswith("| tensors | bcp.load (page cache) s |") for ln in lines), lines
    assert re.fullmatch(r"tensor_count_scale: load [0-9.]+x \(target 1\.3x\)", lines[-1]), lines[-1]
    assert list(tmp_path.iterdir()) == [], "the scratch directory was left behind"


@pytest.mark.slow
def test_gpu_bench_transformer_shape_runs_on_the_cpu(tmp_path):
    lines = run(
        "gpu_bench.py",
        *("--device", "cpu", "--shape", "transformer", "--gib", "0.004", "--repeats", "1", "--no-loop"),
        *("--dir", str(tmp_path / "gpu")),
    )
    out = "\n".join(lines)
    assert re.search(r"state: transformer: \d+ float32 tensors", out), out[:2000]
    for row in ("bcp save", "bcp async_save blocking (steady)", "DCP save", "torch.save + fsync"):
        assert re.search(rf"^{re.escape(row)} +[0-9.]+", out, re.M), row
    assert not (tmp_path / "gpu").exists()


# bench/tier_bench.py's smoke run on the transformer shape: tests/test_tier_bench.py
# (one run serves all its tests)


def test_traces_prints_each_case_as_a_table_with_its_stages(tmp_path, capsys, monkeypatch):
    """bench/traces.py at a tiny size, in this process: a table per case, each with the
    stages that case goes through, every row with its seconds, bytes, GB/s, share and
    bound; nothing left behind."""
    traces = _module("traces")
    (tmp_path / "disk").mkdir()
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(
        sys, "argv", ["traces.py", "--gib", "0.002", "--dir", str(tmp_path / "disk"), "--shm", str(tmp_path / "shm")]
    )
    traces.main()
    out = capsys.readouterr().out
    save = {"save", "plan", "checksum", "write", "durable", "commit"}
    load = {"load", "catalog", "plan", "read", "fetch", "verify", "objects"}
    want = {
        "sync save": save,
        "async_save (steady)": save | {"blocking"},
        "cold load": load,
        "warm load": load,
        "load from /dev/shm": load,
    }
    blocks = re.split(r"^\*\*(.+?)\*\* ", out, flags=re.M)[1:]
    assert [blocks[i] for i in range(0, len(blocks), 2)] == list(want), out[:3000]
    for case, body in zip(blocks[0::2], blocks[1::2], strict=True):
        rows = [ln for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("| stage ")]
        stages = {r.split("|")[1].strip() for r in rows}
        assert want[case] <= stages, (case, want[case] - stages)
        for r in rows:
            cells = [c.strip() for c in r.strip("|").split("|")]
            assert len(cells) == 6 and re.fullmatch(r"[0-9.]+", cells[1]), r
            assert re.fullmatch(r"[0-9]+%", cells[4]) and cells[5] not in ("", "?"), r
            assert "{" not in cells[5], r
    assert "of which the call blocked" in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"traces: sync save [0-9.]+ s, async_save \(steady\) [0-9.]+ s, .*load from /dev/shm [0-9.]+ s", last
    )
    assert not list((tmp_path / "disk").iterdir()) and not list((tmp_path / "shm").iterdir()), "left files behind"


@pytest.mark.slow  # seconds of saves, in this process
def test_incremental_cost_runs_and_prints_its_line(tmp_path, capsys, monkeypatch):
    out = run_here(
        "incremental_cost.py",
        "--mib",
        "4",
        "--tensors",
        "2",
        "--rounds",
        "2",
        "--repeats",
        "1",
        "--dir",
        str(tmp_path / "b"),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    assert any(line.startswith("digest xxh3_128") for line in out)
    summary = [line for line in out if line.startswith("incremental_cost:")]
    assert len(summary) == 2, out
    for mode, line in zip(("sync", "async"), summary, strict=True):
        ratios = r"time [\d.]+x, cpu [\d.]+x, blocking [\d.]+x, bytes 1\.0000x"
        pattern = rf"incremental_cost: {mode}, all changed, 4 MiB: {ratios}"
        assert re.fullmatch(pattern, line), line
    assert out[-1].startswith("load average now"), out[-1]


@pytest.mark.slow
def test_step_overhead_prints_its_table_and_last_line():
    lines = run("step_overhead.py", "--worlds", "1,2", "--calls", "20")
    rows = [ln for ln in lines if re.match(r"\| [12] \|", ln)]
    assert len(rows) == 2 and all(len(r.strip("|").split("|")) == 4 for r in rows), lines
    assert re.fullmatch(
        r"step_overhead: [0-9.]+ us per step\(\) with preemption, [0-9.]+ us without \(target 1000\)", lines[-1]
    ), lines[-1]


@pytest.mark.slow  # seconds of saves, in this process
def test_incremental_bench_runs_and_prints_its_line(tmp_path, capsys, monkeypatch):
    out = run_here(
        "incremental_bench.py", "--mib", "2", "--dir", str(tmp_path / "b"), capsys=capsys, monkeypatch=monkeypatch
    )
    for name in ("frozen99", "moe", "dense"):
        rows = [line for line in out if line.startswith(f"{name}: ")]
        assert len(rows) == 3, rows  # what it is, bytes, stored and times
        assert "bit-exact: incremental True, full True" in rows[-1]
    assert sum(bool(re.match(r"\s+\d+ +[\d.]+ +[\d.]+ ", line)) for line in out) == 3 * 10  # a row per save
    assert any(line.startswith("targets: ") for line in out)
    assert re.fullmatch(
        r"incremental_bench: frozen99 [\d.]+x fewer bytes, moe [\d.]+x fewer bytes, dense time [\d.]+x, exact True",
        out[-1],
    )
    assert not (tmp_path / "b").exists(), "left files behind"


def test_stage_copy_prints_each_schedule_beside_copy_(capsys, monkeypatch):
    lines = run_here(
        "stage_copy.py", "--gib", "0.01", "--tensors", "3", "--rounds", "2", capsys=capsys, monkeypatch=monkeypatch
    )
    assert re.match(r"3 tensors, 0\.01 GiB, 1 chunks of 3 parts; .* rounds kept 2 of 2$", lines[0]), lines[0]
    rows = [ln.split("|")[1].strip() for ln in lines if ln.startswith("| ") and "ms" in ln]
    assert rows == ["stream", "join", "copy_"], lines


def test_stage_copy_stages_the_transformer_shape(capsys, monkeypatch):
    lines = run_here(
        *("stage_copy.py", "--shape", "transformer", "--gib", "0.004", "--rounds", "2"),
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    head = re.match(r"(\d+) tensors, .* shape transformer; .* rounds kept 2 of 2$", lines[0])
    assert head and int(head.group(1)) > 30, lines[0]  # embedding, layers, norms, AdamW moments and steps
    rows = [ln.split("|")[1].strip() for ln in lines if ln.startswith("| ") and "ms" in ln]
    assert rows == ["stream", "join", "copy_"], lines
