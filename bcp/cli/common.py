"""What every command shares: its refusals (one line, exit 1 or 2), errors as one
line, the location check, and ``--import``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

from bcp.backends import Backend
from bcp.backends.file import file_directory
from bcp.backends.registry import backend_for, check_not_empty
from bcp.backends.storage_errors import redact
from bcp.cli.render import safe, show
from bcp.errors import CheckpointError

T = TypeVar("T")


class CliError(Exception):
    """A refusal the CLI explains in its one line (no type name, no traceback hint): exit 1."""


class NotFound(CliError):
    """The location or checkpoint named on the command line is not there: exit 1."""


class UsageError(CliError):
    """An option value out of range, or options that do not go together: exit 2, as
    argparse's own usage errors."""


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message (lines joined), credentials redacted,
    control characters escaped; the type is named when the message may not say."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " | ".join(lines) or type(error).__name__
    if not isinstance(error, CheckpointError | OSError | ValueError | TypeError | ImportError | CliError):
        text = f"{type(error).__name__}: {text}"
    return safe(redact(text))


def option(name: str, parse: Callable[[str], T], value: str) -> T:
    """``parse(value)``, its ValueError a usage error naming the option."""
    try:
        return parse(value)
    except ValueError as e:
        text = one_line(e)
        raise UsageError(text if name in text else f"{name}: {text}") from None


#: The arguments of any command that name a location or a file (positional and options).
LOCATION_ARGS = (
    "uri",
    "root",
    "src",
    "dst",
    "dir",
    "output",
    "png",
    "layout",
    "measure",
    "scratch_dir",
    "config",
    "json",
)


def backend_at(uri: str, **options: str) -> Backend:
    """``backend_for(uri, **options)``, where a URI or an option it cannot take (its
    ValueError or TypeError: ``s3:/bucket``, ``file:relative``, ``?fsync=maybe``) is a
    usage error (exit 2)."""
    try:
        return backend_for(uri, **options)
    except (ValueError, TypeError) as e:
        raise UsageError(one_line(e)) from e


def refuse_empty_locations(args: argparse.Namespace) -> None:
    """A usage error for a location given as ``""`` or whitespace (``bcp rm "$UNSET"``):
    as a path it would be the current directory (:func:`bcp.backends.registry.check_not_empty`)."""
    for name in LOCATION_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            what = name.upper() if name in ("uri", "root", "src", "dst", "dir") else "--" + name.replace("_", "-")
            try:
                check_not_empty(value, what)
            except ValueError as e:
                raise UsageError(str(e)) from None


def require_location(backend: Backend, uri: str, *, list_objects: bool = True) -> None:
    """Refuse, as not found, a location that does not exist: a local path that is not
    there or is not a directory; on other stores (``list_objects``), a prefix with no
    objects at all (an object store has no empty directories to tell apart)."""
    root = file_directory(backend)
    if root is not None:
        if not os.path.exists(root):
            raise NotFound(f"{show(uri)}: no such file or directory")
        if not os.path.isdir(root):
            raise NotFound(f"{show(uri)}: not a directory")
        return
    if list_objects and next(iter(backend.list("")), None) is None and next(iter(backend.unfinished("")), None) is None:
        raise NotFound(f"nothing at {show(uri)}")


def add_import_option(parser: argparse.ArgumentParser, dest: str) -> None:
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


def imports(args: argparse.Namespace) -> list[str]:
    """The --import modules given before and after the subcommand, in order, once each."""
    return list(dict.fromkeys([*args.imports, *getattr(args, "command_imports", [])]))
