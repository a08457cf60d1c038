"""``bcp trace DIR``: merge the ranks' trace files of saves and loads run with
``trace=DIR`` (or ``BCP_TRACE_DIR``) into one timeline and print a per-stage summary
(:mod:`bcp.trace_report`); ``--png`` draws ranks against time (:mod:`bcp.viz`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..trace_report import OperationSummary, TraceError, merge, read_traces, summarise
from .common import CliError, UsageError
from .render import human, safe

NAME = "trace"
HELP = "merge the per-rank trace files of a traced save or load; per-stage summary, stragglers"
DESCRIPTION = (
    "Merge DIR's trace files (*.rank<N>.json, written by a save or load with trace=DIR or BCP_TRACE_DIR=DIR) "
    "into one Chrome trace / Perfetto JSON file (open it in ui.perfetto.dev or chrome://tracing), and print "
    "per save or load, per stage: the time summed over ranks, the slowest rank, the median, the stragglers "
    "and the stage's GB/s (its bytes over its slowest rank's time)."
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir")
    p.add_argument("-o", "--output", help="the merged timeline (default: DIR/merged.json)")
    p.add_argument(
        "--straggler-pct",
        type=float,
        default=20.0,
        help="a rank this many percent slower than the median in a stage is a straggler (default 20)",
    )
    p.add_argument(
        "--op",
        metavar="ID",
        help="only the operations whose checkpoint id (or kind-id: save-ID, load-ID) starts with ID",
    )
    p.add_argument("--png", help="also draw ranks x time, coloured by stage, to this PNG (the viz extra)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def as_json(op: OperationSummary) -> dict:
    return {
        "kind": op.kind,
        "label": op.label,
        "ranks": list(op.ranks),
        "seconds": op.seconds,
        "stages": [
            {
                "stage": s.stage,
                "spans": s.spans,
                "bytes": s.nbytes,
                "total_seconds": s.total_seconds,
                "slowest_rank": s.slowest[0],
                "slowest_seconds": s.slowest[1],
                "median_seconds": s.median_seconds,
                "stragglers": list(s.stragglers),
                "gbps": s.gbps,
            }
            for s in op.stages
        ],
    }


def print_summary(op: OperationSummary, pct: float) -> None:
    print(f"{op.kind} {safe(op.label)}: {len(op.ranks)} rank(s), {op.seconds:.3f} s (slowest rank)")
    print(
        f"  {'stage':<10} {'spans':>6} {'total s':>9} {'slowest s':>10} {'rank':>5} {'median s':>9} "
        f"{'bytes':>10} {'GB/s':>7}  stragglers (>{pct:g}% over median)"
    )
    for s in op.stages:
        rank, slowest = s.slowest
        gbps = f"{s.gbps:7.2f}" if s.nbytes else f"{'-':>7}"
        late = ", ".join(f"{r} ({s.per_rank[r]:.3f} s)" for r in s.stragglers) or "-"
        print(
            f"  {safe(s.stage):<10} {s.spans:>6} {s.total_seconds:>9.3f} {slowest:>10.3f} {rank:>5} "
            f"{s.median_seconds:>9.3f} {human(s.nbytes) if s.nbytes else '-':>10} {gbps}  {late}"
        )


def _names(doc: dict) -> tuple[str, str]:
    other = doc.get("otherData", {})
    label = str(other.get("label", ""))
    return label, f"{other.get('kind', '')}-{label}"


def run(args: argparse.Namespace) -> int:
    if args.straggler_pct < 0:
        raise UsageError(f"--straggler-pct must be >= 0, got {args.straggler_pct}")
    try:
        docs = read_traces(args.dir)
    except TraceError as e:
        raise CliError(str(e)) from None
    if args.op:
        docs = [d for d in docs if any(name.startswith(args.op) for name in _names(d))]
        if not docs:
            raise CliError(f"{safe(args.dir)}: no trace of an operation whose id starts with {safe(args.op)!r}")
    output = Path(args.output) if args.output else Path(args.dir) / "merged.json"
    output.write_text(json.dumps(merge(docs)))
    summary = summarise(docs, straggler_pct=args.straggler_pct)
    if args.png:
        from ..viz import draw_timeline

        draw_timeline(docs, args.png)
    if args.json:
        print(json.dumps({"merged": str(output), "operations": [as_json(op) for op in summary]}, indent=2))
        return 0
    for op in summary:
        print_summary(op, args.straggler_pct)
    print(f"timeline: {safe(str(output))} (open in ui.perfetto.dev or chrome://tracing)")
    if args.png:
        print(f"picture: {safe(args.png)}")
    return 0
