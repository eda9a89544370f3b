"""From bytes in a buffer to torch tensors: the dtype map, zero-copy views and casts."""

from __future__ import annotations

from typing import Any

import torch

from vllm_fastload.errors import InvalidRequestError, PlanError
from vllm_fastload.format import TensorInfo
from vllm_fastload.plan import PlannedTensor

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
}
for _name, _attr in [("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                     ("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2")]:
    if hasattr(torch, _attr):
        _TORCH_DTYPES[_name] = getattr(torch, _attr)

#: Only these are converted when a target dtype is given; fp8, ints and bools are data, not
#: precision, and are never cast (a quantised weight cast to bf16 would be silently wrong).
CASTABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def dtype_of(info: TensorInfo) -> torch.dtype:
    try:
        return _TORCH_DTYPES[info.dtype]
    except KeyError:
        raise InvalidRequestError(f"dtype {info.dtype} has no torch equivalent in torch {torch.__version__}",
                                  file=info.file, tensor=info.name) from None


def shape_of(info: TensorInfo, shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Torch packs two F4 values per element, so its last dim is half the logical one."""
    shape = info.shape if shape is None else shape
    if info.dtype != "F4" or not shape:
        return shape
    if shape[-1] % 2:
        raise InvalidRequestError("an F4 tensor's last dim must be even to view it in torch",
                                  file=info.file, tensor=info.name)
    return shape[:-1] + (shape[-1] // 2,)


def torch_dtype(t: PlannedTensor) -> torch.dtype:
    return dtype_of(t.info)


def torch_shape(t: PlannedTensor) -> tuple[int, ...]:
    return shape_of(t.info, t.shape)


def view_tensor(raw: torch.Tensor, t: PlannedTensor) -> torch.Tensor:
    """View the bytes read for ``t`` (uint8, 1-D, exactly ``t.read_bytes``) as the result tensor."""
    dtype = torch_dtype(t)
    if raw.numel() != t.read_bytes:
        raise PlanError(f"{raw.numel()} bytes were delivered for a read of {t.read_bytes}", file=t.info.file,
                        tensor=t.key)
    typed = raw.view(dtype)
    if t.strategy == "enclosing" and t.view_strides is not None:
        shape, strides = torch_shape(t), t.view_strides
        # as_strided checks only the storage's bounds: the view must end inside these bytes, or
        # it would show its neighbour's.
        last = sum((n - 1) * s for n, s in zip(shape, strides)) if all(n > 0 for n in shape) else -1
        if last >= typed.numel():
            raise PlanError(f"a view of the enclosing rows reaches element {last} of {typed.numel()} read",
                            file=t.info.file, tensor=t.key)
        return typed.as_strided(shape, strides)
    return typed.view(torch_shape(t))


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or tensor.dtype == dtype or tensor.dtype not in CASTABLE:
        return tensor
    return tensor.to(dtype)


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's memory as a writable memoryview (no copy)."""
    array: Any = tensor.numpy()  # numpy's stubs declare the buffer protocol only for Python >= 3.12
    return memoryview(array)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (same storage; a copy would take the
    bytes read into it nowhere, so a non-contiguous tensor is refused)."""
    if not tensor.numel():
        return tensor.new_empty(0, dtype=torch.uint8)
    if not tensor.is_contiguous():
        raise ValueError(f"reads land in contiguous tensors only; got strides {list(tensor.stride())} "
                         f"for shape {list(tensor.shape)}")
    return tensor.view(-1).view(torch.uint8)
