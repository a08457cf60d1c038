"""Pictures of a trace and of a checkpoint's layout (the optional ``viz`` extra: matplotlib).

:func:`draw_timeline` (``bcp trace DIR --png``): one band per rank, one row per stage
inside it, each stage's active time (its spans' union) as bars. :func:`draw_layout`
(``bcp inspect URI --layout``): which writer rank holds which box of a tensor over
its first two dimensions (a 1-d tensor: flat ranges), and with ``world`` how that
many ranks would read it: dimension 0 split as ``torch.chunk`` splits it (DTensor's
``Shard(0)``, FSDP2), and with the tensor's catalog entry, which writers' boxes
bcp's own read plan reads each share from (:func:`reader_shares`). Both return what
they drew as data (:class:`Rect`), so a test can compare the picture with the trace
or the catalog. matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bcp.extras import needs_extra
from bcp.io_scheduler.read_plan import touched_rows
from bcp.metadata import TensorEntry
from bcp.trace import active_seconds

#: the picture's width in inches and dots per inch: a PNG is WIDTH * DPI pixels wide
WIDTH, DPI = 12.0, 100


@dataclasses.dataclass(frozen=True)
class Rect:
    """One drawn rectangle: ``[x0, x1) x [y0, y1)`` in data units, and what it shows."""

    x0: float
    x1: float
    y0: float
    y1: float
    #: "stage" (timeline), "fragment" (a stored box) or "read" (a reader rank's share)
    kind: str
    rank: int
    label: str


def _pyplot() -> Any:
    with needs_extra("viz", "drawing pictures (bcp trace --png, bcp inspect --layout)"):
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    return plt


def _colours(names: Sequence[Any]) -> dict[Any, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def timeline_rects(docs: Sequence[dict[str, Any]]) -> list[Rect]:
    """Per rank and stage, the intervals where the stage was active (seconds from the
    earliest span of any rank); rank r's band is ``[r, r + 1)``, one row per stage."""
    spans = [e for d in docs for e in d["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        return []
    t0 = min(e["ts"] for e in spans)
    stages = list(dict.fromkeys(e["name"] for e in sorted(spans, key=lambda e: e["ts"])))
    rows = len(stages)
    out = []
    for rank in sorted({int(e["pid"]) for e in spans}):
        for i, stage in enumerate(stages):
            intervals = sorted(
                ((e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6)
                for e in spans
                if int(e["pid"]) == rank and e["name"] == stage
            )
            for a, b in _union(intervals):
                y0 = rank + 0.05 + 0.9 * i / rows
                out.append(Rect(a, b, y0, y0 + 0.9 / rows, "stage", rank, stage))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    assert abs(sum(b - a for a, b in out) - active_seconds(intervals)) < 1e-9
    return out


def draw_timeline(docs: Sequence[dict[str, Any]], path: str | Path) -> list[Rect]:
    """Draw ranks x time coloured by stage to the PNG ``path``; returns the rectangles drawn."""
    plt = _pyplot()
    rects = timeline_rects(docs)
    ranks = sorted({r.rank for r in rects})
    colours = _colours(list(dict.fromkeys(r.label for r in rects)))
    fig, ax = plt.subplots(figsize=(WIDTH, 1.5 + 0.6 * max(len(ranks), 1)), dpi=DPI)
    for r in rects:
        ax.add_patch(plt.Rectangle((r.x0, r.y0), r.x1 - r.x0, r.y1 - r.y0, color=colours[r.label], linewidth=0))
    ax.set_xlim(0, max((r.x1 for r in rects), default=1.0) * 1.02 or 1.0)
    ax.set_ylim(max(ranks, default=0) + 1, 0)
    ax.set_yticks([r + 0.5 for r in ranks], [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return rects


@dataclasses.dataclass(frozen=True)
class ReaderShare:
    """What one rank of a target world size reads of a tensor."""

    rank: int
    #: rows ``[start, stop)`` of dimension 0 (elements of a 1-d tensor); empty when start == stop
    start: int
    stop: int
    #: writer ranks of the stored boxes the read plan reads the share from (empty: not computed)
    writers: tuple[int, ...] = ()
    #: stored boxes read
    boxes: int = 0


#: The largest reader world size a layout is computed for (``bcp inspect --layout
#: --world``): the shares are one entry per rank, so this bounds their memory and time.
MAX_WORLD = 65536

#: Reader outlines are labelled in the picture only up to this many readers (more is unreadable).
MAX_LABELLED_READERS = 64


def check_world(world: int) -> None:
    """ValueError unless ``1 <= world <=`` :data:`MAX_WORLD`."""
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"a reader world size is 1 to {MAX_WORLD:,} ranks, got {world:,}")


def reader_rows(n: int, world: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of each of ``world`` ranks splitting ``n`` rows as
    ``torch.chunk`` does (DTensor ``Shard(0)``, FSDP2): ``ceil(n / world)`` each, the
    last ranks fewer or none. ``world`` is at most :data:`MAX_WORLD`."""
    check_world(world)
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def reader_shares(entry: TensorEntry, world: int) -> list[ReaderShare]:
    """Each of ``world`` ranks' rows (:func:`reader_rows`) and the stored boxes bcp's
    read plan reads them from (the replica each rank would choose, as a load does)."""
    shape = tuple(entry.global_shape)
    out = []
    for rank, (start, stop) in enumerate(reader_rows(shape[0], world)):
        if stop <= start:
            out.append(ReaderShare(rank, start, stop))
            continue
        box = ((start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:]))
        _boxes, rows, _offsets, _lengths = touched_rows(entry, [box], prefer_rank=rank)
        writers = tuple(sorted({int(w) for w in entry.writer_ranks[rows]}))
        out.append(ReaderShare(rank, start, stop, writers, len(rows)))
    return out


def _two_d(offsets: Sequence[int], lengths: Sequence[int]) -> tuple[float, float, float, float]:
    """A box as (x0, x1, y0, y1): dim 1 across and dim 0 down; a 1-d box is a flat range on one row."""
    if len(offsets) == 1:
        return offsets[0], offsets[0] + lengths[0], 0, 1
    return offsets[1], offsets[1] + lengths[1], offsets[0], offsets[0] + lengths[0]


def layout_rects(
    fragments: Sequence[Any],
    shape: Sequence[int],
    world: int | None = None,
    shares: Sequence[ReaderShare] | None = None,
) -> list[Rect]:
    """The fragments' boxes over the tensor's first two dims (one rectangle per distinct
    2-d box and writer rank), and each reader's share of dim 0: ``shares``, or with
    ``world`` alone the rows of :func:`reader_rows` (no writers named)."""
    if not shape:
        raise ValueError("a 0-d tensor has no layout to draw")
    seen: dict[tuple, Rect] = {}
    for f in fragments:
        x0, x1, y0, y1 = _two_d(f.offsets, f.lengths)
        seen.setdefault((x0, x1, y0, y1, f.writer_rank), Rect(x0, x1, y0, y1, "fragment", f.writer_rank, f.file))
    rects = list(seen.values())
    if shares is None and world:
        shares = [ReaderShare(r, lo, hi) for r, (lo, hi) in enumerate(reader_rows(shape[0], world))]
    for share in shares or ():
        lo, hi = share.start, share.stop
        if hi > lo:
            x0, x1, y0, y1 = _two_d((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]))
            label = f"reader {share.rank}"
            if share.writers:
                label += f" <- writer {', '.join(map(str, share.writers))}"
            rects.append(Rect(x0, x1, y0, y1, "read", share.rank, label))
    return rects


def draw_layout(
    fragments: Sequence[Any],
    shape: Sequence[int],
    fqn: str,
    path: str | Path,
    world: int | None = None,
    *,
    entry: TensorEntry | None = None,
) -> list[Rect]:
    """Draw which writer rank holds which box of tensor ``fqn`` (and with ``world``,
    each reader's rows as outlines, labelled with the writers it reads from when the
    catalog ``entry`` is given) to the PNG ``path``; returns the rectangles."""
    plt = _pyplot()
    shares = reader_shares(entry, world) if world and entry is not None else None
    rects = layout_rects(fragments, shape, world, shares)
    writers = sorted({r.rank for r in rects if r.kind == "fragment"})
    colours = _colours(writers)
    fig, ax = plt.subplots(figsize=(WIDTH, 6.0), dpi=DPI)
    for r in rects:
        if r.kind == "fragment":
            patch = plt.Rectangle((r.x0, r.y0), r.x1 - r.x0, r.y1 - r.y0, facecolor=colours[r.rank], edgecolor="white")
        else:
            patch = plt.Rectangle(
                (r.x0, r.y0), r.x1 - r.x0, r.y1 - r.y0, fill=False, edgecolor="black", linestyle="--", linewidth=1.5
            )
            if world is not None and world <= MAX_LABELLED_READERS:
                ax.text(r.x0, (r.y0 + r.y1) / 2, f" {r.label}", va="center", fontsize="small")
        ax.add_patch(patch)
    width = shape[1] if len(shape) > 1 else shape[0]
    height = shape[0] if len(shape) > 1 else 1
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(max(height, 1), 0)
    ax.set_xlabel("dim 1" if len(shape) > 1 else "element")
    ax.set_ylabel("dim 0" if len(shape) > 1 else "")
    ax.set_title(f"{fqn} {list(shape)}: boxes by writer rank" + (f", read by {world} ranks" if world else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[w]) for w in writers]
    ax.legend(handles, [f"writer {w}" for w in writers], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return rects
