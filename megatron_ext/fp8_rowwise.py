"""fp8 experts with row-wise scales, on torch's scaled grouped GEMM: all six GEMMs of a GLU expert
layer (two forward, two data gradients, two weight gradients) in e4m3 over device offsets, so no
host read and CUDA-graph safe.

The recipe: every operand is scaled along its contraction dimension, one float32 scale per row of
the GEMM's output (per token row, per weight output row), as torch's `_scaled_grouped_mm` takes
on compute capability 9.0. A token row's scales depend on that row alone, so quantizing a token
before the dispatch gives the same bytes as quantizing each of its routed copies after it. The
weight gradients contract over tokens: their operands are scaled per column within each expert's
rows (one scale per expert and column).

On CPU (the tests) the scaled GEMM is computed from the dequantized operands in float32, which is
what the GPU kernel computes up to accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext import fused

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_TINY = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 [...]): each row over its own amax, so that
    dequantized = q * scale. A zero row gets scale 0 and zeros."""
    x = x.contiguous()  # a transposed weight: its quantized copy must be row-major itself
    amax = x.abs().amax(-1, keepdim=True).float()
    q = (x.float() * (E4M3_MAX / amax.clamp(min=_TINY))).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).squeeze(-1)


def quantize_columns_per_group(x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, K] rows grouped by `offsets` (inclusive ends, int32, on the device) -> (e4m3 [K, P]
    row-major, float32 [G * K]): each column scaled within each group's rows, as a weight
    gradient's operand wants it. Rows past offsets[-1] are quantized as zeros."""
    rows, cols = x.shape
    groups = offsets.numel()
    group_of_row = torch.bucketize(torch.arange(rows, device=x.device, dtype=torch.int32), offsets, right=True)
    amax = torch.zeros(groups + 1, cols, device=x.device, dtype=torch.float32)
    amax.index_reduce_(0, group_of_row, x.abs().float(), "amax", include_self=True)
    amax[groups] = 0  # rows past the last group
    row_scale = (E4M3_MAX / amax.clamp(min=_TINY))[group_of_row]
    row_scale[group_of_row == groups] = 0
    q = (x.float() * row_scale).to(torch.float8_e4m3fn).t().contiguous()
    return q, (amax[:groups] / E4M3_MAX).reshape(-1)


