"""``bcp convert SRC DST --to FORMAT``: bcp to safetensors / torch.save / DCP, or
safetensors / torch / DCP to bcp, through the public functions of :mod:`bcp.convert`
(looked up at each call)."""

from __future__ import annotations

import argparse
import os

from bcp import convert
from bcp.backends.uri_options import as_size
from bcp.cli.common import NotFound, UsageError, backend_at, option
from bcp.cli.render import human, progress, safe, show
from bcp.reader import PerRankChoice, open_checkpoint

NAME = "convert"
HELP = "bcp to safetensors / torch.save / DCP, or safetensors / torch / DCP to bcp"
DESCRIPTION = None


def configure(p: argparse.ArgumentParser) -> None:
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
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle: DCP's non-tensor entries, a checkpoint's pickled objects, a whole torch.save file",
    )
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


def _per_rank_choice(text: str) -> PerRankChoice:
    if text == "all":
        return "all"
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--per-rank takes 'all' or a saved rank (0, 1, ...), not {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    created = _missing_directories(args.dst)
    try:
        return _run(args)
    except BaseException:
        _remove_empty(created)  # a failed convert leaves no directory it created
        raise


def _local_path(uri: str) -> str | None:
    """The local path of a location given on the command line; None for other stores."""
    if "://" not in uri:
        return uri
    return uri.removeprefix("file://").partition("?")[0] if uri.startswith("file://") else None


def _missing_directories(dst: str) -> list[str]:
    """DST and its ancestors that do not exist yet, deepest first: what a conversion
    may create."""
    path = _local_path(dst)
    if path is None:
        return []
    missing = []
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return missing


def _remove_empty(paths: list[str]) -> None:
    """Remove each of ``paths`` (deepest first) that is now an empty directory (not a
    link); anything with files in it is kept."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                os.rmdir(path)
            except OSError:
                return  # not empty: nor are its parents


def _run(args: argparse.Namespace) -> int:
    prefix = args.prefix if args.prefix is not None else ("model." if args.model_only else None)
    strip = args.strip_prefix or (args.model_only and args.prefix is None)
    if args.to != "safetensors" and (args.dtype or args.rename or args.config):
        raise UsageError("--dtype, --rename and --config go with --to safetensors")
    if args.to == "dcp" and strip:
        raise UsageError("--to dcp keeps the state's nesting: select keys with --prefix, without --strip-prefix")
    if args.per_rank is not None and args.to not in ("torch", "dcp"):
        raise UsageError("--per-rank goes with --to torch and --to dcp (the exports that hold objects)")
    per_rank: PerRankChoice = "all" if args.per_rank is None else args.per_rank
    dtype = option("--dtype", convert.parse_dtype, args.dtype) if args.dtype else None
    rename = [option("--rename", convert.parse_rename, rule) for rule in args.rename]
    max_shard = option("--max-shard-size", lambda v: as_size("--max-shard-size", v), args.max_shard_size)
    batch = option("--batch-size", lambda v: as_size("--batch-size", v), args.batch_size)
    local = "://" not in args.src or args.src.startswith("file://")
    if local and not os.path.lexists(args.src.removeprefix("file://")):
        raise NotFound(f"{show(args.src)}: no such file or directory")
    for location in (args.src, args.dst):  # a URI or option no store takes: a usage error, before any work
        if ":" in location.partition("/")[0]:
            backend_at(location).close()
    src_format = args.source_format if args.source_format != "auto" else convert.detect_format(args.src)
    if args.to == "bcp":
        return _into_bcp(args, src_format)
    if src_format != "bcp":
        raise UsageError(f"--to {args.to} converts from bcp; convert {src_format} to bcp first")

    reader = open_checkpoint(args.src, allow_pickle=args.allow_pickle)
    total = sum(reader.meta(k).nbytes for k in reader.tensor_keys())
    with progress(total, f"converting to {args.to}") as bar:
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
                f"{len(index['weight_map'])} tensors, {human(index['metadata']['total_size'])} to {show(args.dst)}"
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
                f"wrote DCP checkpoint {show(args.dst)}: {exported.tensors} tensors, {exported.objects} objects, "
                f"{human(exported.tensor_bytes)}"
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
                overwrite=args.overwrite,
            )
            print(f"wrote {show(args.dst)}")
    if args.to != "safetensors":
        chosen = [k for k, _name in convert.select(reader.object_keys(), prefix, strip)]
        _report_per_rank(convert.per_rank_keys(reader, chosen), per_rank, reader.manifest.world_size)
    return 0


def _into_bcp(args: argparse.Namespace, src_format: str) -> int:
    src = _local_path(args.src) or args.src  # a file:// source of another format is a local path to it
    if src_format == "safetensors":
        info = convert.from_safetensors(src, args.dst, overwrite=args.overwrite)
    elif src_format == "torch":
        info = convert.from_torch(src, args.dst, overwrite=args.overwrite, allow_pickle=args.allow_pickle)
    elif src_format == "dcp":
        info, skipped = convert.from_dcp(
            src,
            args.dst,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            scratch_dir=args.scratch_dir,
        )
        if skipped:
            shown = ", ".join(safe(k) for k in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
            print(f"skipped {len(skipped)} non-tensor entries that need --allow-pickle: {shown}")
    else:
        raise UsageError("the source is already a bcp checkpoint")
    print(f"wrote {show(info.uri)}: {info.tensors} tensors, {human(info.tensor_bytes)}")
    return 0


def _report_per_rank(keys: list[str], per_rank: PerRankChoice, world_size: int) -> None:
    """Say what became of the per-rank objects: every rank's value is kept under rank
    keys (which a load must ask for), or one saved rank's value was chosen."""
    if not keys:
        return
    shown = ", ".join(safe(k) for k in keys[:10]) + (", ..." if len(keys) > 10 else "")
    if per_rank == "all":
        print(
            f"{len(keys)} per-rank object(s), saved by {world_size} ranks, written with every rank's value under "
            f"'__rank_<r>__' keys (docs/interop.md; --per-rank N keeps saved rank N's only): {shown}"
        )
    else:
        print(f"{len(keys)} per-rank object(s) written with saved rank {per_rank}'s value only: {shown}")
