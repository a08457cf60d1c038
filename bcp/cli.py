"""The ``bcp`` command line: ls, inspect, verify, convert, rm, gc, bench, conformance.

Exit status, the same for every command:

* 0: done (``verify``: every check passed).
* 1: the location or checkpoint is missing, or bad (a check failed, a tensor is
  unreadable), or the work failed: one line on stderr (``--debug``: the traceback).
* 2: the command line is wrong: an unknown option, a missing argument (argparse's own
  message), an option value out of range or options that do not go together.
* 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback
import unicodedata
from typing import TYPE_CHECKING, Any

from .backends.errors import redact, redact_uri
from .backends.options import as_size

if TYPE_CHECKING:
    from .reader import PerRankChoice

log = logging.getLogger(__name__)

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _safe(text: object) -> str:
    """``text`` fit for a terminal: control and format characters (Unicode categories
    C*, and the line/paragraph separators: ESC, CR, BEL, bidi overrides, ...) escaped
    as ``repr`` would, so a key or message cannot move the cursor or reorder a line."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        cat = unicodedata.category(ch)
        if cat[0] == "C" or cat in ("Zl", "Zp"):
            o = ord(ch)
            out.append(
                _ESCAPES.get(ch) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
            )
        else:
            out.append(ch)
    return "".join(out)


def _show(uri: str) -> str:
    """A URI or path as printed: credentials redacted, control characters escaped."""
    return _safe(redact_uri(str(uri)))


def _conformance(args: argparse.Namespace) -> int:
    from .extras import needs_extra

    with needs_extra("conformance", "bcp conformance"):  # the suite is pytest tests
        from bcp.conformance.runner import run_suite

    return run_suite(
        args.uri,
        level="quick" if args.quick else "full",
        options=args.option,
        json_path=args.json,
        imports=_imports(args),
        keyword=args.k,
        verbose=args.verbose,
        probe_mib=args.probe_mib,
    )


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(created: str | None) -> str:
    if not created:
        return "-"
    then = datetime.datetime.fromisoformat(created)
    if then.tzinfo is None:
        raise ValueError(f"created timestamp {created!r} has no time zone")
    seconds = (datetime.datetime.now(datetime.UTC) - then).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _ls(args) -> int:
    from bcp.backends import backend_for
    from bcp.housekeeping import FIND_MAX_DEPTH, find_checkpoints

    backend = backend_for(args.root)
    _require_location(backend, args.root)
    result = find_checkpoints(backend, sizes=True)
    rows = [_ls_row(backend, found) for found in result.checkpoints]
    _mark_latest(rows)
    if result.truncated:
        print(f"bcp ls: stopped listing after {len(rows)} checkpoint(s); there may be more", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "age"} for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no checkpoints under {_show(args.root)} (looked {FIND_MAX_DEPTH} levels deep)")
        return 0
    print(f"{'step':>12}  {'status':<10} {'size':>10} {'objects':>7} {'age':>6}  {'kind':<9}  location")
    for r in rows:
        mark = "  <- latest" if r["latest"] else ""
        why = f"  ({r['error']})" if "error" in r else ""
        step = "-" if r["step"] is None else r["step"]
        print(
            f"{step:>12}  {r['status']:<10} {_human(r['bytes']):>10} {r['objects']:>7} "
            f"{r.get('age', '-'):>6}  {r['kind']:<9}  {_safe(r['path'] or '.')}{mark}{why}"
        )
    return 0


def _mark_latest(rows: list[dict[str, Any]]) -> None:
    """Mark the newest committed step of each manager root: what its
    CheckpointManager.latest() would load."""
    newest: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["kind"] == "step" and row["status"] == "committed":
            manager_root = row["path"].rpartition("/")[0]
            if manager_root not in newest or row["step"] > newest[manager_root]["step"]:
                newest[manager_root] = row
    for row in newest.values():
        row["latest"] = True