def scaled_grouped_mm(a, b, scale_a, scale_b, offsets) -> torch.Tensor:
    """bf16 grouped GEMM of e4m3 operands with row-wise scales: the 2D x 3D case (a [P, K], b
    [G, K, N] column-major, scales [P] and [G, N]) and the 2D x 2D case (a [M, P], b [P, N]
    column-major, groups along P, scales [G * M] and [G * N])."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16)
    return _reference_scaled_grouped_mm(a, b, scale_a, scale_b, offsets)


def _reference_scaled_grouped_mm(a, b, scale_a, scale_b, offsets) -> torch.Tensor:
    groups = offsets.numel()
    if b.dim() == 3:
        a_f = a.float() * scale_a[:, None]
        b_f = b.float() * scale_b[:, None, :]
        return F.grouped_mm(a_f, b_f, offs=offsets).to(torch.bfloat16)
    m, n = a.shape[0], b.shape[1]
    a_f = a.float().unsqueeze(0) * scale_a.view(groups, m, 1)  # [G, M, P]
    b_f = b.float().unsqueeze(0) * scale_b.view(groups, 1, n)  # [G, P, N]
    ends = offsets.tolist()
    out = torch.zeros(groups, m, n)
    start = 0
    for g, end in enumerate(ends):
        out[g] = a_f[g, :, start:end] @ b_f[g, start:end]
        start = end
    return out.to(torch.bfloat16)


class Fp8RowwiseExperts(torch.autograd.Function):
    """fc1 -> activation x probs -> fc2, as `experts._FusedExperts`, every GEMM in e4m3 with
    row-wise scales. `x` is bf16 [P, H], or a pre-quantized (e4m3 [P, H], float32 [P]) pair from an
    fp8 dispatch; the fc1 weight gradient then uses the dequantized rows."""

    @staticmethod
    def forward(ctx, x, x_scale, probs, w1, w2, offsets, gated, activation):
        n = offsets[-1:]
        if x_scale is None:
            xq, x_scale = quantize_rows(x)
        else:
            xq, x = x, None
        w1q, w1s = quantize_rows(w1)  # [E, 2F, H], scales per output row
        h = scaled_grouped_mm(xq, w1q.transpose(1, 2), x_scale, w1s, offsets)
        del w1q
        act = _activation(h, probs, n, gated, activation)
        aq, a_s = quantize_rows(act)
        del act
        w2q, w2s = quantize_rows(w2)
        out = scaled_grouped_mm(aq, w2q.transpose(1, 2), a_s, w2s, offsets)
        ctx.save_for_backward(x if x is not None else xq, x_scale, h, probs, w1, w2, offsets)
        ctx.gated, ctx.activation, ctx.prequantized = gated, activation, x is None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, x_scale, h, probs, w1, w2, offsets = ctx.saved_tensors
        n = offsets[-1:]
        if ctx.prequantized:
            x = (x.float() * x_scale[:, None]).to(torch.bfloat16)
        act = _activation(h, probs, n, ctx.gated, ctx.activation)
        g_cols, g_cols_s = quantize_columns_per_group(grad_out, offsets)
        a_cols, a_cols_s = quantize_columns_per_group(act, offsets)
        del act
        grad_w2 = scaled_grouped_mm(g_cols, a_cols.t(), g_cols_s, a_cols_s, offsets)
        del g_cols, a_cols
        gq, gs = quantize_rows(grad_out)
        w2t, w2ts = quantize_rows(w2.transpose(1, 2))  # [E, F, H], scales per F
        grad_act = scaled_grouped_mm(gq, w2t.transpose(1, 2), gs, w2ts, offsets)
        del gq, w2t
        grad_h, grad_probs = _activation_backward(grad_act, h, probs, n, ctx.gated, ctx.activation)
        del grad_act
        gh_cols, gh_cols_s = quantize_columns_per_group(grad_h, offsets)
        x_cols, x_cols_s = quantize_columns_per_group(x, offsets)
        grad_w1 = scaled_grouped_mm(gh_cols, x_cols.t(), gh_cols_s, x_cols_s, offsets)
        del gh_cols, x_cols
        ghq, ghs = quantize_rows(grad_h)
        w1t, w1ts = quantize_rows(w1.transpose(1, 2))  # [E, H, 2F], scales per H
        grad_x = scaled_grouped_mm(ghq, w1t.transpose(1, 2), ghs, w1ts, offsets)
        grad_x_scale = None
        return grad_x, grad_x_scale, grad_probs.to(probs.dtype), grad_w1.to(w1.dtype), grad_w2.to(w2.dtype), None, None, None


def _activation(h, probs, n, gated, activation):
    if fused.enabled_for(h):
        return fused.activation_probs(h, probs, n, gated=gated, activation=activation)
    return _torch_activation(h, probs, n, gated, activation)


def _activation_backward(grad_act, h, probs, n, gated, activation):
    if fused.enabled_for(h):
        return fused.activation_probs_backward(grad_act, h, probs, n, gated=gated, activation=activation)
    with torch.enable_grad():
        h_ = h.detach().requires_grad_(True)
        p_ = probs.detach().requires_grad_(True)
        out = _torch_activation(h_, p_, n, gated, activation)
        grad_h, grad_p = torch.autograd.grad(out, (h_, p_), grad_act)
    return grad_h, grad_p


def _torch_activation(h, probs, n, gated, activation):
    """SiLU or GELU (fused.SILU, fused.GELU), gated or not, times the probs, rows >= n zero; in h's dtype."""
    fn = F.silu if activation == fused.SILU else F.gelu
    hf = h.float()
    if gated:
        gate, linear = hf.chunk(2, dim=-1)
        act = fn(gate) * linear
    else:
        act = fn(hf)
    real = (torch.arange(h.shape[0], device=h.device) < n).unsqueeze(-1)
    return torch.where(real, act * probs.float().unsqueeze(-1), 0).to(h.dtype)
