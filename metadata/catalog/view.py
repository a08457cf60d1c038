"""The catalog's ``tensors`` mapping: fqn -> TensorEntry, each entry built on first use.

A rank loading its shards of a large checkpoint touches a small part of the catalog,
so nothing is built until a name is looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from bcp.metadata.catalog.tensors import TensorTable
from bcp.metadata.rows import TensorEntry


class TensorsView(Mapping):
    """fqn -> TensorEntry over a tensor table, ``entry(code)`` building (and caching) each."""

    def __init__(self, table: TensorTable, entry: Callable[[int], TensorEntry]) -> None:
        self._table, self._entry = table, entry

    def __getitem__(self, fqn: str) -> TensorEntry:
        return self._entry(self._table.index[fqn])

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.names)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._table.index
