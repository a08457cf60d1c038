"""What an export takes and how: the keys under a prefix, their output names (prefix
stripped, rename rules applied, no two alike), the dtype each is written in, and the
batches (safetensors shards, DCP data files) they are cut into."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

Progress = Callable[[int], None]  # called with bytes done
T = TypeVar("T")

RenameRule = tuple["re.Pattern[str]", str]

#: --dtype spellings -> torch dtypes.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def select(keys: Iterable[str], prefix: str | None, strip: bool) -> list[tuple[str, str]]:
    """(stored key, output name) for the keys under ``prefix`` (all when None)."""
    out = []
    for key in keys:
        if prefix and not key.startswith(prefix):
            continue
        out.append((key, key[len(prefix) :] if prefix and strip else key))
    return out


def plan_shards(sizes: Sequence[tuple[T, int]], max_shard_bytes: int) -> list[list[T]]:
    """Greedy, in order: a new shard starts when the next tensor would pass the cap
    (a tensor larger than the cap gets a shard of its own). Also how ``to_dcp``
    batches its writes."""
    shards: list[list[T]] = []
    current: list[T] = []
    used = 0
    for name, n in sizes:
        if current and used + n > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


def parse_dtype(text: str) -> torch.dtype:
    """A ``--dtype`` value (``bf16``, ``fp16``, ``fp32``, ``fp64`` or torch's names)."""
    try:
        return DTYPE_NAMES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}; choose one of {', '.join(sorted(DTYPE_NAMES))}") from None


def parse_rename(rule: str) -> RenameRule:
    """``"REGEX=REPLACEMENT"`` -> (compiled REGEX, REPLACEMENT). The split is at the
    last ``=``, so a regex may hold one (``(?<=x)``) and the replacement may not."""
    pattern, sep, replacement = rule.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"rename rule {rule!r} is not REGEX=REPLACEMENT")
    try:
        return re.compile(pattern), replacement
    except re.error as e:
        raise ValueError(f"rename rule {rule!r}: bad regular expression: {e}") from None


def apply_renames(name: str, rules: Sequence[RenameRule]) -> str:
    """``name`` after every rule, in order (``re.sub``: every match is replaced)."""
    for pattern, replacement in rules:
        try:
            name = pattern.sub(replacement, name)
        except re.error as e:
            raise ValueError(f"rename rule {pattern.pattern!r}={replacement!r}: {e}") from None
    return name


def output_names(pairs: list[tuple[str, str]], *, renamed: bool) -> dict[str, str]:
    """output name -> stored key; ValueError naming both keys when two share a name
    (``renamed``: the rename rules did it, else stripping the prefix)."""
    key_of: dict[str, str] = {}
    for key, name in pairs:
        if not name:
            raise ValueError(f"tensor {key!r} gets an empty name; check the rename rules")
        if name in key_of:
            cause = "the rename rules map" if renamed else "stripping the prefix maps"
            raise ValueError(f"{cause} both {key_of[name]!r} and {key!r} to {name!r}")
        key_of[name] = key
    return key_of


def cast_dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """``wanted`` for a floating-point tensor, the stored dtype for every other one."""
    return wanted if wanted is not None and stored.is_floating_point else stored