def _ls_row(backend, found) -> dict[str, Any]:
    """One checkpoint as ``bcp ls`` shows it; a committed one's manifest gives its age.
    One unreadable manifest must not hide the other checkpoints."""
    from bcp.commit import read_manifest

    row: dict[str, Any] = {
        "path": found.path,
        "kind": found.kind,
        "step": found.step,
        "status": "committed" if found.committed else "incomplete",
        "objects": found.objects,
        "bytes": found.bytes,
        "created": None,
        "latest": False,
    }
    if found.committed:
        try:
            manifest = read_manifest(backend, f"{found.path}/" if found.path else "")
            row["created"] = manifest.created if manifest else None
            row["age"] = _age(row["created"])
        except Exception as e:
            log.debug("checkpoint %r of %s is unreadable", found.path, backend.uri, exc_info=True)
            row.update(status="unreadable", created=None, error=_one_line(e))
    return row


def _raw(value: object, limit: int = 200) -> str:
    """A manifest value as JSON, one line, cut at ``limit`` characters, escaped and
    redacted for the terminal."""
    text = json.dumps(value, default=str)
    return _safe(redact(text if len(text) <= limit else text[: limit - 3] + "..."))


def _stats_as_expected(stats: dict[str, Any]) -> bool:
    """Whether every member of ``stats`` is what bcp writes there: a count, a
    non-negative int64 (``tensors``, ``fragments``, ``tensor_bytes``, ...)."""
    return all(type(v) is int and 0 <= v < 2**63 for v in stats.values())


def _inspect(args) -> int:
    import bcp
    from bcp.backends import backend_for

    _require_location(backend_for(args.uri), args.uri, list_objects=False)
    reader = bcp.open(args.uri, allow_pickle=False)
    m = reader.manifest
    tensors: list[dict[str, Any]] = []  # JSON rows
    unreadable = 0
    for fqn in reader.tensor_keys():
        try:  # one tensor whose catalog rows are bad (do not tile, say) must not hide the others
            meta = reader.meta(fqn)
        except bcp.CheckpointError as e:
            log.debug("tensor %r of %s is unreadable", fqn, reader.uri, exc_info=True)
            tensors.append({"fqn": fqn, "error": _one_line(e)})
            unreadable += 1
            continue
        tensors.append(
            {
                "fqn": fqn,
                "shape": list(meta.shape),
                "dtype": str(meta.dtype).removeprefix("torch."),
                "fragments": len(meta.fragments),
                "bytes": meta.nbytes,
            }
        )
    objects = {}
    for fqn in reader.object_keys():
        per_rank = reader.is_per_rank(fqn)
        try:
            value = reader.read_object(fqn) if not per_rank else f"<per rank: {len(reader.per_rank_objects(fqn))}>"
            text = repr(value)
        except bcp.CheckpointError as e:
            text = f"<{e}>"
        objects[fqn] = text if len(text) <= 120 else text[:117] + "..."
    doc = {
        "uri": reader.uri,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "bcp_version": m.bcp_version,
        "format_version": m.version,
        "torch_version": m.torch_version,
        "stats": m.stats,
        "user_metadata": m.user_metadata,
        "data_files": len(m.data_files),
        "tensors": tensors,
        "objects": objects,
    }
    status = 1 if unreadable else 0
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return status
    # created, the versions, stats and user_metadata are informative (FORMAT.md): the
    # manifest's reader checks only their JSON types, so any value is shown, never used
    print(f"checkpoint {_show(reader.uri)}")
    print(
        f"  saved {_safe(m.created)} by {m.world_size} rank(s); bcp {_safe(m.bcp_version)} (format v{m.version}), "
        f"torch {_safe(m.torch_version)}"
    )
    stored = sum(t.get("bytes", 0) for t in tensors)  # the catalog's sizes, not the manifest's stats
    print(f"  {len(tensors)} tensors, {_human(stored)}; {len(m.data_files)} data file(s); {len(objects)} objects")
    if not _stats_as_expected(m.stats):
        print(f"  stats: {_raw(m.stats)}")
    if m.user_metadata:
        print(f"  metadata: {_raw(m.user_metadata)}")
    names = {t["fqn"]: _safe(t["fqn"]) for t in tensors}
    width = max([len(n) for n in names.values()] + [3])
    print(f"\n  {'tensor':<{width}}  {'shape':<20} {'dtype':<14} {'frags':>5} {'bytes':>10}")
    for t in tensors:
        if "error" in t:
            print(f"  {names[t['fqn']]:<{width}}  unreadable: {t['error']}")
            continue
        print(
            f"  {names[t['fqn']]:<{width}}  {t['shape']!s:<20} {_safe(t['dtype']):<14} {t['fragments']:>5} "
            f"{_human(t['bytes']):>10}"
        )
    if objects:
        print("\n  objects:")
        for fqn, text in objects.items():
            print(f"  {_safe(fqn)} = {_safe(text)}")
    if unreadable:
        print(f"bcp inspect: {unreadable} tensor(s) unreadable (shown above)", file=sys.stderr)
    return status


