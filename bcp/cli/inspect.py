"""``bcp inspect URI``: one checkpoint's manifest, tensors and objects
(:func:`bcp.describe.describe`), as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bcp.backends.storage_errors import redact
from bcp.cli.common import CliError, UsageError, backend_at, require_location
from bcp.cli.render import human, raw, safe, show
from bcp.describe import describe
from bcp.errors import listed
from bcp.reader import CheckpointReader, open_checkpoint
from bcp.viz import MAX_WORLD

NAME = "inspect"
HELP = "manifest, tensors and objects of one checkpoint"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--layout",
        metavar="PNG",
        help="draw which writer rank holds which box of a tensor to the file PNG (viz extra)",
    )
    p.add_argument("--tensor", help="the tensor --layout draws (default: the largest)")
    p.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="--layout also outlines how N ranks read it (dim 0 split as torch.chunk / DTensor Shard(0) split it); "
        f"N is 1 to {MAX_WORLD:,}",
    )


def _stats_as_expected(stats: dict[str, Any]) -> bool:
    """Whether every member of ``stats`` is what bcp writes there: a count, a
    non-negative int64 (``tensors``, ``fragments``, ``tensor_bytes``, ...)."""
    return all(type(v) is int and 0 <= v < 2**63 for v in stats.values())


def run(args: argparse.Namespace) -> int:
    if not args.layout and (args.world is not None or args.tensor is not None):
        raise UsageError("--world and --tensor go with --layout PNG")
    require_location(backend_at(args.uri), args.uri, list_objects=False)
    reader = open_checkpoint(args.uri, allow_pickle=False)
    if args.layout:
        return draw(reader, args)
    doc = describe(reader)
    tensors = doc["tensors"]
    for t in tensors:
        if "error" in t:  # a catalog's text, shown on a terminal
            t["error"] = safe(redact(t["error"]))
    unreadable = sum("error" in t for t in tensors)
    status = 1 if unreadable else 0
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return status
    # created, the versions, stats and user_metadata are informative (FORMAT.md): the
    # manifest's reader checks only their JSON types, so any value is shown, never used
    print(f"checkpoint {show(doc['uri'])}")
    print(
        f"  saved {safe(doc['created'])} by {doc['world_size']} rank(s); bcp {safe(doc['bcp_version'])} "
        f"(format v{doc['format_version']}), torch {safe(doc['torch_version'])}"
    )
    stored = sum(t.get("bytes", 0) for t in tensors)  # the catalog's sizes, not the manifest's stats
    objects = doc["objects"]
    print(f"  {len(tensors)} tensors, {human(stored)}; {doc['data_files']} data file(s); {len(objects)} objects")
    owners: dict[str, list[int]] = {}
    for ref in doc["references"]:  # an incremental checkpoint: files it reads from siblings
        owners.setdefault(ref["checkpoint"], []).append(ref["bytes"])
    for owner, sizes in owners.items():
        print(f"  reads {len(sizes)} data file(s), {human(sum(sizes))}, of checkpoint {safe(owner)} beside it")
    if not _stats_as_expected(doc["stats"]):
        print(f"  stats: {raw(doc['stats'])}")
    if doc["user_metadata"]:
        print(f"  metadata: {raw(doc['user_metadata'])}")
    names = {t["fqn"]: safe(t["fqn"]) for t in tensors}
    width = max([len(n) for n in names.values()] + [3])
    print(f"\n  {'tensor':<{width}}  {'shape':<20} {'dtype':<14} {'frags':>5} {'bytes':>10}")
    for t in tensors:
        if "error" in t:
            print(f"  {names[t['fqn']]:<{width}}  unreadable: {t['error']}")
            continue
        print(
            f"  {names[t['fqn']]:<{width}}  {t['shape']!s:<20} {safe(t['dtype']):<14} {t['fragments']:>5} "
            f"{human(t['bytes']):>10}" + (f"  ({t['referenced']} in a sibling)" if t.get("referenced") else "")
        )
    if objects:
        print("\n  objects:")
        for fqn, text in objects.items():
            print(f"  {safe(fqn)} = {safe(text)}")
    if unreadable:
        print(f"bcp inspect: {unreadable} tensor(s) unreadable (shown above)", file=sys.stderr)
    return status


def draw(reader: CheckpointReader, args: argparse.Namespace) -> int:
    """``--layout``: one tensor's boxes by writer rank, as a PNG (:func:`bcp.viz.draw_layout`)."""
    if args.world is not None and not 1 <= args.world <= MAX_WORLD:
        raise UsageError(f"--world must be 1 to {MAX_WORLD:,}, got {args.world:,}")
    keys = reader.tensor_keys()
    fqn = args.tensor if args.tensor is not None else max(keys, key=lambda k: reader.meta(k).nbytes, default=None)
    if fqn is None:
        raise CliError(f"{show(reader.uri)} holds no tensor to draw")
    if fqn not in keys:
        raise UsageError(f"no tensor {safe(fqn)!r} in {show(reader.uri)}; --tensor is one of: {safe(listed(keys))}")
    meta = reader.meta(fqn)
    if meta.shape.numel() == 0 or not len(meta.shape):
        raise UsageError(f"{safe(fqn)} has shape {list(meta.shape)}: nothing to draw")
    from bcp.viz import draw_layout, reader_shares

    rects = draw_layout(meta.fragments, tuple(meta.shape), fqn, args.layout, world=args.world, entry=meta.entry)
    boxes = sum(r.kind == "fragment" for r in rects)
    print(
        f"{safe(fqn)} {list(meta.shape)}: {boxes} box(es) from {len({r.rank for r in rects if r.kind == 'fragment'})} "
        f"writer rank(s) drawn to {safe(args.layout)}"
    )
    if args.world:
        unit = "rows" if len(meta.shape) > 1 else "elements"
        print(f"read by {args.world} rank(s), dim 0 split as torch.chunk splits it:")
        shares = reader_shares(meta.entry, args.world)
        idle = [share.rank for share in shares if share.stop <= share.start]  # the last ranks, when rows run out
        for share in shares:
            if share.stop <= share.start:
                continue
            writers = ", ".join(map(str, share.writers))
            print(
                f"  reader {share.rank}: {unit} {share.start}-{share.stop - 1} from {share.boxes} stored box(es) "
                f"of writer rank(s) {writers}"
            )
        if idle:
            print(f"  reader {idle[0]}: nothing" if len(idle) == 1 else f"  readers {idle[0]}-{idle[-1]}: nothing")
    return 0
