"""The fused expert activation: `activation_probs` / `activation_probs_backward`, the activation
(SwiGLU, GeGLU, SiLU or GELU) weighted by the float32 router probs for the first n rows, in one
pass each way, in float32 registers; `activation_code` maps Megatron's activation to the kernel's.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.fused.common import _cdiv, _check_count, _grid, _pow2, triton

if triton is not None:
    import triton.language as tl

# Activations the fused kernels compute, by the callable Megatron's config holds.
SILU, GELU = 0, 1
_ACTIVATIONS = {torch.nn.functional.silu: SILU, torch.nn.functional.gelu: GELU}


def activation_code(activation_func) -> Optional[int]:
    """The kernels' code for Megatron's `activation_func`, or None when they do not have it."""
    return _ACTIVATIONS.get(activation_func)


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
        n_ptr,
        out_ptr,
        grad_ptr,
        grad_probs_ptr,
        F: tl.constexpr,
        GATED: tl.constexpr,
        ACT: tl.constexpr,
        BACKWARD: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_F: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        # h: [C, 2F] (gated: gate then linear) or [C, F]; rows < n only. Forward: out [C, F] =
        # act(h) * probs. BACKWARD: from grad [C, F], out: grad_h (h's shape), and grad_probs [C].
        n = tl.load(n_ptr)
        h_width = 2 * F if GATED else F
        block = tl.program_id(0)
        while block * BLOCK_R < n:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < n
            p = tl.load(probs_ptr + rows, mask=live, other=0.0)[:, None]
            dot = tl.zeros((BLOCK_R,), dtype=tl.float32)  # backward: sum over F of grad * act * linear
            for start in range(0, F, BLOCK_F):
                cols = start + tl.arange(0, BLOCK_F)
                mask = live[:, None] & (cols < F)[None, :]
                f_at = rows[:, None].to(tl.int64) * F + cols[None, :]
                h_at = rows[:, None].to(tl.int64) * h_width + cols[None, :]
                x = tl.load(h_ptr + h_at, mask=mask, other=0.0).to(tl.float32)
                act = _activate(x, ACT)
                if GATED:
                    linear = tl.load(h_ptr + h_at + F, mask=mask, other=0.0).to(tl.float32)
                else:
                    linear = 1.0
                if BACKWARD:
                    grad = tl.load(grad_ptr + f_at, mask=mask, other=0.0).to(tl.float32)
                    dot += tl.sum(grad * act * linear, axis=1)
                    grad_x = grad * p * linear * _activate_grad(x, ACT)
                    tl.store(out_ptr + h_at, grad_x.to(out_ptr.dtype.element_ty), mask=mask)
                    if GATED:
                        tl.store(out_ptr + h_at + F, (grad * p * act).to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    tl.store(out_ptr + f_at, (act * linear * p).to(out_ptr.dtype.element_ty), mask=mask)
            if BACKWARD:
                tl.store(grad_probs_ptr + rows, dot, mask=live)
            block += PROGRAMS


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
    h, probs = h.contiguous(), probs.contiguous()
    out = torch.empty(rows, width // 2 if gated else width, dtype=h.dtype, device=h.device)
    _activation(h, probs, n, out, gated, activation)
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
    grad, h, probs = grad.contiguous(), h.contiguous(), probs.contiguous()
    grad_h = torch.empty_like(h)
    grad_probs = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    _activation(h, probs, n, grad_h, gated, activation, backward=(grad, grad_probs))
    return grad_h, grad_probs


def _activation(h, probs, n, out, gated, activation, backward=None):
    """Launch `_activation_probs_kernel`: the forward into `out`, or, given `backward` (grad,
    grad_probs), the gradients (grad_h into `out`), in blocks half the size."""
    rows, width = h.shape
    F = width // 2 if gated else width
    grad, grad_probs = backward if backward is not None else (out, probs)  # not read forward
    block_cap = 1024 if backward is None else 512
    block_f = _pow2(F, block_cap)
    block_r = max(1, 2 * block_cap // block_f)
    programs = _grid(h, _cdiv(rows, block_r))
    _activation_probs_kernel[(programs,)](
        h,
        probs,
        n,
        out,
        grad,
        grad_probs,
        F,
        GATED=gated,
        ACT=activation,
        BACKWARD=backward is not None,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        PROGRAMS=programs,
    )
