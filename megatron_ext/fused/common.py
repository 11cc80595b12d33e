"""What the fused kernels share: Triton (None where it does not import), whether the kernels run
for a tensor (`enabled_for`, `interpreting`), how many programs a persistent kernel launches
(`_grid`), host-side block sizes (`_cdiv`, `_next_pow2`, `_pow2`), and the checks of an output
buffer and a device row count (`_output`, `_check_count`).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:
    import triton
except ImportError:  # pragma: no cover - the registry's torch brings triton
    triton = None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled_for(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors like `t` (CUDA, or CPU under Triton's interpreter)."""
    return triton is not None and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


@functools.cache
def _programs(device_index: Optional[int]) -> int:
    """How many programs a persistent kernel launches: a few per multiprocessor (host query, cached)."""
    if device_index is None:
        return 4  # the interpreter runs programs one after another
    return 8 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(t: torch.Tensor, blocks: int) -> int:
    return max(1, min(blocks, _programs(t.device.index if t.is_cuda else None)))


# Host-side sizes. Triton's own `cdiv` and `next_power_of_2` are constexpr functions whose
# wrapper costs the host microseconds per call, a dozen times per dispatch; these are plain ints.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _pow2(n: int, cap: int) -> int:
    return min(cap, _next_pow2(n))


def _output(
    out: Optional[torch.Tensor],
    rows: int,
    width: int,
    dtype: torch.dtype,
    device,
    row_stride: bool = False,
    name: str = "out",
) -> torch.Tensor:
    """A new `[rows, width]` tensor, or `out` when it can take that many rows (a caller's buffer;
    `row_stride`: its rows may be further apart than `width`, a column slice of a wider buffer, but
    may not overlap). `name`: the argument's name in the error."""
    if out is None:
        return torch.empty(rows, width, dtype=dtype, device=device)
    laid_out = (width == 1 or out.stride(1) == 1) and out.stride(0) >= width if row_stride else out.is_contiguous()
    if not (
        laid_out and out.dtype == dtype and out.device == device and out.shape[0] >= rows and out.shape[1] == width
    ):
        kind = (
            "a [>= {}, {}] {} tensor with contiguous columns and rows apart"
            if row_stride
            else "a contiguous [>= {}, {}] {} tensor"
        )
        raise ValueError(
            f"fused: `{name}` must be {kind.format(rows, width, dtype)} on {device}; got {out.dtype} on "
            f"{out.device} of shape {tuple(out.shape)} and strides {out.stride()}"
        )
    return out


def _check_count(n: torch.Tensor, device: torch.device) -> None:
    if n.numel() != 1 or n.dtype not in (torch.int32, torch.int64) or n.device != device:
        raise ValueError(f"fused: the row count must be a one-element integer tensor on {device}; got {n}")
