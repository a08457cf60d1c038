"""Pictures (bcp.viz: ``bcp trace --png``, ``bcp inspect --layout``): the PNG decodes, has
the size asked for, and the rectangles drawn are the trace's stages / the catalog's boxes."""

from __future__ import annotations

import itertools
import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
import dist_jobs
from bcp.cli import main as cli_main
from bcp.trace_report import read_traces
from test_trace import synthetic

pytest.importorskip("matplotlib")
from matplotlib.image import imread

from bcp.viz import DPI, WIDTH, draw_layout, draw_timeline, reader_rows, reader_shares


def test_timeline_png(tmp_path, capsys):
    synthetic(tmp_path / "t", 4, slow_rank=2)
    rects = draw_timeline(read_traces(tmp_path / "t"), tmp_path / "a.png")
    image = imread(tmp_path / "a.png")
    assert image.shape[:2] == (round((1.5 + 0.6 * 4) * DPI), round(WIDTH * DPI))
    writes = {r.rank: r.x1 - r.x0 for r in rects if r.label == "write"}
    assert writes == pytest.approx({0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0})  # the two writer lanes drawn as their union
    assert {r.label for r in rects} == {"save", "plan", "write"}
    assert all(r.rank <= r.y0 < r.y1 <= r.rank + 1 for r in rects)  # each inside its rank's band
    assert cli_main(["trace", str(tmp_path / "t"), "--png", str(tmp_path / "b.png")]) == 0
    assert imread(tmp_path / "b.png").shape == image.shape
    assert "picture:" in capsys.readouterr().out


@given(st.integers(0, 40), st.integers(1, 9))
def test_reader_rows_split_as_torch_chunk(n, world):
    rows = reader_rows(n, world)
    sizes = [len(c) for c in torch.arange(n).chunk(world)] if n else []
    assert [b - a for a, b in rows] == sizes + [0] * (world - len(sizes))
    assert rows[0][0] == 0 and rows[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(rows))


def _sharded_save_job(rank: int, world: int, uri: str) -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    flat = torch.arange(10, dtype=torch.float32)
    rows = slice(4 * rank, 4 * rank + 4)
    state = {
        "w": bcp.TensorShard(full[rows].clone(), (8, 6), (4 * rank, 0)),
        "v": bcp.TensorShard(flat[5 * rank : 5 * rank + 5].clone(), (10,), (5 * rank,)),
    }
    bcp.save(state, uri)


def test_layout_png_matches_the_catalog(tmp_path, capsys):
    uri = str(tmp_path / "ck")
    dist_jobs.spawn(_sharded_save_job, 2, uri)
    reader = bcp.open(uri)
    meta = reader.meta("w")
    rects = draw_layout(meta.fragments, tuple(meta.shape), "w", tmp_path / "w.png", world=3)
    assert imread(tmp_path / "w.png").shape[:2] == (round(6.0 * DPI), round(WIDTH * DPI))
    drawn = {(r.x0, r.x1, r.y0, r.y1, r.rank) for r in rects if r.kind == "fragment"}
    stored = {
        (f.offsets[1], f.offsets[1] + f.lengths[1], f.offsets[0], f.offsets[0] + f.lengths[0], f.writer_rank)
        for f in meta.fragments
    }
    assert drawn == stored == {(0, 6, 0, 4, 0), (0, 6, 4, 8, 1)}
    reads = sorted((r.y0, r.y1, r.rank) for r in rects if r.kind == "read")
    assert reads == [(0, 3, 0), (3, 6, 1), (6, 8, 2)]  # 8 rows over 3 readers as torch.chunk splits them
    # with the catalog entry, each reader's share names the writers bcp's read plan reads it from
    rects = draw_layout(meta.fragments, tuple(meta.shape), "w", tmp_path / "w.png", world=3, entry=meta.entry)
    labels = sorted(r.label for r in rects if r.kind == "read")
    assert labels == ["reader 0 <- writer 0", "reader 1 <- writer 0, 1", "reader 2 <- writer 1"]
    shares = reader_shares(meta.entry, 5)  # 2 rows each; the fifth reader gets none
    assert [(s.start, s.stop, s.writers, s.boxes) for s in shares] == [
        (0, 2, (0,), 1),
        (2, 4, (0,), 1),
        (4, 6, (1,), 1),
        (6, 8, (1,), 1),
        (8, 8, (), 0),
    ]

    flat = reader.meta("v")
    ranges = draw_layout(flat.fragments, tuple(flat.shape), "v", tmp_path / "v.png")
    assert sorted((r.x0, r.x1, r.rank) for r in ranges) == [(0, 5, 0), (5, 10, 1)]

    out = pathlib.Path(tmp_path / "cli.png")
    assert cli_main(["inspect", uri, "--layout", str(out), "--tensor", "w", "--world", "3"]) == 0
    text = capsys.readouterr().out
    assert imread(out).ndim == 3 and "2 box(es) from 2 writer rank(s)" in text
    assert "reader 1: rows 3-5 from 2 stored box(es) of writer rank(s) 0, 1" in text
    assert cli_main(["inspect", uri, "--layout", str(out), "--tensor", "v", "--world", "5"]) == 0
    text = capsys.readouterr().out
    assert "reader 2: elements 4-5 from 2 stored box(es) of writer rank(s) 0, 1" in text
    assert "reader 4: elements 8-9 from 1 stored box(es) of writer rank(s) 1" in text
    assert cli_main(["inspect", uri, "--layout", str(out), "--tensor", "nope"]) == 2
    assert "--tensor is one of" in capsys.readouterr().err
