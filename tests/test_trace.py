"""Tracing (bcp.trace, ``bcp trace``) and the manager's metrics callback (bcp.metrics)."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import sys
import tracemalloc

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import bcp
import dist_jobs
from bcp import trace
from bcp.cli import main as cli_main
from bcp.cli.render import rate
from bcp.trace_report import Speeds, read_traces, storage_kind, stragglers, summarise

SAVE_STAGES = {"save", "plan", "stage", "copy", "checksum", "write", "drain", "durable", "commit"}
LOAD_STAGES = {"load", "catalog", "plan", "read", "fetch", "verify", "objects"}


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    # an async save packs the 64 KiB tensors into staged chunks ("copy" spans); a sync
    # save writes every tensor from its own memory; every size is a multiple of 4096
    small = {f"w{i}": torch.randn(16384, generator=g) for i in range(6)}
    return {"big": torch.randn(512, 1024, generator=g), **small, "step": 7}


def spans(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def check_nesting(doc: dict, whole: str) -> None:
    """On each thread, two spans are disjoint or one holds the other; every span lies
    within the operation's own span."""
    events = spans(doc)
    (top,) = [e for e in events if e["name"] == whole]
    eps = 1.0  # µs: timestamps are rounded to ns/1000
    for e in events:
        assert top["ts"] - eps <= e["ts"] and e["ts"] + e["dur"] <= top["ts"] + top["dur"] + eps, e
    by_tid: dict[int, list[dict]] = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    for lane in by_tid.values():
        lane.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in lane:
            while open_ends and open_ends[-1] <= e["ts"] + eps:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + eps, f"{e['name']} crosses its parent's end"
            open_ends.append(end)


def bytes_of(doc: dict, name: str) -> int:
    return sum(e["args"].get("bytes", 0) for e in spans(doc) if e["name"] == name)


def only_file(directory: pathlib.Path, prefix: str) -> dict:
    (path,) = sorted(directory.glob(f"{prefix}-*.rank0.json"))
    return json.loads(path.read_text())


def test_traced_save_and_load_one_process(tmp_path):
    out = tmp_path / "trace"
    state = make_state()
    info = bcp.save(state, tmp_path / "ck", trace=out)
    doc = only_file(out, "save")
    assert doc["otherData"]["save_id"] == info.save_id and doc["otherData"]["rank"] == 0
    assert doc["otherData"]["host"] == trace.host_name()
    names = {e["name"] for e in spans(doc)}
    # a sync save of host tensors writes its batches from the tensors' own memory: no copy
    assert names >= SAVE_STAGES - {"copy"}, SAVE_STAGES - names
    assert "copy" not in names
    check_nesting(doc, "save")
    assert all(e["pid"] == 0 for e in doc["traceEvents"])
    # every tensor byte is checksummed once; the file holds them plus alignment
    assert bytes_of(doc, "checksum") == info.tensor_bytes
    assert info.tensor_bytes <= bytes_of(doc, "write") <= info.rank_bytes_written
    assert bytes_of(doc, "save") == info.rank_bytes_written
    assert info.stages["write"].nbytes == bytes_of(doc, "write") and info.stages["save"].seconds > 0
    writers = {e["tid"] for e in spans(doc) if e["name"] == "write"}
    (main,) = {e["tid"] for e in spans(doc) if e["name"] == "save"}
    assert main not in writers  # chunks are written on the writer threads' lanes
    thread_names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "bcp-writer" in thread_names

    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    loaded = bcp.load_with_info(template, tmp_path / "ck", trace=out)
    assert torch.equal(loaded.state["big"], state["big"])
    ldoc = only_file(out, "load")
    names = {e["name"] for e in spans(ldoc)}
    assert names >= LOAD_STAGES, LOAD_STAGES - names
    check_nesting(ldoc, "load")
    # fetched: what was asked for, plus the gaps a coalesced read spans (at most the file)
    assert loaded.bytes_read + loaded.verify_bytes <= bytes_of(ldoc, "fetch") <= info.bytes_written
    assert bytes_of(ldoc, "load") == bytes_of(ldoc, "read") == loaded.bytes_read
    assert bytes_of(ldoc, "verify") == loaded.bytes_read  # every byte read is verified


