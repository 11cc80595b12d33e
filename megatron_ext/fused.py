"""Triton kernels that do work in proportion to the real rows of a capacity-sized tensor.

A capacity-mode dispatch hands over C rows of which only the first n are real; n lives on the
device (the sum of `tokens_per_expert`) and is never read on the host. Every kernel here reads n
from a one-element device tensor and visits only the rows below it, in a persistent loop of a
fixed number of programs, so its cost follows n and not C. Rows at or past n are neither read nor
written (they hold whatever the allocator left there), which is what deep_ep's dispatch and TE's
op-fuser experts do too: whoever reads a capacity-sized tensor must stop at n.

The kernels:
* `activation_probs` / `activation_probs_backward`: the expert activation (SwiGLU, GeGLU, SiLU or
  GELU) weighted by the float32 router probs, in one pass each way, in float32 registers.
* `gather_rows`: `out[r] = src[index[r]]` for r < n (the permute of a dispatch).
* `sum_rows_per_slot`: for every slot (a received token), the float32 sum of its rows, in the
  order of the row table (expert order); a gather per slot, deterministic, with no atomics and no
  sort (the unpermute of a combine).

`enabled_for(t)` says whether they run for a tensor: CUDA tensors when Triton imports, and CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, how the CPU tests run them).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the registry's torch brings triton
    triton = None

# Activations the fused kernels compute, by the callable Megatron's config holds.
SILU, GELU = 0, 1
_ACTIVATIONS = {torch.nn.functional.silu: SILU, torch.nn.functional.gelu: GELU}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled_for(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors like `t` (CUDA, or CPU under Triton's interpreter)."""
    return triton is not None and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


def activation_code(activation_func) -> Optional[int]:
    """The kernels' code for Megatron's `activation_func`, or None when they do not have it."""
    return _ACTIVATIONS.get(activation_func)


@functools.cache
def _programs(device_index: Optional[int]) -> int:
    """How many programs a persistent kernel launches: a few per multiprocessor (host query, cached)."""
    if device_index is None:
        return 4  # the interpreter runs programs one after another
    return 8 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(t: torch.Tensor, blocks: int) -> int:
    return max(1, min(blocks, _programs(t.device.index if t.is_cuda else None)))


def _pow2(n: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(1, n)))


def _check_count(n: torch.Tensor, device: torch.device) -> None:
    if n.numel() != 1 or n.dtype not in (torch.int32, torch.int64) or n.device != device:
        raise ValueError(f"fused: the row count must be a one-element integer tensor on {device}; got {n}")


