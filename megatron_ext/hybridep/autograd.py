"""Autograd for any HybridEP buffer (ours or deep_ep's): dispatch and combine as each other's backward.

The backward of dispatch is combine with the same handle; the backward of combine is dispatch
with the same handle, non-blocking, sized by the forward dispatch's capacity (after a blocking
dispatch, the rows it produced), so no step has a host read in its backward. With fp8 dispatch
(`megatron_ext.hybridep.fp8`) both dispatches move fp8 rows: the forward's tokens in e4m3, the
backward's gradients in the recipe's gradient format; the combines move the layer's dtype.

`num_permuted_tokens`, the keyword of `dispatch` and `combine`, is DeepEP's name for the
capacity, kept here as in the buffer calls these functions wrap (`protocol.HybridEPBuffer`).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.hybridep import fp8
from megatron_ext.hybridep.protocol import DispatchOutput, Handle, HybridEPBuffer


def dispatch_with_capacity(
    buffer: HybridEPBuffer,
    capacity: Optional[int],
    *,
    hidden: torch.Tensor,
    fp8_dtype: Optional[torch.dtype] = None,
    **inputs,
) -> DispatchOutput:
    """`buffer.dispatch_with_permute(hidden=hidden, **inputs)` (not differentiable): non-blocking
    into `capacity` rows, or, when `capacity` is None, blocking and sized to the rows it produces.
    With `fp8_dtype`, `hidden` is quantized in 1 x 128 blocks of it, its bytes and scales move, and
    the rows come back dequantized to `hidden`'s dtype (the scales returned are then None)."""
    inputs.update(num_permuted_tokens=capacity, non_blocking=capacity is not None)
    if fp8_dtype is None:
        return buffer.dispatch_with_permute(hidden=hidden, **inputs)
    data, scale_inv = fp8.quantize(hidden, fp8_dtype)
    rows, row_probs, row_scales, tokens_per_expert, handle = buffer.dispatch_with_permute(
        hidden=data.view(torch.uint8), use_fp8=True, scaling_factor=scale_inv, **inputs
    )
    return fp8.dequantize(rows, row_scales, hidden.dtype, fp8_dtype), row_probs, None, tokens_per_expert, handle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, probs, buffer: HybridEPBuffer, routing_map, num_local_experts, capacity, pad_multiple, in_fp8
    ):
        # In fp8: the tokens quantized in 1 x 128 blocks of e4m3, their bytes and scales dispatched,
        # the rows dequantized on arrival; the gradient passes straight through (as TE's quantization does).
        rows, row_probs, _, tokens_per_expert, handle = dispatch_with_capacity(
            buffer,
            capacity,
            hidden=hidden,
            fp8_dtype=fp8.E4M3 if in_fp8 else None,
            routing_map=routing_map,
            probs=probs,
            num_of_experts_per_rank=num_local_experts,
            pad_multiple=pad_multiple,
        )
        ctx.buffer, ctx.handle, ctx.pad_multiple = buffer, handle, pad_multiple
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype
        ctx.mark_non_differentiable(tokens_per_expert)
        return rows, row_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs, _grad_counts, _grad_handle):
        if grad_rows is None:  # only the probs reached the loss
            grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=grad_row_probs.device)
        grad_hidden, grad_probs = ctx.buffer.combine_with_unpermute(
            hidden=grad_rows.contiguous(),
            probs=None if grad_row_probs is None else grad_row_probs.contiguous(),
            handle=ctx.handle,
            pad_multiple=ctx.pad_multiple,
        )
        return grad_hidden, grad_probs, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, buffer: HybridEPBuffer, handle: Handle, capacity, pad_multiple, grad_fp8):
        tokens, _ = buffer.combine_with_unpermute(hidden=rows, handle=handle, pad_multiple=pad_multiple)
        ctx.buffer, ctx.handle = buffer, handle
        # After a blocking dispatch its rows are counted on the host already: the backward
        # dispatches with that many as its capacity (deep_ep's buffer refuses a handle with
        # num_permuted_tokens=None).
        ctx.capacity = rows.shape[0] if capacity is None else capacity
        ctx.pad_multiple, ctx.grad_fp8 = pad_multiple, grad_fp8
        return tokens

    @staticmethod
    def backward(ctx, grad_tokens):
        grad_rows = dispatch_with_capacity(
            ctx.buffer,
            ctx.capacity,
            hidden=grad_tokens.contiguous(),
            fp8_dtype=ctx.grad_fp8,
            handle=ctx.handle,
            pad_multiple=ctx.pad_multiple,
        )[0]
        return grad_rows, None, None, None, None, None


def dispatch(
    buffer: HybridEPBuffer,
    hidden: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor],
    *,
    num_local_experts: int,
    num_permuted_tokens: Optional[int] = None,
    pad_multiple: Optional[int] = None,
    in_fp8: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Handle]:
    """Differentiable `buffer.dispatch_with_permute`: gradients reach `hidden` and `probs`.

    Args:
        hidden: `[T, H]`; routing_map: `[T, E]` bool; probs: `[T, E]` float32 or None.
        num_permuted_tokens: the capacity: None (a blocking dispatch, sized to the rows it
            produces) or a host int (non-blocking, exactly that many rows).
        in_fp8: move the tokens as e4m3 in 1 x 128 blocks with their scales and return the rows
            dequantized to `hidden`'s dtype (`megatron_ext.hybridep.fp8`; H a multiple of 128).

    Returns:
        `(rows [capacity, H], row_probs [capacity] float32 or None, tokens_per_expert [L] int64,
        handle)`; after a blocking dispatch the capacity is its rows, `rows.shape[0]`.
    """
    return _Dispatch.apply(
        hidden, probs, buffer, routing_map, num_local_experts, num_permuted_tokens, pad_multiple, in_fp8
    )


def combine(
    buffer: HybridEPBuffer,
    rows: torch.Tensor,
    handle: Handle,
    *,
    num_permuted_tokens: Optional[int] = None,
    pad_multiple: Optional[int] = None,
    grad_fp8: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Differentiable `buffer.combine_with_unpermute`: `[capacity, H]` rows back to `[T, H]` tokens.

    `num_permuted_tokens` is the dispatch's host int capacity (None after a blocking dispatch: the
    rows' count is used); the backward dispatches non-blocking with it, the gradients quantized in
    1 x 128 blocks of `grad_fp8` where given (`fp8.gradient_dtype`), dequantized on arrival.
    """
    return _Combine.apply(rows, buffer, handle, num_permuted_tokens, pad_multiple, grad_fp8)