def test_environment_variable_and_off(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.ENV, str(tmp_path / "env"))
    bcp.save({"x": torch.ones(10)}, tmp_path / "a")
    assert len(list((tmp_path / "env").glob("save-*.rank0.json"))) == 1
    bcp.save({"x": torch.ones(10)}, tmp_path / "b", trace=False)  # False: off whatever the environment says
    assert len(list((tmp_path / "env").glob("*.json"))) == 1
    monkeypatch.delenv(trace.ENV)
    info = bcp.save({"x": torch.ones(10)}, tmp_path / "c")
    assert info.stages == {}
    assert not list(tmp_path.rglob("*.rank*.json"))[1:]  # only the one the environment asked for
    assert not trace.enabled()


def test_off_is_free():
    assert not trace.enabled()
    assert trace.span("write", 123) is trace.NULL

    def run(n: int) -> int:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            with trace.span("write", n):
                pass
        grown = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        return grown

    run(10)  # warm
    # no allocation per call (20,000 calls would add hundreds of KiB); tracemalloc counts every thread's
    # allocations, so a leftover thread of an earlier test in this worker can add a block: the least of three
    assert min(run(20000) for _ in range(3)) < 2048
    session = trace.begin(True, 0, "save")
    assert session is not None
    try:
        assert run(2000) > 2000 * 100  # on: each span is an event (the measurement can see allocations)
    finally:
        session.end()
    assert not trace.enabled()


def _traced_job(rank: int, world: int, directory: str) -> None:
    base = pathlib.Path(directory)
    state = make_state()  # the same values on both ranks: replicated, written once, balanced over the ranks
    info = bcp.save(state, base / "ck", trace=base / "trace")
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    loaded = bcp.load_with_info(template, base / "ck", trace=base / "trace")
    assert torch.equal(loaded.state["w3"], state["w3"])
    shared = bcp.load_with_info(template, base / "ck", trace=base / "shared", share_reads=True)
    assert torch.equal(shared.state["big"], state["big"])
    facts = {
        "tensor_bytes": info.tensor_bytes,
        "rank_bytes_written": info.rank_bytes_written,
        "bytes_written": info.bytes_written,
        "bytes_read": loaded.bytes_read,
        "verify_bytes": loaded.verify_bytes,
        "shared_bytes_read": shared.bytes_read,
    }
    (base / f"facts{rank}.json").write_text(json.dumps(facts))
    dist.barrier()


