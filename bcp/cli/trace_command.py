"""``bcp trace DIR``: merge the ranks' trace files of saves and loads run with
``trace=DIR`` (or ``BCP_TRACE_DIR``) into one timeline and print a per-stage summary
(:mod:`bcp.trace_report`); ``--png`` draws ranks against time (:mod:`bcp.viz`);
``--disk-gbps`` / ``--network-gbps`` / ``--measure`` put the stages that move bytes
against the measured speed of the disk or the network."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bcp.cli.common import CliError, UsageError
from bcp.cli.render import human, rate, safe
from bcp.trace_report import Against, OperationSummary, Speeds, TraceError, merge, read_traces, summarise, write_merged

NAME = "trace"
HELP = "merge the per-rank trace files of a traced save or load; per-stage summary, stragglers"
DESCRIPTION = (
    "Merge DIR's trace files (*.rank<N>.json, written by a save or load with trace=DIR or BCP_TRACE_DIR=DIR) "
    "into one Chrome trace / Perfetto JSON file (open it in ui.perfetto.dev or chrome://tracing), and print "
    "per save or load, per stage: the time summed over ranks, the slowest rank, the median, the stragglers "
    "and the stage's speed (its bytes over its slowest rank's time, in MiB/s or GiB/s). Given the disk's and "
    "the network's measured speeds (--disk-gbps, --network-gbps, or --measure URI), also each stage that moves "
    "bytes through one of them (write, fetch, exchange) against that speed, on the host that spent longest in it."
)


def gbps_pair(text: str) -> tuple[float, float]:
    """``W`` or ``W,R`` (GB/s): write and read speeds; one number is both."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GB/s as W or W,R, got {text!r}") from None
    if len(values) not in (1, 2) or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected one or two speeds > 0 (W or W,R), got {text!r}")
    return values[0], values[-1]


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
    p.add_argument(
        "--disk-gbps",
        type=gbps_pair,
        metavar="W[,R]",
        help="one host's measured disk speed in GB/s, write and read (one number: both)",
    )
    p.add_argument(
        "--network-gbps",
        type=gbps_pair,
        metavar="W[,R]",
        help="one host's measured network speed in GB/s (to the object store; between hosts for exchanges)",
    )
    p.add_argument(
        "--measure",
        metavar="URI",
        help="measure the storage at URI (a scratch object written, read back and deleted) and use it as the "
        "disk's speed (a local path) or the network's (an object store); put it where the checkpoints are",
    )
    p.add_argument("--measure-mib", type=int, default=256, help="bytes --measure moves, in MiB (default 256)")
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
                "against": against_json(s.against),
            }
            for s in op.stages
        ],
    }


def against_json(a: Against | None) -> dict | None:
    if a is None:
        return None
    return {
        "resource": a.resource,
        "direction": a.direction,
        "speed_gbps": a.speed_gbps,
        "host": a.host,
        "bytes": a.nbytes,
        "seconds": a.seconds,
        "gbps": a.gbps,
        "share": a.share,
        "at_speed_seconds": a.at_speed_seconds,
    }


def print_summary(op: OperationSummary, pct: float) -> None:
    print(f"{safe(op.kind)} {safe(op.label)}: {len(op.ranks)} rank(s), {op.seconds:.3f} s (slowest rank)")
    print(
        f"  {'stage':<10} {'spans':>6} {'total s':>9} {'slowest s':>10} {'rank':>5} {'median s':>9} "
        f"{'bytes':>10} {'speed':>12}  stragglers (>{pct:g}% over median)"
    )
    for s in op.stages:
        rank, slowest = s.slowest
        speed = rate(s.gbps * 1e9) if s.nbytes and s.gbps > 0 else "-"
        late = ", ".join(f"{r} ({s.per_rank[r]:.3f} s)" for r in s.stragglers) or "-"
        print(
            f"  {safe(s.stage):<10} {s.spans:>6} {s.total_seconds:>9.3f} {slowest:>10.3f} {rank:>5} "
            f"{s.median_seconds:>9.3f} {human(s.nbytes) if s.nbytes else '-':>10} {speed:>12}  {late}"
        )
    measured = [s for s in op.stages if s.against is not None]
    if measured:
        print("  against the measured speeds (the host that spent longest in the stage, its ranks together):")
    for s in measured:
        a = s.against
        assert a is not None
        print(
            f"  {safe(s.stage):<10} {a.resource} {a.direction} {rate(a.speed_gbps * 1e9)}: host {safe(a.host)} moved "
            f"{human(a.nbytes)} in {a.seconds:.3f} s = {rate(a.gbps * 1e9)}, {a.share:.0%} of it "
            f"({a.at_speed_seconds:.3f} s at that speed)"
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
    try:
        write_merged(output, merge(docs))  # never through a link planted at the output's name
    except TraceError as e:
        raise CliError(str(e)) from None
    speeds = _speeds(args)
    summary = summarise(docs, straggler_pct=args.straggler_pct, speeds=speeds)
    if args.png:
        from bcp.viz import draw_timeline

        draw_timeline(docs, args.png)
    if args.json:
        document: dict[str, object] = {"merged": str(output), "operations": [as_json(op) for op in summary]}
        if speeds is not None:
            document["speeds"] = {"disk": speeds.disk, "network": speeds.network}
        print(json.dumps(document, indent=2))
        return 0
    for op in summary:
        print_summary(op, args.straggler_pct)
    print(f"timeline: {safe(str(output))} (open in ui.perfetto.dev or chrome://tracing)")
    if args.png:
        print(f"picture: {safe(args.png)}")
    return 0


def _speeds(args: argparse.Namespace) -> Speeds | None:
    """The speeds given, with the one ``--measure`` measured (it wins for its kind)."""
    disk, network = args.disk_gbps, args.network_gbps
    if args.measure:
        if args.measure_mib < 1:
            raise UsageError(f"--measure-mib must be >= 1, got {args.measure_mib}")
        from bcp.benchmark import storage_speed

        speed = storage_speed(args.measure, nbytes=args.measure_mib << 20)
        pair = (speed.write_gbps, speed.read_gbps)
        if speed.kind == "disk":
            disk = pair
        else:
            network = pair
        # on stderr: --json keeps stdout one document
        print(
            f"measured {safe(args.measure)} ({speed.kind}, {human(speed.nbytes)}): write {rate(pair[0] * 1e9)}, "
            f"read {rate(pair[1] * 1e9)}",
            file=sys.stderr,
        )
    if disk is None and network is None:
        return None
    return Speeds(disk=disk, network=network)