if triton is not None:

    @triton.jit
    def _activate(x, ACT: tl.constexpr):
        if ACT == 0:
            return x * tl.sigmoid(x)
        else:
            return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _activate_grad(x, ACT: tl.constexpr):
        if ACT == 0:
            s = tl.sigmoid(x)
            return s * (1.0 + x * (1.0 - s))
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)

    @triton.jit
    def _activation_probs_kernel(
        h_ptr,
        probs_ptr,
        out_ptr,
        n_ptr,
        F: tl.constexpr,
        GATED: tl.constexpr,
        ACT: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_F: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        # h: [C, 2F] (gated: gate then linear) or [C, F]; out: [C, F]; rows < n only.
        n = tl.load(n_ptr)
        if GATED:
            h_width = 2 * F
        else:
            h_width = F
        block = tl.program_id(0)
        while block * BLOCK_R < n:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < n
            p = tl.load(probs_ptr + rows, mask=live, other=0.0)
            for start in range(0, F, BLOCK_F):
                cols = start + tl.arange(0, BLOCK_F)
                mask = live[:, None] & (cols < F)[None, :]
                at = rows[:, None].to(tl.int64) * h_width + cols[None, :]
                x = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)
                act = _activate(x, ACT)
                if GATED:
                    act = act * tl.load(h_ptr + at + F, mask=mask, other=0.0).to(tl.float32)
                out_at = rows[:, None].to(tl.int64) * F + cols[None, :]
                tl.store(out_ptr + out_at, (act * p[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
            block += PROGRAMS

    @triton.jit
    def _activation_probs_backward_kernel(
        grad_ptr,
        h_ptr,
        probs_ptr,
        grad_h_ptr,
        grad_probs_ptr,
        n_ptr,
        F: tl.constexpr,
        GATED: tl.constexpr,
        ACT: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_F: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        n = tl.load(n_ptr)
        if GATED:
            h_width = 2 * F
        else:
            h_width = F
        block = tl.program_id(0)
        while block * BLOCK_R < n:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < n
            p = tl.load(probs_ptr + rows, mask=live, other=0.0)[:, None]
            dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for start in range(0, F, BLOCK_F):
                cols = start + tl.arange(0, BLOCK_F)
                mask = live[:, None] & (cols < F)[None, :]
                g_at = rows[:, None].to(tl.int64) * F + cols[None, :]
                h_at = rows[:, None].to(tl.int64) * h_width + cols[None, :]
                grad = tl.load(grad_ptr + g_at, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(h_ptr + h_at, mask=mask, other=0.0).to(tl.float32)
                act = _activate(x, ACT)
                d_act = _activate_grad(x, ACT)
                if GATED:
                    linear = tl.load(h_ptr + h_at + F, mask=mask, other=0.0).to(tl.float32)
                    dot += tl.sum(grad * act * linear, axis=1)
                    tl.store(grad_h_ptr + h_at, (grad * p * linear * d_act).to(grad_h_ptr.dtype.element_ty), mask=mask)
                    tl.store(grad_h_ptr + h_at + F, (grad * p * act).to(grad_h_ptr.dtype.element_ty), mask=mask)
                else:
                    dot += tl.sum(grad * act, axis=1)
                    tl.store(grad_h_ptr + h_at, (grad * p * d_act).to(grad_h_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_probs_ptr + rows, dot, mask=live)
            block += PROGRAMS

    @triton.jit
    def _gather_rows_kernel(
        src_ptr,
        index_ptr,
        out_ptr,
        n_ptr,
        H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        n = tl.load(n_ptr)
        block = tl.program_id(0)
        while block * BLOCK_R < n:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < n
            src_rows = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64)
            for start in range(0, H, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                mask = live[:, None] & (cols < H)[None, :]
                values = tl.load(src_ptr + src_rows[:, None] * H + cols[None, :], mask=mask)
                tl.store(out_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], values, mask=mask)
            block += PROGRAMS

    @triton.jit
    def _sum_rows_per_slot_kernel(
        rows_ptr,
        table_ptr,
        out_ptr,
        H: tl.constexpr,
        L: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One slot and one column block per program: the slot's rows (table[slot, e], -1 for none)
        # added in table order, in float32.
        slot = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_width = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for e in range(L):
            row = tl.load(table_ptr + slot * L + e).to(tl.int64)
            if row >= 0:
                acc += tl.load(rows_ptr + row * H + cols, mask=in_width, other=0.0).to(tl.float32)
        tl.store(out_ptr + slot * H + cols, acc.to(out_ptr.dtype.element_ty), mask=in_width)


def activation_probs(h: torch.Tensor, probs: torch.Tensor, n: torch.Tensor, *, gated: bool, activation: int):
    """`act(h) * probs` for the first n rows, in float32, stored in h's dtype.

    Args:
        h: `[C, 2F]` (gated: the gate half, then the linear half; act(gate) * linear) or `[C, F]`.
        probs: `[C]` float32. n: one-element integer device tensor, the real rows (<= C).
        activation: `SILU` or `GELU` (`activation_code`).

    Returns:
        `[C, F]` in h's dtype; rows >= n unwritten.
    """
    _check_count(n, h.device)
    rows, width = h.shape
    F = width // 2 if gated else width
    h, probs = h.contiguous(), probs.contiguous()
    out = torch.empty(rows, F, dtype=h.dtype, device=h.device)
    block_f = _pow2(F, 1024)
    block_r = max(1, 2048 // block_f)
    programs = _grid(h, triton.cdiv(rows, block_r))
    _activation_probs_kernel[(programs,)](
        h, probs, out, n, F, GATED=gated, ACT=activation, BLOCK_R=block_r, BLOCK_F=block_f, PROGRAMS=programs
    )
    return out


def activation_probs_backward(
    grad: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, n: torch.Tensor, *, gated: bool, activation: int
):
    """Gradients of `activation_probs` for the first n rows.

    Returns:
        `(grad_h [C, 2F] or [C, F] in h's dtype, rows >= n unwritten;
          grad_probs [C] float32, zero at rows >= n)`.
    """
    _check_count(n, h.device)
    rows, width = h.shape
    F = width // 2 if gated else width
    grad, h, probs = grad.contiguous(), h.contiguous(), probs.contiguous()
    grad_h = torch.empty_like(h)
    grad_probs = torch.zeros(rows, dtype=torch.float32, device=h.device)
    block_f = _pow2(F, 512)
    block_r = max(1, 1024 // block_f)
    programs = _grid(h, triton.cdiv(rows, block_r))
    _activation_probs_backward_kernel[(programs,)](
        grad,
        h,
        probs,
        grad_h,
        grad_probs,
        n,
        F,
        GATED=gated,
        ACT=activation,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        PROGRAMS=programs,
    )
    return grad_h, grad_probs


def gather_rows(src: torch.Tensor, index: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`out[r] = src[index[r]]` for r < n.

    Args:
        src: `[S, H]`. index: `[C]` integer, values in [0, S) for r < n. n: one-element device tensor.

    Returns:
        `[C, H]` in src's dtype; rows >= n unwritten.
    """
    _check_count(n, src.device)
    src, index = src.contiguous(), index.contiguous()
    H = src.shape[1]
    out = torch.empty(index.shape[0], H, dtype=src.dtype, device=src.device)
    block_h = _pow2(H, 1024)
    block_r = max(1, 4096 // block_h)
    programs = _grid(src, triton.cdiv(index.shape[0], block_r))
    _gather_rows_kernel[(programs,)](src, index, out, n, H, BLOCK_R=block_r, BLOCK_H=block_h, PROGRAMS=programs)
    return out


def sum_rows_per_slot(rows: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out[s] = sum_e rows[table[s, e]]` over the entries >= 0, added in e order in float32.

    Args:
        rows: `[C, H]`; only the rows the table names are read.
        table: `[S, L]` int32, row of slot s's e-th part or -1.
        dtype: the output dtype.

    Returns:
        `[S, H]` in `dtype` (a slot with no rows gets zeros).
    """
    rows, table = rows.contiguous(), table.contiguous()
    slots, L = table.shape
    H = rows.shape[1]
    out = torch.empty(slots, H, dtype=dtype, device=rows.device)
    if slots == 0:
        return out
    block_h = _pow2(H, 1024)
    _sum_rows_per_slot_kernel[(slots, triton.cdiv(H, block_h))](rows, table, out, H, L=L, BLOCK_H=block_h)
    return out
