"""Tokens quantized before the dispatch, in 1 x 128 blocks, and dequantized after it.

`--moe-hybridep-fp8-dispatch`: each token's hidden vector is cut into blocks of 128 values; each
block gets one power-of-two scale from its own amax, by the rule Transformer Engine's `blockwise`
recipe (Float8BlockScaling) applies to the experts' input and to their output's gradient (scale =
fp8 max / amax with its mantissa cleared, 1 for a block of zeros or infinities). The dispatch moves
the fp8 bytes and the float32 inverse scales, H + H / 32 bytes a row instead of 2H in bf16, and
the rows are turned back into the layer's dtype on arrival: every value q x 2^k, exactly
representable in bf16. The forward's tokens go in e4m3; the backward's gradients, which the
combine's backward dispatches to the experts, in the recipe's gradient format (`gradient_dtype`).

Why TE then computes what it would have: quantizing a block that came out of this quantizer gives
back the same values (the block's amax is q_max x 2^-k with q_max in [max/2, max], so the scale
comes out the same, or doubled with every q doubled when q_max is max/2, the same products either
way). So the experts' first GEMM and their second GEMM's data gradient see the values TE's
`blockwise` quantization of the bf16 rows would give. What differs is each expert GEMM's weight
gradient, which TE quantizes in blocks along the tokens, from the dequantized rows rather than the
original ones.
"""

from __future__ import annotations

import torch

from megatron_ext.options import FP8_DISPATCH_BLOCK as BLOCK

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
_EXPONENT_BITS = -8388608  # 0xFF800000 as int32: sign and exponent of a float32, mantissa cleared


# Megatron's --fp8-format: the format of the backward's gradients under TE's recipes.
_GRADIENT_DTYPES = {"e4m3": torch.float8_e4m3fn, "hybrid": torch.float8_e5m2}


def gradient_dtype(fp8_format: str) -> torch.dtype:
    """The fp8 dtype TE quantizes gradients in under Megatron's `--fp8-format`: e4m3 for `e4m3`,
    e5m2 for `hybrid`."""
    if fp8_format not in _GRADIENT_DTYPES:
        raise ValueError(f"--fp8-format {fp8_format!r}: fp8 dispatch knows {', '.join(_GRADIENT_DTYPES)}")
    return _GRADIENT_DTYPES[fp8_format]


def _scales(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Per-block quantization scales from float32 amaxes: fp8_max / amax rounded down to a power of
    two; 1 where amax is 0, infinite or NaN; the largest float32 where fp8_max / amax overflows."""
    scale = fp8_max / amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), 1.0, scale)
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H a multiple of 128) -> (fp8_dtype [T, H], float32 [T, H / 128]): the data and
    each block's dequantization scale (a power of two)."""
    tokens, hidden = x.shape
    blocks = x.float().view(tokens, hidden // BLOCK, BLOCK)
    scale = _scales(blocks.abs().amax(-1), torch.finfo(fp8_dtype).max)
    data = (blocks * scale.unsqueeze(-1)).to(fp8_dtype).view(tokens, hidden)
    return data, scale.reciprocal()


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, fp8_dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """(fp8 [R, H] or its bytes, float32 [R, H / 128]) -> [R, H] in `dtype`: each value, read as
    `fp8_dtype`, times its block's scale."""
    rows, hidden = data.shape
    values = data.view(fp8_dtype).float().view(rows, hidden // BLOCK, BLOCK) * scale_inv.unsqueeze(-1)
    return values.view(rows, hidden).to(dtype)


def wire_bytes_per_row(hidden: int) -> int:
    """What one dispatched row costs in fp8: its bytes and its float32 scales."""
    return hidden + 4 * (hidden // BLOCK)
