"""The quantization of --moe-hybridep-fp8-dispatch (`megatron_ext.hybridep.fp8`): TE's `blockwise`
rule for the experts' input (1 x 128 blocks, power-of-two scales), checked on values worked out by
hand, and the property the experts rely on: quantizing its output again gives the same values.
Its use in real MoE layers at 1, 2 and 4 ranks: `tests/test_moe_layer.py`."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.hybridep import fp8


def test_each_block_gets_448_over_its_amax_rounded_down_to_a_power_of_two():
    x = torch.zeros(3, 256)
    x[0, :128] = torch.linspace(-1.0, 1.0, 128)  # amax 1: 448 -> 256
    x[0, 128:] = 3.0  # amax 3: 149.3 -> 128
    x[1, :128] = 1e-3  # amax 1e-3: 448000 -> 2^18
    # x[1, 128:] and row 2: zeros -> scale 1
    x[2, 5] = float("inf")  # an infinite amax -> scale 1, as TE
    data, scale_inv = fp8.quantize(x)
    assert data.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.tolist() == [[1 / 256, 1 / 128], [2.0**-18, 1.0], [1.0, 1.0]]
    assert torch.equal(data[0, 128:].float(), torch.full((128,), 384.0))  # 3 x 128
    assert torch.equal(data[1, 128:].float(), torch.zeros(128))


def test_gradients_go_in_the_recipes_backward_format_with_its_own_largest_value():
    assert fp8.gradient_dtype("e4m3") == torch.float8_e4m3fn and fp8.gradient_dtype("hybrid") == torch.float8_e5m2
    with pytest.raises(ValueError, match="--fp8-format 'e5m2'"):
        fp8.gradient_dtype("e5m2")
    x = torch.zeros(2, 128)
    x[0] = torch.linspace(-1.0, 1.0, 128)  # amax 1: 57344 -> 2^15
    x[1, 0] = 3e-4  # amax 3e-4: 1.9e8 -> 2^27
    data, scale_inv = fp8.quantize(x, torch.float8_e5m2)
    assert data.dtype == torch.float8_e5m2
    assert scale_inv.tolist() == [[2.0**-15], [2.0**-27]]
    assert data[1, 0].float() == 40960.0  # 3e-4 x 2^27 = 40265.3, to e5m2's nearest (2 mantissa bits)
    back = fp8.dequantize(data.view(torch.uint8), scale_inv, torch.bfloat16, torch.float8_e5m2)
    assert torch.equal(fp8.dequantize(*fp8.quantize(back, torch.float8_e5m2), torch.bfloat16, torch.float8_e5m2), back)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_come_back_within_e4m3s_rounding_and_quantize_again_to_the_same_values(dtype):
    torch.manual_seed(0)
    x = (torch.randn(64, 512) * torch.logspace(-6, 4, 64).unsqueeze(1)).to(dtype)
    x[3] = 0
    data, scale_inv = fp8.quantize(x)
    back = fp8.dequantize(data, scale_inv, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    assert ((back.float() - x.float()).abs() <= x.float().abs() / 16).all()  # 3 mantissa bits
    assert (scale_inv.log2().frac() == 0).all()  # powers of two: q x 2^k is exact in bf16
    again = fp8.dequantize(*fp8.quantize(back), dtype)
    assert torch.equal(again, back)
    # Mostly the same bytes too; a block whose largest value rounded to 224 gets half the scale
    # and every value doubled (the same products).
    data2, scale_inv2 = fp8.quantize(back)
    changed = scale_inv2 != scale_inv
    assert torch.equal(scale_inv2[changed], scale_inv[changed] / 2)
    assert (data.view(torch.uint8) == data2.view(torch.uint8)).float().mean() > 0.9


def test_a_row_costs_its_bytes_and_a_float32_scale_per_block():
    assert fp8.wire_bytes_per_row(7168) == 7168 + 4 * 56
    assert fp8.wire_bytes_per_row(4096) / (2 * 4096) == pytest.approx(0.5156, abs=1e-4)
