"""Element types of the format: name -> bytes per element (FORMAT.md, "dtypes").

Names are torch's own dtype names without the ``torch.`` prefix. Sub-byte types
(int1..int7, uint1..uint7, float4_e2m1fn_x2, bits*) are stored exactly as torch keeps
them in memory: one byte per element (two float4 values packed per byte for
``float4_e2m1fn_x2``). All multi-byte types are little-endian.
"""

DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}  # fmt: skip


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; the format knows {', '.join(sorted(DTYPE_ITEMSIZE))}") from None