def test_traced_save_and_load_two_ranks(tmp_path, capsys):
    dist_jobs.spawn(_traced_job, 2, str(tmp_path))
    out = tmp_path / "trace"
    facts = [json.loads((tmp_path / f"facts{r}.json").read_text()) for r in range(2)]
    saves = [json.loads(next(out.glob(f"save-*.rank{r}.json")).read_text()) for r in range(2)]
    loads = [json.loads(next(out.glob(f"load-*.rank{r}.json")).read_text()) for r in range(2)]
    assert saves[0]["otherData"]["label"] == saves[1]["otherData"]["label"]  # the save's id, agreed
    for rank in range(2):
        assert {e["pid"] for e in saves[rank]["traceEvents"]} == {rank}
        assert SAVE_STAGES - {"copy"} <= {e["name"] for e in spans(saves[rank])}
        assert {e["name"] for e in spans(loads[rank])} >= LOAD_STAGES
        check_nesting(saves[rank], "save")
        check_nesting(loads[rank], "load")
        assert bytes_of(saves[rank], "save") == facts[rank]["rank_bytes_written"]
        assert bytes_of(loads[rank], "read") == bytes_of(loads[rank], "load") == facts[rank]["bytes_read"]
        assert facts[rank]["bytes_read"] <= bytes_of(loads[rank], "fetch") <= facts[rank]["bytes_written"]
    # share_reads: each rank reads what it owns and receives the rest from the other over gloo
    for rank in range(2):
        doc = json.loads(next((tmp_path / "shared").glob(f"load-*.rank{rank}.json")).read_text())
        check_nesting(doc, "load")
        (exchange,) = [e for e in spans(doc) if e["name"] == "exchange"]
        (shared,) = [e for e in spans(doc) if e["name"] == "shared"]
        assert shared["ts"] <= exchange["ts"] and exchange["ts"] + exchange["dur"] <= shared["ts"] + shared["dur"] + 1
        # what it read from storage and what it received make the whole state, once
        assert exchange["args"]["bytes"] > 0
        assert exchange["args"]["bytes"] + facts[rank]["shared_bytes_read"] == facts[rank]["tensor_bytes"]
    # replicated tensors are written once: the ranks' checksummed bytes add up to the job's
    assert sum(bytes_of(d, "checksum") for d in saves) == facts[0]["tensor_bytes"]
    assert sum(bytes_of(d, "save") for d in saves) == facts[0]["bytes_written"]
    assert all(bytes_of(d, "write") > 0 for d in saves)  # balanced: both ranks wrote

    assert cli_main(["trace", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    merged = json.loads((out / "merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    kinds = sorted(op["kind"] for op in report["operations"])
    assert kinds == ["load", "save"]
    save = next(op for op in report["operations"] if op["kind"] == "save")
    assert save["ranks"] == [0, 1]
    write = next(s for s in save["stages"] if s["stage"] == "checksum")
    assert write["bytes"] == facts[0]["tensor_bytes"]


def test_async_save_and_the_manager_pass_trace_on(tmp_path):
    state = make_state()
    handle = bcp.async_save(state, tmp_path / "a", trace=tmp_path / "t1")
    info = handle.wait()
    doc = only_file(tmp_path / "t1", "save")
    names = {e["name"] for e in spans(doc)}
    assert names >= SAVE_STAGES | {"blocking"}, SAVE_STAGES - names
    (blocking,) = [e for e in spans(doc) if e["name"] == "blocking"]
    assert blocking["dur"] / 1e6 == pytest.approx(handle.blocking_seconds, abs=0.01)
    assert bytes_of(doc, "save") == info.rank_bytes_written and info.stages["blocking"].seconds > 0

    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    with bcp.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        saved = manager.save(4, state, trace=tmp_path / "t2")
        step, loaded = manager.load_latest(template, trace=tmp_path / "t2")
    assert step == 4 and torch.equal(loaded["big"], state["big"])
    assert saved is not None and only_file(tmp_path / "t2", "save")["otherData"]["save_id"] == saved.save_id
    assert only_file(tmp_path / "t2", "load")["otherData"]["save_id"] == saved.save_id


def synthetic(directory: pathlib.Path, world: int, slow_rank: int, *, hosts: int = 0, uri: str = "") -> None:
    """A save on ``world`` ranks where ``slow_rank`` writes for 3 s and the others for 1 s,
    2 GB each; with ``hosts``, consecutive ranks share a host ``h<i>``; ``uri``: the checkpoint's."""
    directory.mkdir()
    for rank in range(world):
        write_s = 3.0 if rank == slow_rank else 1.0
        events = [
            {"name": "save", "ph": "X", "ts": 0.0, "dur": 5e6, "pid": rank, "tid": 1, "args": {"bytes": 4_000_000_000}},
            {"name": "plan", "ph": "X", "ts": 0.0, "dur": 1e5 * (1 + rank % 2), "pid": rank, "tid": 1, "args": {}},
        ]
        # two writer threads' chunks overlapping in time: the stage counts their union
        events += [
            {"args": {"bytes": 1e9}}
            | {"name": "write", "ph": "X", "ts": 1e6, "dur": write_s * 1e6, "pid": rank, "tid": 2 + t}
            for t in range(2)
        ]
        doc = {"traceEvents": events, "otherData": {"rank": rank, "kind": "save", "label": "s1"}}
        if hosts:
            doc["otherData"]["host"] = f"h{rank * hosts // world}"
        if uri:
            doc["otherData"]["uri"] = uri
        (directory / f"save-s1.rank{rank}.json").write_text(json.dumps(doc))
    (directory / "notes.json").write_text("not a trace")  # ignored: not a rank file


def test_trace_command_finds_stragglers(tmp_path, capsys):
    synthetic(tmp_path / "t", 4, slow_rank=2)
    assert cli_main(["trace", str(tmp_path / "t"), "--straggler-pct", "50"]) == 0
    text = capsys.readouterr().out
    assert "2 (3.000 s)" in text and "timeline:" in text
    (op,) = summarise(read_traces(tmp_path / "t"), straggler_pct=50)
    by_stage = {s.stage: s for s in op.stages}
    write = by_stage["write"]
    assert write.stragglers == (2,) and write.slowest == (2, 3.0)
    assert write.per_rank[0] == pytest.approx(1.0)  # overlapping chunks counted once
    assert write.gbps == pytest.approx(8e9 / 3.0 / 1e9)
    assert by_stage["plan"].stragglers == ()  # 0.2 s vs a 0.15 s median: within 50 %
    assert [s.stage for s in op.stages] == ["save", "plan", "write"]
    assert op.seconds == pytest.approx(5.0)


def test_stages_against_measured_speeds_per_host(tmp_path):
    synthetic(tmp_path / "t", 4, slow_rank=2, hosts=2, uri="/data/ck")
    docs = read_traces(tmp_path / "t")
    (op,) = summarise(docs, speeds=Speeds(disk=(4.0, 8.0)))
    write = next(s for s in op.stages if s.stage == "write")
    a = write.against
    assert a is not None and (a.resource, a.direction, a.speed_gbps) == ("disk", "write", 4.0)
    # host h1 (ranks 2 and 3): 4 GB while either wrote, 3 s (rank 2's [1, 4] s holds rank 3's [1, 2] s)
    assert (a.host, a.nbytes, a.seconds) == ("h1", 4_000_000_000, pytest.approx(3.0))
    assert a.gbps == pytest.approx(4 / 3) and a.share == pytest.approx(1 / 3) and a.at_speed_seconds == 1.0
    assert all(s.against is None for s in op.stages if s.stage != "write"), "save and plan are not put against"
    # no host in the files: each rank is its own host
    shutil.rmtree(tmp_path / "t")
    synthetic(tmp_path / "t", 4, slow_rank=2, uri="file:///data/ck")
    (op,) = summarise(read_traces(tmp_path / "t"), speeds=Speeds(disk=(4.0, 8.0)))
    a = next(s for s in op.stages if s.stage == "write").against
    assert a is not None and (a.host, a.nbytes, a.seconds) == ("rank 2", 2_000_000_000, pytest.approx(3.0))
    # an object store is reached through the network: the disk's speed does not apply
    for uri, speeds, resource in [
        ("s3://bucket/ck", Speeds(disk=(4.0, 4.0)), None),
        ("s3://bucket/ck", Speeds(network=(1.0, 2.0)), "network"),
        ("memory://ck", Speeds(disk=(1.0, 1.0), network=(1.0, 1.0)), None),
    ]:
        shutil.rmtree(tmp_path / "t")
        synthetic(tmp_path / "t", 2, slow_rank=1, uri=uri)
        (op,) = summarise(read_traces(tmp_path / "t"), speeds=speeds)
        a = next(s for s in op.stages if s.stage == "write").against
        assert (a.resource if a else None) == resource, uri


@pytest.mark.parametrize(
    ("uri", "kind"),
    [
        ("/abs/ck", "disk"),
        ("rel/ck", "disk"),
        ("file:///abs/ck", "disk"),
        ("FILE:/abs/ck", "disk"),
        ("s3://b/ck", "network"),
        ("gs://b/ck", "network"),
        ("hdfs://nn/ck", "network"),
        ("memory://ck", None),
    ],
)
def test_storage_kind(uri, kind):
    assert storage_kind(uri) == kind


def test_trace_command_measures_and_compares(tmp_path, capsys):
    synthetic(tmp_path / "t", 4, slow_rank=2, hosts=2, uri=str(tmp_path / "ck"))
    assert cli_main(["trace", str(tmp_path / "t"), "--disk-gbps", "4,8"]) == 0
    text = capsys.readouterr().out
    assert "write      disk write 3.7 GiB/s: host h1 moved 3.7 GiB in 3.000 s = 1.2 GiB/s, 33% of it" in text
    assert "(1.000 s at that speed)" in text
    # --measure: the disk where the checkpoints are, measured for real; its speeds are the ones compared
    (tmp_path / "disk").mkdir()
    argv = ["trace", str(tmp_path / "t"), "--json", "--measure", str(tmp_path / "disk"), "--measure-mib", "8"]
    assert cli_main(argv) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    write_gbps, read_gbps = report["speeds"]["disk"]
    assert write_gbps > 0 and read_gbps > 0 and report["speeds"]["network"] is None
    assert f"write {rate(write_gbps * 1e9)}, read {rate(read_gbps * 1e9)}" in out.err and "(disk, 8.0 MiB)" in out.err
    (op,) = report["operations"]
    against = next(s for s in op["stages"] if s["stage"] == "write")["against"]
    assert against["speed_gbps"] == write_gbps and against["host"] == "h1" and against["bytes"] == 4_000_000_000
    assert list((tmp_path / "disk").iterdir()) == [], "the scratch object is deleted"
    with pytest.raises(SystemExit) as usage:  # argparse's own refusal of the value
        cli_main(["trace", str(tmp_path / "t"), "--disk-gbps", "0"])
    assert usage.value.code == 2
    assert "one or two speeds > 0" in capsys.readouterr().err
    assert cli_main(["trace", str(tmp_path / "t"), "--measure", "memory://x"]) == 1
    assert "no disk or network to measure" in capsys.readouterr().err


def test_pictures_without_matplotlib_say_which_extra(tmp_path, capsys, monkeypatch):
    synthetic(tmp_path / "t", 2, slow_rank=1)
    bcp.save({"w": torch.ones(4, 4)}, tmp_path / "ck")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ModuleNotFoundError
    assert cli_main(["trace", str(tmp_path / "t"), "--png", str(tmp_path / "a.png")]) == 1
    err = capsys.readouterr().err
    assert "bcp-checkpoint[viz]" in err and len(err.strip().splitlines()) == 1, err
    assert cli_main(["inspect", str(tmp_path / "ck"), "--layout", str(tmp_path / "b.png")]) == 1
    assert "bcp-checkpoint[viz]" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_trace_command_picks_an_operation(tmp_path, capsys):
    out = tmp_path / "t"
    first = bcp.save({"x": torch.ones(1000)}, tmp_path / "a", trace=out)
    bcp.save({"x": torch.ones(1000)}, tmp_path / "b", trace=out)
    bcp.load({"x": torch.zeros(1000)}, tmp_path / "a", trace=out)
    assert cli_main(["trace", str(out), "--json", "--op", first.save_id]) == 0
    ops = json.loads(capsys.readouterr().out)["operations"]
    assert sorted((op["kind"], op["label"]) for op in ops) == [("load", first.save_id), ("save", first.save_id)]
    assert cli_main(["trace", str(out), "--json", "--op", f"load-{first.save_id[:8]}"]) == 0
    assert [op["kind"] for op in json.loads(capsys.readouterr().out)["operations"]] == ["load"]
    assert cli_main(["trace", str(out), "--op", "nothing"]) == 1
    assert "no trace of an operation" in capsys.readouterr().err


def test_trace_command_refuses_an_empty_directory(tmp_path, capsys):
    assert cli_main(["trace", str(tmp_path)]) == 1
    assert "no trace files" in capsys.readouterr().err


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=12))
def test_active_seconds_is_the_union(pairs):
    intervals = [(float(a), float(a + n)) for a, n in pairs]
    covered = {t for a, b in intervals for t in range(int(a), int(b))}
    assert trace.active_seconds(intervals) == len(covered)


@given(st.dictionaries(st.integers(0, 7), st.floats(0.0, 10.0), min_size=1, max_size=8), st.floats(0, 100))
def test_stragglers_are_above_the_median(per_rank, pct):
    late = stragglers(per_rank, pct)
    median = sorted(per_rank.values())[(len(per_rank) - 1) // 2]
    assert all(per_rank[r] > median for r in late)
    assert len(late) < len(per_rank)


def test_manager_metrics_sync(tmp_path):
    records: list[bcp.MetricsRecord] = []
    state = make_state()
    with bcp.CheckpointManager(tmp_path / "run", async_save=False, metrics=records.append) as manager:
        info = manager.save(1, state)
        assert info is not None and len(records) == 1
        manager.save(2, state)
        template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        step, _loaded = manager.load_latest(template)
    assert step == 2
    assert [(r.kind, r.step) for r in records] == [("save", 1), ("save", 2), ("load", 2)]
    first = records[0]
    assert first.bytes == info.rank_bytes_written and first.tier == "persistent" and first.retries == 0
    assert first.total_seconds == info.seconds and first.blocking_seconds == info.seconds
    assert first.gbps["write"] > 0 and "checksum" in first.gbps
    assert records[2].bytes > 0 and records[2].gbps["fetch"] > 0
    assert not list(tmp_path.rglob("*.rank*.json"))  # in memory only: no trace files


def test_manager_metrics_async(tmp_path):
    records: list[bcp.MetricsRecord] = []
    state = make_state()
    manager = bcp.CheckpointManager(tmp_path / "run", async_save=True, metrics=records.append)
    manager.save(1, state)
    assert records == []  # not at the call: when the save completes
    manager.save(2, state)  # finishes step 1 first
    assert [r.step for r in records] == [1]
    info = manager.wait()
    assert info is not None and [r.step for r in records] == [1, 2]
    last = records[-1]
    assert last.bytes == info.rank_bytes_written and last.total_seconds == info.seconds
    assert 0 < last.blocking_seconds <= last.total_seconds
    manager.close()
    assert len(records) == 2


def test_metrics_adapters(caplog):
    record = bcp.MetricsRecord(
        step=5, kind="save", blocking_seconds=0.1, total_seconds=0.5, bytes=10**9, gbps={"write": 3.0}, retries=1
    )
    with caplog.at_level(logging.INFO, logger="bcp.metrics"):
        bcp.LoggingMetrics()(record)
    assert "checkpoint save step 5" in caplog.text and "write=3.00" in caplog.text and "2.00 GB/s" in caplog.text

    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.calls.append((tag, value, step))

    writer = Writer()
    bcp.TensorBoardMetrics(writer)(record)
    scalars = {tag: (value, step) for tag, value, step in writer.calls}
    assert scalars["checkpoint/save/gbps/write"] == (3.0, 5)
    assert scalars["checkpoint/save/blocking_seconds"] == (0.1, 5)
    assert scalars["checkpoint/save/retries"] == (1.0, 5)


def test_tensorboard_summary_writer(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    record = bcp.MetricsRecord(
        step=3, kind="load", blocking_seconds=0.2, total_seconds=0.2, bytes=100, gbps={"fetch": 1.5}, retries=0
    )
    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    bcp.TensorBoardMetrics(writer)(record)
    writer.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