def _verify(args) -> int:
    from bcp.backends import backend_for
    from bcp.verify import verify_checkpoint

    _require_location(backend_for(args.uri), args.uri, list_objects=False)
    report = verify_checkpoint(args.uri, progress=_progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for problem in report["problems"]:
            print(f"PROBLEM {_safe(redact(problem))}")
        print(
            f"{'OK' if report['ok'] else 'FAILED'}: {report['tensors']} tensors; "
            f"{report['fragments_ok']} of {report['fragments']} stored fragment(s) ({_human(report['bytes_read'])}) "
            f"read and matched their checksums in {report['seconds']:.1f} s; {len(report['problems'])} problem(s)"
        )
    return 0 if report["ok"] else 1


def _convert(args) -> int:
    from bcp import convert

    prefix = args.prefix if args.prefix is not None else ("model." if args.model_only else None)
    strip = args.strip_prefix or (args.model_only and args.prefix is None)
    if args.to != "safetensors" and (args.dtype or args.rename or args.config):
        raise _UsageError("--dtype, --rename and --config go with --to safetensors")
    if args.to == "dcp" and strip:
        raise _UsageError("--to dcp keeps the state's nesting: select keys with --prefix, without --strip-prefix")
    if args.per_rank is not None and args.to not in ("torch", "dcp"):
        raise _UsageError("--per-rank goes with --to torch and --to dcp (the exports that hold objects)")
    per_rank: PerRankChoice = "all" if args.per_rank is None else args.per_rank
    dtype = _option("--dtype", convert.parse_dtype, args.dtype) if args.dtype else None
    rename = [_option("--rename", convert.parse_rename, rule) for rule in args.rename]
    max_shard = _option("--max-shard-size", lambda v: as_size("--max-shard-size", v), args.max_shard_size)
    batch = _option("--batch-size", lambda v: as_size("--batch-size", v), args.batch_size)
    local = "://" not in args.src or args.src.startswith("file://")
    if local and not os.path.lexists(args.src.removeprefix("file://")):
        raise _NotFound(f"{_show(args.src)}: no such file or directory")
    src_format = args.source_format if args.source_format != "auto" else convert.detect_format(args.src)
    if args.to == "bcp":
        if src_format == "safetensors":
            info = convert.from_safetensors(args.src, args.dst, overwrite=args.overwrite)
        elif src_format == "torch":
            info = convert.from_torch(args.src, args.dst, overwrite=args.overwrite)
        elif src_format == "dcp":
            info, skipped = convert.from_dcp(
                args.src,
                args.dst,
                overwrite=args.overwrite,
                allow_pickle=args.allow_pickle,
                scratch_dir=args.scratch_dir,
            )
            if skipped:
                shown = ", ".join(_safe(k) for k in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
                print(f"skipped {len(skipped)} non-tensor entries that need --allow-pickle: {shown}")
        else:
            raise _UsageError("the source is already a bcp checkpoint")
        print(f"wrote {_show(info.uri)}: {info.tensors} tensors, {_human(info.tensor_bytes)}")
        return 0
    if src_format != "bcp":
        raise _UsageError(f"--to {args.to} converts from bcp; convert {src_format} to bcp first")
    import bcp

    reader = bcp.open(args.src)
    total = sum(reader.meta(k).nbytes for k in reader.tensor_keys())
    with _progress(total, f"converting to {args.to}") as bar:
        if args.to == "safetensors":
            index = convert.to_safetensors(
                reader,
                args.dst,
                prefix=prefix,
                strip_prefix=strip,
                rename=rename,
                dtype=dtype,
                config=args.config,
                max_shard_bytes=max_shard,
                progress=bar.update,
                overwrite=args.overwrite,
            )
            print(
                f"wrote {len(set(index['weight_map'].values()))} safetensors file(s), "
                f"{len(index['weight_map'])} tensors, {_human(index['metadata']['total_size'])} to {_show(args.dst)}"
            )
        elif args.to == "dcp":
            exported = convert.to_dcp(
                reader,
                args.dst,
                prefix=prefix,
                overwrite=args.overwrite,
                batch_bytes=batch,
                progress=bar.update,
                per_rank=per_rank,
            )
            print(
                f"wrote DCP checkpoint {_show(args.dst)}: {exported.tensors} tensors, {exported.objects} objects, "
                f"{_human(exported.tensor_bytes)}"
            )
        else:
            convert.to_torch(
                reader,
                args.dst,
                prefix=prefix,
                strip_prefix=strip,
                scratch_dir=args.scratch_dir,
                progress=bar.update,
                per_rank=per_rank,
            )
            print(f"wrote {_show(args.dst)}")
    if args.to != "safetensors":
        chosen = [k for k, _name in convert.select(reader.object_keys(), prefix, strip)]
        _report_per_rank(convert.per_rank_keys(reader, chosen), per_rank, reader.manifest.world_size)
    return 0


def _report_per_rank(keys: list[str], per_rank: object, world_size: int) -> None:
    """Say what became of the per-rank objects: every rank's value is kept under rank
    keys (which a load must ask for), or one saved rank's value was chosen."""
    if not keys:
        return
    shown = ", ".join(_safe(k) for k in keys[:10]) + (", ..." if len(keys) > 10 else "")
    if per_rank == "all":
        print(
            f"{len(keys)} per-rank object(s), saved by {world_size} ranks, written with every rank's value under "
            f"'__rank_<r>__' keys (docs/interop.md; --per-rank N keeps saved rank N's only): {shown}"
        )
    else:
        print(f"{len(keys)} per-rank object(s) written with saved rank {per_rank}'s value only: {shown}")


def _rm(args) -> int:
    """Delete one checkpoint: its manifest first, then its generations (``gen-*/``).
    Nothing else: not other files in the location, not a location without a
    manifest (unless --force), never through a symbolic link."""
    from bcp.backends import backend_for
    from bcp.commit import delete_checkpoint
    from bcp.metadata.layout import MANIFEST_KEY, generation_of

    backend = backend_for(args.uri)
    where = _show(args.uri)
    root = getattr(backend.unwrap(), "root", None)
    if backend.unwrap().scheme == "file" and isinstance(root, str) and os.path.islink(root):
        raise _CliError(f"{where} is a symbolic link; bcp rm does not delete through links (remove the link itself)")
    _require_location(backend, args.uri)
    keys = sorted(backend.list(""))
    if not keys:
        raise _NotFound(f"nothing at {where}")
    generations = sorted({g for g in map(generation_of, keys) if g is not None})
    ours = [k for k in keys if k == MANIFEST_KEY or generation_of(k) is not None]
    others = [k for k in keys if k not in set(ours)]
    committed = MANIFEST_KEY in keys
    if not committed and not args.force:
        raise _CliError(
            f"{where} has no {MANIFEST_KEY}: not a committed bcp checkpoint ({len(keys)} object(s), "
            f"{len(generations)} bcp generation(s)); pass --force to delete its bcp objects "
            f"({MANIFEST_KEY}, gen-*/) anyway"
        )
    what = (
        f"{len(ours)} object(s) of {'the' if committed else 'an uncommitted'} checkpoint at {where}"
        f" ({MANIFEST_KEY if committed else 'no manifest'}; generation(s) {', '.join(generations) or '-'})"
    )
    left = ""
    if others:
        shown = ", ".join(_safe(k) for k in others[:5]) + (", ..." if len(others) > 5 else "")
        left = f"; leaving {len(others)} object(s) that are not bcp's: {shown}"
    if args.dry_run:
        print(f"would delete {what}{left}")
        return 0
    delete_checkpoint(backend, only_bcp=True)  # the manifest first, then gen-*/ (partial files too)
    print(f"deleted {what}{left}")
    return 0


def _gc(args) -> int:
    from bcp.backends import backend_for
    from bcp.housekeeping import plan_gc, run_gc

    policy = {"keep_last": args.keep_last, "keep_every": args.keep_every}
    for name, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise _UsageError(f"{name} must be >= 1, got {value}")
    if args.min_age < 0:
        raise _UsageError(f"--min-age must be >= 0, got {args.min_age:g}")
    backend = backend_for(args.root)
    _require_location(backend, args.root)
    plan = plan_gc(backend, grace_seconds=args.min_age, **policy)
    verb = "would delete" if args.dry_run else "deleting"
    print(
        f"{verb}: {len(plan.expired)} expired step(s) {plan.expired}, {len(plan.incomplete)} incomplete "
        f"step(s) {plan.incomplete}, {len(plan.orphan_generations)} unused generation(s), "
        f"{len(plan.unfinished)} partial write(s)"
    )
    if plan.young:
        print(f"left alone: incomplete step(s) {plan.young} younger than {args.min_age:g} s (maybe saves in progress)")
    if args.dry_run:
        return 0
    failures = run_gc(backend, plan)
    for failure in failures:
        print(f"bcp gc: could not delete {_safe(redact(failure))}", file=sys.stderr)
    return 1 if failures else 0


def _bench(args) -> int:
    import statistics

    import torch

    import bcp
    from bcp.backends import backend_for
    from bcp.target import join_uri

    if not args.gib > 0:
        raise _UsageError(f"--gib must be > 0, got {args.gib:g}")
    if args.repeats < 1:
        raise _UsageError(f"--repeats must be >= 1, got {args.repeats}")
    n = max(1, int(args.gib * 2**30 / 4 / 16))
    state = {f"t{i}": torch.rand(n) for i in range(16)}
    size = 16 * n * 4
    saves, loads = [], []
    backend = backend_for(args.uri)
    root = _local_root(backend)
    made = _missing_top(root) if root is not None else None
    scratch = f"bcp-bench-{os.getpid()}-{time.time_ns()}"
    try:
        for rep in range(args.repeats):
            name = f"{scratch}-{rep}"
            uri = join_uri(args.uri, name)
            try:
                start = time.perf_counter()
                bcp.save(state, uri)
                saves.append(time.perf_counter() - start)
                template = {k: torch.empty_like(v) for k, v in state.items()}
                start = time.perf_counter()
                bcp.load(template, uri)
                loads.append(time.perf_counter() - start)
            finally:
                _delete_scratch(backend, f"{name}/")
            print(
                f"  run {rep + 1}: save {size / saves[-1] / 1e9:.2f} GB/s, load {size / loads[-1] / 1e9:.2f} GB/s",
                flush=True,
            )
    finally:
        if made is not None and isinstance(root, str):
            _remove_empty_dirs(root, made)
    print(
        f"{_human(size)} through {_show(args.uri.partition('?')[0])}, median of {args.repeats}: "
        f"save {size / statistics.median(saves) / 1e9:.2f} GB/s, load {size / statistics.median(loads) / 1e9:.2f} GB/s"
    )
    return 0


def _delete_scratch(backend, prefix: str) -> None:
    """Delete one scratch checkpoint of ``bcp bench``, with the partial writes of a save
    that was interrupted (the file backend prunes the directories it empties). A
    failure is one line on stderr: it must not hide the error that stopped the run."""
    try:
        for pending in backend.unfinished(prefix):
            backend.delete_unfinished(pending.name)
        backend.delete_prefix(prefix)
    except Exception as e:  # noqa: BLE001 - reported, and the run's own outcome stands
        print(f"bcp bench: could not delete the scratch checkpoint {_safe(prefix)}: {_one_line(e)}", file=sys.stderr)


def _missing_top(path: str) -> str | None:
    """The outermost directory of ``path`` that does not exist yet (``path`` itself,
    or one of its parents), or None if ``path`` exists."""
    top = None
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        top, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return top


def _remove_empty_dirs(path: str, top: str) -> None:
    """Remove ``path`` and its parents up to ``top`` (the directories a command
    created), each only if empty: what someone else put there stays."""
    path = os.path.abspath(path)
    while True:
        try:
            os.rmdir(path)
        except OSError:
            log.info("left %s: not empty", path)
            return
        if path == top or os.path.dirname(path) == path:
            return
        path = os.path.dirname(path)


def build_parser() -> argparse.ArgumentParser:
    from bcp import __version__

    parser = argparse.ArgumentParser(
        prog="bcp",
        description="bcp checkpoints: storage checks and tools",
        epilog="exit status: 0 done; 1 the location or checkpoint is missing or bad, a check failed, "
        "or the work failed; 2 a wrong command line; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"bcp {__version__}")
    parser.add_argument(
        "--log-level",
        type=_log_level,
        help="level of bcp's own log messages (default WARNING); other libraries stay at WARNING",
    )
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback, not one line")
    _add_import_option(parser, "imports")
    sub = parser.add_subparsers(dest="command", required=True)

    conf = sub.add_parser(
        "conformance",
        help="check that a storage backend keeps bcp's contracts",
        description="Run the object contract, the checkpoint contract and a performance probe "
        "against URI (an empty location), print a report grouped by capability; "
        "exit status 1 if any check failed.",
    )
    conf.add_argument("uri", help="root URI of an empty location in the store (query options allowed)")
    level = conf.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_true", help="skip killed-process checks, small probe")
    level.add_argument("--full", action="store_true", help="everything (default)")
    conf.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="storage option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000",
    )
    conf.add_argument("--json", metavar="PATH", help="also write the report as JSON (for CI)")
    conf.add_argument("--probe-mib", type=int, metavar="N", help="probe object size (default 256 full, 32 quick)")
    conf.add_argument("-k", metavar="EXPR", help="only checks matching this pytest -k expression")
    conf.add_argument("--verbose", "-v", action="store_true", help="list every check as it runs")
    conf.set_defaults(func=_conformance)

    p = sub.add_parser(
        "ls",
        help="checkpoints under a root, in any layout: committed or incomplete, size, age, kind",
        description="List the checkpoints under ROOT: ROOT itself, a manager's step_<N> directories, and any "
        "other location up to 3 levels below ROOT (one listing, stopped after 1,000,000 objects).",
    )
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_ls)

    p = sub.add_parser("inspect", help="manifest, tensors and objects of one checkpoint")
    p.add_argument("uri")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("verify", help="re-read every fragment; check checksums, sizes and coverage")
    p.add_argument("uri")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_verify)

    p = sub.add_parser("convert", help="bcp to safetensors / torch.save / DCP, or safetensors / torch / DCP to bcp")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=("safetensors", "torch", "bcp", "dcp"))
    p.add_argument(
        "--from", dest="source_format", default="auto", choices=("auto", "bcp", "safetensors", "torch", "dcp")
    )
    p.add_argument("--model-only", action="store_true", help="only keys under 'model.', with that prefix stripped")
    p.add_argument("--prefix", help="only keys starting with this")
    p.add_argument("--strip-prefix", action="store_true", help="drop --prefix from the output names")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard cap (default 5GB)")
    p.add_argument("--scratch-dir", help="where file-backed buffers go (default: beside the output / the temp dir)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing bcp checkpoint at DST; --to safetensors: write into a non-empty DST, "
        "removing the index and *.safetensors files the new export does not write (nothing else)",
    )
    p.add_argument("--allow-pickle", action="store_true", help="DCP: also convert non-tensor entries (unpickles them)")
    p.add_argument(
        "--dtype", help="--to safetensors: cast floating-point tensors (only those) to bf16, fp16, fp32, fp64"
    )
    p.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="REGEX=REPLACEMENT",
        help="--to safetensors: rename output names with re.sub after --prefix handling; repeatable, applied in order",
    )
    p.add_argument("--config", help="--to safetensors: a config.json (checked as JSON) to copy next to the shards")
    p.add_argument(
        "--batch-size", default="1GiB", help="--to dcp: tensor bytes read and written per data file (default 1GiB)"
    )
    p.add_argument(
        "--per-rank",
        type=_per_rank_choice,
        metavar="all|N",
        help="--to torch / dcp: objects saved per rank (RNG, dataloader position) keep every rank's value under "
        "'__rank_<r>__' keys (all, the default), or only saved rank N's value",
    )
    p.set_defaults(func=_convert)

    p = sub.add_parser(
        "rm",
        help="delete one checkpoint (its manifest first)",
        description="Delete the checkpoint at URI: manifest.json first, then its generations (gen-*/). "
        "Other objects there are left and named. A location without manifest.json is refused unless --force; "
        "a local location that is a symbolic link is always refused.",
    )
    p.add_argument("uri")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--force", action="store_true", help="also delete an uncommitted checkpoint (no manifest.json)")
    p.set_defaults(func=_rm)

    p = sub.add_parser("gc", help="delete incomplete steps, unused generations and steps a policy drops")
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
    p.set_defaults(func=_gc)

    p = sub.add_parser("bench", help="save and load a synthetic state through URI; GB/s")
    p.add_argument("uri", help="a location to write scratch checkpoints under (they are deleted)")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=_bench)
    for command in sub.choices.values():  # every subcommand takes it too, after its name
        _add_import_option(command, "command_imports")
    return parser


