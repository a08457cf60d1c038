"""The fragment catalog: one row per stored fragment of a global tensor (fragments.arrow).

Pure data: knows the format, not torch, not storage. The engine builds
:class:`Fragment` rows while saving and asks the :class:`Catalog` where bytes live
while loading.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import pyarrow as pa

from .dtypes import itemsize
from .errors import FormatError

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("fqn", pa.string(), nullable=False),
        pa.field("key_path", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("lengths", pa.list_(pa.int64()), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint32()), nullable=False),
        pa.field("writer_rank", pa.int32(), nullable=False),
    ],
    metadata={"bcp.catalog.version": "1"},
)


@dataclasses.dataclass(frozen=True, slots=True)
class Fragment:
    """A box of a global tensor stored as row-major bytes at ``file[byte_offset:+nbytes]``."""

    fqn: str
    #: JSON list of [container-kind, key] pairs locating the tensor in the nested state.
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    #: Start of the box in each dimension of the global tensor.
    offsets: tuple[int, ...]
    #: Extent of the box in each dimension.
    lengths: tuple[int, ...]
    #: Data object key, relative to the checkpoint root.
    file: str
    byte_offset: int
    nbytes: int
    #: CRC32C of each checksum block of the fragment's bytes (block size in the manifest).
    checksums: tuple[int, ...]
    writer_rank: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """Everything the catalog knows about one global tensor."""

    fqn: str
    key_path: str
    dtype: str
    global_shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * itemsize(self.dtype)


class Catalog:
    """All fragments of a checkpoint, indexed by tensor."""

    def __init__(self, fragments: Iterable[Fragment]) -> None:
        self.fragments: list[Fragment] = list(fragments)
        grouped: dict[str, list[Fragment]] = {}
        for f in self.fragments:
            grouped.setdefault(f.fqn, []).append(f)
        self.tensors: dict[str, TensorEntry] = {}
        for fqn, frags in grouped.items():
            first = frags[0]
            for f in frags[1:]:
                if (f.dtype, f.global_shape, f.key_path) != (first.dtype, first.global_shape, first.key_path):
                    raise FormatError(
                        f"catalog: fragments of {fqn!r} disagree on dtype/shape/path: "
                        f"{first.dtype}{list(first.global_shape)} vs {f.dtype}{list(f.global_shape)}"
                    )
            self.tensors[fqn] = TensorEntry(fqn, first.key_path, first.dtype, first.global_shape, tuple(frags))

    def __len__(self) -> int:
        return len(self.fragments)

    # -- Arrow IPC -----------------------------------------------------------------------

    def to_arrow(self) -> bytes:
        cols: dict[str, list] = {name: [] for name in CATALOG_SCHEMA.names}
        for f in self.fragments:
            for name in CATALOG_SCHEMA.names:
                value = getattr(f, name)
                cols[name].append(list(value) if isinstance(value, tuple) else value)
        table = pa.table(cols, schema=CATALOG_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, CATALOG_SCHEMA) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_arrow(cls, data: bytes, *, where: str, checksum_block_bytes: int) -> Catalog:
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{where}: not a readable Arrow IPC file: {e}") from e
        missing = [n for n in CATALOG_SCHEMA.names if n not in table.column_names]
        if missing:
            raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
        try:
            table = table.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{where}: columns do not have the catalog types: {e}") from e
        cols = {name: table.column(name).to_pylist() for name in CATALOG_SCHEMA.names}
        fragments = []
        for i in range(table.num_rows):
            row = {name: cols[name][i] for name in CATALOG_SCHEMA.names}
            for name in ("global_shape", "offsets", "lengths", "checksums"):
                row[name] = tuple(row[name])
            frag = Fragment(**row)
            validate_fragment(frag, where=f"{where} row {i}", checksum_block_bytes=checksum_block_bytes)
            fragments.append(frag)
        return cls(fragments)


def validate_fragment(f: Fragment, *, where: str, checksum_block_bytes: int) -> None:
    """Raise FormatError unless the row is self-consistent (box inside the tensor,
    byte count matching the box, one checksum per block)."""
    ndim = len(f.global_shape)
    if len(f.offsets) != ndim or len(f.lengths) != ndim:
        raise FormatError(f"{where} ({f.fqn!r}): box has {len(f.offsets)}/{len(f.lengths)} dims, tensor has {ndim}")
    for d, (o, n, s) in enumerate(zip(f.offsets, f.lengths, f.global_shape)):
        if s < 0 or o < 0 or n < 0 or o + n > s:
            raise FormatError(f"{where} ({f.fqn!r}): dim {d} box [{o}, {o + n}) is outside size {s}")
    try:
        size = itemsize(f.dtype)
    except ValueError as e:
        raise FormatError(f"{where} ({f.fqn!r}): {e}") from None
    if f.nbytes != math.prod(f.lengths) * size:
        raise FormatError(f"{where} ({f.fqn!r}): nbytes {f.nbytes} does not match box {list(f.lengths)} of {f.dtype}")
    if f.byte_offset < 0:
        raise FormatError(f"{where} ({f.fqn!r}): negative byte offset {f.byte_offset}")
    blocks = -(-f.nbytes // checksum_block_bytes)
    if len(f.checksums) != blocks:
        raise FormatError(f"{where} ({f.fqn!r}): {len(f.checksums)} checksums for {blocks} blocks")


def boxes_cover_exactly(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the (offsets, lengths) boxes tile ``shape`` with no gap and no overlap,
    counting identical boxes once (replicas)."""
    unique = {(tuple(o), tuple(n)) for o, n in boxes}
    total = math.prod(shape)
    if sum(math.prod(n) for _o, n in unique) != total:
        return False
    items = sorted(unique)
    for i, (oa, na) in enumerate(items):
        for ob, nb in items[i + 1 :]:
            if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(oa, na, ob, nb)) and math.prod(na) and math.prod(nb):
                return False
    return True
