"""Getting at tensor bytes without extra copies."""

from __future__ import annotations

import ctypes

import torch

from bcp.errors import UnsupportedStateError


def check_saveable(t: torch.Tensor, fqn: str) -> None:
    """Refuse tensors whose values cannot be stored as dense row-major bytes."""
    if t.layout != torch.strided:
        raise UnsupportedStateError(f"tensor at key {fqn!r} has layout {t.layout}; convert it with .to_dense() first")
    if t.is_meta:
        raise UnsupportedStateError(f"tensor at key {fqn!r} is on the meta device and has no values to save")
    if t.is_quantized:
        raise UnsupportedStateError(f"tensor at key {fqn!r} is quantized; save int_repr() and its scales instead")


_RAW_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as plain integers of the same width, so copies work for
    every dtype (torch has no copy kernels for int1..int7, uint1..uint7)."""
    target = _RAW_BY_SIZE.get(t.element_size())
    return t if target is None or t.dtype == target else t.view(target)


def copy_values(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bit-exact when dtypes match, cast otherwise."""
    with torch.no_grad():
        lazy = dst.is_conj() or dst.is_neg() or src.is_conj() or src.is_neg()
        if dst.dtype == src.dtype and not lazy:
            raw(dst).copy_(raw(src))
        else:
            dst.copy_(src)


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a dense CPU tensor (the tensor itself when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_contiguous():
        return t
    return raw(t).contiguous().view(t.dtype)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (same device, no copy)."""
    # as_strided, not reshape: a contiguous tensor may carry odd strides on size-1 dims.
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable view of the bytes of a dense CPU tensor (no copy)."""
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    # a 1-D uint8 array's memoryview is flat bytes already (no cast)
    return memoryview(flat_bytes(t).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ only for Python >= 3.12


#: ``PyMemoryView_FromMemory`` (CPython's stable C API) through a prototype of our own,
#: so ``ctypes.pythonapi``'s shared function object is left as other code set it
_memory_view = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_PYBUF_WRITE = 0x200


def address_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``address`` (a dense CPU tensor's
    ``data_ptr()``, or the start of a range spanning several), sliced once per tensor by
    the bulk paths: a view each through ``Tensor.numpy`` costs several times a slice
    (10,000 tensors a call). Writable as ``Tensor.numpy``'s are, also for bytes only read
    (the file backend finds a buffer's address through ctypes, which takes only a writable
    one). It holds no reference to the memory's owner: the caller keeps the tensors alive
    while a slice is in use, and slices only their bytes."""
    return _memory_view(address, nbytes, _PYBUF_WRITE)


#: dtypes numpy holds (``Tensor.numpy`` takes them; the others go through a uint8 view)
NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


def storage_identity(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same view of the same memory (tied weights);
    a lazily conjugated or negated view of it has other values and is not the same."""
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )
