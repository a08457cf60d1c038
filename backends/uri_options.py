"""Typed backend options from URI query strings (always text) or keyword arguments."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from bcp.backends.storage_errors import redact_uri

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def as_size(name: str, value: object) -> int:
    """Bytes from an int or a string: ``"64MiB"`` and ``"8M"`` are binary,
    ``"5GB"`` is decimal (as Hugging Face shard sizes are), ``"1048576"`` bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name}={value!r} is not a size (examples: 1048576, 64MiB, 8M, 5GB)")
    decimal = (m.group(3) or "").upper() == "B"
    return int(float(m.group(1)) * (1000 if decimal else 1024) ** _POWERS[m.group(2).upper()])


def as_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"option {name}={value!r} is not a boolean (true/false)")


def as_int(name: str, value: object, *, minimum: int = 0) -> int:
    try:
        n = int(value)  # type: ignore[call-overload]  # any value: int() raises what the except turns into a message
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not an integer") from None
    if n < minimum:
        raise ValueError(f"option {name}={value!r} must be >= {minimum}")
    return n


def as_timeout(value: object) -> float | None:
    """Seconds from ``timeout=...``; None for ``0``/``none`` (no limit of bcp's own)."""
    if value is None or str(value).strip().lower() == "none":
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]  # any value: float() raises what the except reports
    except (TypeError, ValueError):
        raise ValueError(f"option timeout={value!r} is not a number of seconds (0 or none: no limit)") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"option timeout={value!r} must be a number >= 0")
    return seconds or None


def _size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


#: Upload parts are at most the staging slab (32 MiB) and a multiple of 64 KiB.
MAX_PART_SIZE = 32 << 20
PART_SIZE_MULTIPLE = 64 << 10


def check_part_size(
    part_size: int, *, minimum: int, maximum: int = MAX_PART_SIZE, multiple: int = PART_SIZE_MULTIPLE
) -> None:
    """ValueError unless ``part_size`` is within the store's bounds and a multiple of
    ``multiple`` (the part-writing backends share these limits' shape)."""
    if not minimum <= part_size <= maximum or part_size % multiple:
        raise ValueError(
            f"option part_size={part_size}: must be {_size_label(minimum)}..{_size_label(maximum)} "
            f"and a multiple of {_size_label(multiple)}"
        )


def reject_unknown(kind: str, uri: str, options: dict, known: Iterable[str] | None = None) -> None:
    """TypeError naming every option nobody consumed (values are not shown: they may be
    secrets), and the ones the backend takes when ``known`` lists them."""
    if options:
        if known is None:
            takes = "the options of each backend are in docs/backends.md, Options"
        else:
            names = sorted(known)
            takes = f"it takes {', '.join(names)}" if names else "it takes none"
        raise TypeError(f"unknown option(s) for the {kind} backend ({uri}): {', '.join(sorted(options))}; {takes}")


def as_float(name: str, value: object, *, minimum: float = 0.0) -> float:
    """A finite number >= ``minimum`` from a float, an int or text (``"0.5"``)."""
    try:
        number = float(value)  # type: ignore[arg-type]  # any value: float() raises what the except reports
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a number") from None
    if not math.isfinite(number) or number < minimum:
        raise ValueError(f"option {name}={value!r} must be a finite number >= {minimum:g}")
    return number


def refuse_uri_credentials(uri: str, names: list[str], *, userinfo: bool = False) -> None:
    """ValueError for credentials found in ``uri`` (query option ``names``, or a
    ``user[:password]@`` when ``userinfo``), naming where they were and never their
    values: a URI is printed, logged and passed around, so it must carry no secret.
    The URI is shown without its query and without anything before an ``@``."""
    found = []
    if userinfo:
        found.append("a user[:password]@ before the host")
    if names:
        found.append(f"query option(s) {', '.join(sorted(set(names)))}")
    if not found:
        return
    scheme, sep, rest = uri.partition("?")[0].partition("://")
    authority, slash, path = rest.partition("/")
    shown = f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}" if sep else scheme
    raise ValueError(
        f"{shown}: credentials do not belong in a URI ({'; '.join(found)}): URIs are printed, logged and "
        "passed around. Pass them in storage_options (the dict bcp.save, bcp.load and CheckpointManager take, "
        "as s3fs and gcsfs name them), or use the store's standard sources (environment, config files, "
        "instance roles)"
    )


def plain_root(root: str, uri: str) -> str:
    """``root`` unless one of its segments is empty, ``.`` or ``..``: a store keeps those
    as literal parts of its keys, so ``runs/a/../exp`` is not ``runs/exp``, and a
    parent's listing would hold keys that its reads and deletes refuse."""
    if root and any(part in ("", ".", "..") for part in root.split("/")):
        raise ValueError(
            f"{redact_uri(uri)!r}: the path {root!r} has an empty, '.' or '..' segment, which an object store "
            "keeps as it is; write the plain path"
        )
    return root