def _add_import_option(parser: argparse.ArgumentParser, dest: str) -> None:
    """``--import MODULE`` (repeatable). The top level and the subcommands keep it
    under different names: argparse lets a subcommand's default overwrite the top
    level's value."""
    parser.add_argument(
        "--import",
        dest=dest,
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (repeatable; the current directory is searched): a module that "
        "registers a backend with register_backend() and is not an installed plugin",
    )


def _imports(args: argparse.Namespace) -> list[str]:
    """The --import modules given before and after the subcommand, in order, once each."""
    return list(dict.fromkeys([*args.imports, *getattr(args, "command_imports", [])]))


class _CliError(Exception):
    """A refusal the CLI explains in its one line (no type name, no traceback hint): exit 1."""


class _NotFound(_CliError):
    """The location or checkpoint named on the command line is not there: exit 1."""


class _UsageError(_CliError):
    """An option value out of range, or options that do not go together: exit 2, as
    argparse's own usage errors."""


def _require_location(backend, uri: str, *, list_objects: bool = True) -> None:
    """Refuse, as not found, a location that does not exist: a local path that is not
    there or is not a directory; on other stores (``list_objects``), a prefix with no
    objects at all (an object store has no empty directories to tell apart)."""
    root = _local_root(backend)
    if root is not None:
        if not os.path.exists(root):
            raise _NotFound(f"{_show(uri)}: no such file or directory")
        if not os.path.isdir(root):
            raise _NotFound(f"{_show(uri)}: not a directory")
        return
    if list_objects and next(iter(backend.list("")), None) is None and next(iter(backend.unfinished("")), None) is None:
        raise _NotFound(f"nothing at {_show(uri)}")


