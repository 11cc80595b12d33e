"""Tokens quantized before the dispatch, in 1 x 128 blocks, and dequantized after it.

`--moe-hybridep-fp8-dispatch`: each token's hidden vector is cut into blocks of 128 values; each
block gets one power-of-two scale from its own amax, by the rule Transformer Engine's `blockwise`
recipe (Float8BlockScaling, e4m3) applies to the experts' input (scale = 448 / amax with its
mantissa cleared, 1 for a block of zeros or infinities). The dispatch moves the e4m3 bytes and the
float32 inverse scales, H + H / 32 bytes a row instead of 2H in bf16, and the rows are turned back
into the layer's dtype on arrival: every value q x 2^k, exactly representable in bf16.

Why TE then computes what it would have: quantizing a block that came out of this quantizer gives
back the same values (the block's amax is q_max x 2^-k with q_max in [224, 448], so the scale comes
out the same, or doubled with every q doubled when q_max is 224, the same products either way).
So the experts' forward sees the values TE's `blockwise` quantization of the bf16 rows would give.
What differs is the first expert GEMM's weight gradient, which TE quantizes in blocks along the
tokens, from the dequantized rows rather than the original ones.
"""

from __future__ import annotations

import torch

from megatron_ext.options import FP8_DISPATCH_BLOCK as BLOCK

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_EXPONENT_BITS = -8388608  # 0xFF800000 as int32: sign and exponent of a float32, mantissa cleared


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-block quantization scales from float32 amaxes: 448 / amax rounded down to a power of
    two; 1 where amax is 0, infinite or NaN; the largest float32 where 448 / amax overflows."""
    scale = E4M3_MAX / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), 1.0, scale)
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H a multiple of 128) -> (e4m3 [T, H], float32 [T, H / 128]): the data and each
    block's dequantization scale (a power of two)."""
    tokens, hidden = x.shape
    blocks = x.float().view(tokens, hidden // BLOCK, BLOCK)
    scale = _scales(blocks.abs().amax(-1))
    data = (blocks * scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(tokens, hidden)
    return data, scale.reciprocal()


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(e4m3 [R, H], float32 [R, H / 128]) -> [R, H] in `dtype`: each value times its block's scale."""
    rows, hidden = data.shape
    values = data.view(torch.float8_e4m3fn).float().view(rows, hidden // BLOCK, BLOCK) * scale_inv.unsqueeze(-1)
    return values.view(rows, hidden).to(dtype)


def wire_bytes_per_row(hidden: int) -> int:
    """What one dispatched row costs in fp8: its bytes and its float32 scales."""
    return hidden + 4 * (hidden // BLOCK)
