"""The GEMM bench's fp8 operands: row-wise scales along the contraction dimension, as torch's
scaled grouped GEMM takes them (the GEMMs themselves need a GPU of compute capability 9.0)."""

from __future__ import annotations

import torch

from megatron_ext.bench.gemm import E4M3_MAX, quantize_columns_per_group, quantize_rows


def test_rows_are_scaled_each_by_its_own_amax_and_come_back_within_e4m3s_rounding():
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1.0, 0.5]).unsqueeze(1)
    x[4] = 0  # a zero row: scale 0, zeros, no NaN
    q, scale = quantize_rows(x.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous() and scale.shape == (6,)
    back = q.float() * scale[:, None]
    assert torch.equal(q.float().abs().amax(1)[[0, 1, 2, 3, 5]], torch.full((5,), E4M3_MAX))
    assert torch.equal(back[4], torch.zeros(64)) and scale[4] == 0
    xb = x.bfloat16().float()
    assert ((back - xb).abs() <= xb.abs() / 16 + scale[:, None] * 2**-9).all()  # e4m3: 3 mantissa bits
    # A transposed view is quantized into a row-major copy of its own rows.
    w = torch.randn(2, 8, 16).bfloat16()
    qt, st = quantize_rows(w.transpose(1, 2))
    assert qt.is_contiguous() and st.shape == (2, 16)
    assert torch.equal(st, w.transpose(1, 2).abs().amax(-1).float() / E4M3_MAX)


def test_columns_are_scaled_within_each_experts_rows_and_laid_out_transposed():
    torch.manual_seed(1)
    experts, rows, cols = 3, 12, 8
    x = torch.randn(rows, cols).bfloat16()
    x[4:8] *= 100  # the second expert's rows: its scales alone grow
    q, scale = quantize_columns_per_group(x, experts)
    assert q.shape == (cols, rows) and q.is_contiguous() and scale.shape == (experts * cols,)
    expected = x.float().view(experts, rows // experts, cols).abs().amax(1) / E4M3_MAX
    assert torch.equal(scale, expected.reshape(-1))
    back = q.float().t() * scale.view(experts, cols).repeat_interleave(rows // experts, 0)
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + 1e-6).all()