def _local_root(backend) -> str | None:
    """The directory of a backend that stores files in a local directory (the file
    backend, or a plugin built on it), else None."""
    from bcp.backends.file import FileBackend

    inner = backend.unwrap()
    return inner.root if isinstance(inner, FileBackend) else None


def _option(name: str, parse, value):
    """``parse(value)``, its ValueError a usage error naming the option."""
    try:
        return parse(value)
    except ValueError as e:
        text = _one_line(e)
        raise _UsageError(text if name in text else f"{name}: {text}") from None


def _import_plugins(args: argparse.Namespace) -> None:
    """Import the --import modules before the command uses any URI."""
    from bcp.backends.registry import import_plugins

    import_plugins(_imports(args))


def _log_level(text: str) -> int:
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(f"unknown log level {text!r} (DEBUG, INFO, WARNING, ERROR)")
    return level


def _per_rank_choice(text: str) -> PerRankChoice:
    if text == "all":
        return "all"
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--per-rank takes 'all' or a saved rank (0, 1, ...), not {text!r}")
    return int(text)


def _library_failure(error: BaseException) -> Exception | None:
    """PyTorch DCP's ``CheckpointException`` (a ``BaseException``, so ``except
    Exception`` misses it, with every failed rank's traceback as its message) as
    bcp's one-line ConversionError; None for anything else."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is None or not isinstance(error, api.CheckpointException):
        return None
    from bcp.interop.dcp import conversion_error

    converted = conversion_error(error, "PyTorch DCP failed")
    converted.__cause__ = error
    return converted


def _one_line(error: BaseException) -> str:
    """``error`` as one line: its message (lines joined), credentials redacted,
    control characters escaped; the type is named when the message may not say."""
    from bcp.errors import CheckpointError

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " | ".join(lines) or type(error).__name__
    if not isinstance(error, CheckpointError | OSError | ValueError | TypeError | ImportError | _CliError):
        text = f"{type(error).__name__}: {text}"
    return _safe(redact(text))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # --log-level is for bcp's own loggers: the root stays at WARNING, so other
    # libraries (botocore prints request headers at DEBUG) stay quiet
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.log_level is not None:  # unset, bcp's loggers follow the root (and a caller's set-up is kept)
        logging.getLogger("bcp").setLevel(args.log_level)
    try:
        _import_plugins(args)
        return args.func(args)
    except KeyboardInterrupt:
        print(f"bcp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error: one line (the traceback with --debug), exit 1
        return _report(args, e)
    except BaseException as e:  # DCP's CheckpointException, the one BaseException reported as an error
        converted = _library_failure(e)
        if converted is None:
            raise
        return _report(args, converted)


def _report(args: argparse.Namespace, e: BaseException) -> int:
    """Print ``e`` as one line (its traceback with --debug); the exit status: 2 for a
    usage error, else 1."""
    from bcp.errors import CheckpointNotFoundError

    if args.debug:
        text = "".join(traceback.format_exception(e))
        print("\n".join(_safe(redact(line)) for line in text.splitlines()), file=sys.stderr)
    else:
        hint = "" if isinstance(e, _CliError | CheckpointNotFoundError) else " (--debug shows the traceback)"
        print(f"bcp {args.command}: {_one_line(e)}{hint}", file=sys.stderr)
    return 2 if isinstance(e, _UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
