"""``bcp inspect URI``: one checkpoint's manifest, tensors and objects
(:func:`bcp.describe.describe`), as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..backends import backend_for
from ..backends.errors import redact
from ..describe import describe
from ..reader import open_checkpoint
from .common import require_location
from .render import human, raw, safe, show

NAME = "inspect"
HELP = "manifest, tensors and objects of one checkpoint"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri")
    p.add_argument("--json", action="store_true")


def _stats_as_expected(stats: dict[str, Any]) -> bool:
    """Whether every member of ``stats`` is what bcp writes there: a count, a
    non-negative int64 (``tensors``, ``fragments``, ``tensor_bytes``, ...)."""
    return all(type(v) is int and 0 <= v < 2**63 for v in stats.values())


def run(args: argparse.Namespace) -> int:
    require_location(backend_for(args.uri), args.uri, list_objects=False)
    doc = describe(open_checkpoint(args.uri, allow_pickle=False))
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
            f"{human(t['bytes']):>10}"
        )
    if objects:
        print("\n  objects:")
        for fqn, text in objects.items():
            print(f"  {safe(fqn)} = {safe(text)}")
    if unreadable:
        print(f"bcp inspect: {unreadable} tensor(s) unreadable (shown above)", file=sys.stderr)
    return status
