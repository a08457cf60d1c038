"""``bcp gc ROOT``: delete a manager root's incomplete steps, unused generations and
the steps a retention policy drops, and what killed overwrites left in any committed
checkpoint under ROOT (:func:`bcp.retention.plan_gc`, ``run_gc``)."""

from __future__ import annotations

import argparse
import sys

from bcp.backends.storage_errors import redact
from bcp.cli.common import UsageError, backend_at, require_location
from bcp.cli.render import safe
from bcp.retention import RetentionPolicy, plan_gc, run_gc

NAME = "gc"
HELP = "delete incomplete steps, unused generations and steps a policy drops"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("root")
    p.add_argument("--keep-last", type=int)
    p.add_argument("--keep-every", type=int)
    p.add_argument(
        "--min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="leave incomplete saves and partial writes younger than this alone: they may be saves in progress "
        "(default 3600)",
    )
    p.add_argument("--dry-run", action="store_true")


def run(args: argparse.Namespace) -> int:
    policy: RetentionPolicy = {"keep_last": args.keep_last, "keep_every": args.keep_every}
    for name, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if args.min_age < 0:
        raise UsageError(f"--min-age must be >= 0, got {args.min_age:g}")
    backend = backend_at(args.root)
    require_location(backend, args.root)
    plan = plan_gc(backend, grace_seconds=args.min_age, **policy)
    verb = "would delete" if args.dry_run else "deleting"
    print(
        f"{verb}: {len(plan.expired)} expired step(s) {plan.expired}, {len(plan.incomplete)} incomplete "
        f"step(s) {plan.incomplete}, {len(plan.orphan_generations)} unused generation(s), "
        f"{len(plan.unfinished)} partial write(s)"
    )
    young = [f"incomplete step(s) {plan.young}"] if plan.young else []
    if plan.young_generations:
        young.append(f"{len(plan.young_generations)} unused generation(s)")
    if plan.young_unfinished:
        young.append(f"{len(plan.young_unfinished)} partial write(s)")
    if young:
        print(f"left alone: {', '.join(young)} younger than {args.min_age:g} s (maybe saves in progress)")
    if args.dry_run:
        return 0
    failures = run_gc(backend, plan)
    for failure in failures:
        print(f"bcp gc: could not delete {safe(redact(failure))}", file=sys.stderr)
    return 1 if failures else 0
