"""What reaches the terminal: text escaped so that a key or message cannot move the
cursor, URIs with their credentials redacted, sizes, ages, progress bars."""

from __future__ import annotations

import datetime
import json
import math
import unicodedata
from typing import TYPE_CHECKING

from bcp.backends.storage_errors import redact, redact_uri

if TYPE_CHECKING:
    from tqdm import tqdm

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def safe(text: object) -> str:
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


def show(uri: str) -> str:
    """A URI or path as printed: credentials redacted, control characters escaped."""
    return safe(redact_uri(str(uri)))


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human(n: float) -> str:
    """A byte count as people read it: ``512 B``, ``12.0 KiB``, ``1.5 GiB`` (binary
    units, one decimal, never ``0.0 MiB`` or ``1024.0 KiB``). Every size the CLI prints
    goes through here."""
    if not math.isfinite(n):
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if round(n) < 1024:
        return f"{sign}{round(n)} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if round(value, 1) < 1024 or unit == _UNITS[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def rate(bytes_per_second: float) -> str:
    """A speed as people read it: :func:`human` per second (``850.0 MiB/s``,
    ``1.2 GiB/s``; ``-`` when unknown). Every speed the CLI prints goes through here."""
    if not math.isfinite(bytes_per_second) or bytes_per_second < 0:
        return "-"
    return f"{human(bytes_per_second)}/s"


def age(then: datetime.datetime | None) -> str:
    """How long ago ``then`` was, in its largest unit (``3d``, ``5h``, ``12m``, ``40s``)."""
    if then is None:
        return "-"
    seconds = (datetime.datetime.now(datetime.UTC) - then).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def raw(value: object, limit: int = 200) -> str:
    """A manifest value as JSON, one line, cut at ``limit`` characters, escaped and
    redacted for the terminal."""
    text = json.dumps(value, default=str)
    return safe(redact(text if len(text) <= limit else text[: limit - 3] + "..."))


def progress(total: int, desc: str) -> tqdm:
    """A byte progress bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False)
