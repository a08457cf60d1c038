"""Run one function over many items on a few threads: the reads of a load.

Every item started runs to its end before the call returns (a read never outlives its
load), and the first error, in item order, is raised after all have stopped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def run_all(fn: Callable[[_Item], _Result], items: Sequence[_Item], *, streams: int, name: str) -> list[_Result]:
    """``[fn(x) for x in items]`` on up to ``streams`` threads named ``name`` (in this
    thread when one would do: there the first error stops the rest)."""
    if streams <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    results: list[_Result] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=streams, thread_name_prefix=name) as pool:
        for future in [pool.submit(fn, x) for x in items]:
            try:
                results.append(future.result())
            except BaseException as e:  # noqa: BLE001 - first error wins, after all items stop
                errors.append(e)
    if errors:
        raise errors[0]
    return results
