"""One expert layer's six GEMMs in bf16 against fp8 with row-wise scales, on one GPU.

    python -m megatron_ext.bench.gemm --size large --json out.json

For a size's expert layer (tokens x top-k rows spread evenly over the experts, GLU), times with
CUDA events, side by side in one run, each GEMM of the forward (fc1, fc2), of the data gradients
and of the weight gradients: in bf16 (torch's `grouped_mm`, what megatron-ext's own experts run)
and in e4m3 (torch's `_scaled_grouped_mm` over the same device offsets, operands quantized
beforehand, the quantization not timed). Row-wise scales are the one fp8 scaling that torch's
grouped GEMM takes on compute capability 9.0: one float32 scale per row of each operand along the
contraction dimension (per token row and weight row; for the weight gradients, which contract
over tokens, per column within each expert's rows). It answers whether fp8 experts of megatron-ext's
own on that GEMM could be faster than its bf16 ones before any quantization is paid for.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from megatron_ext.bench.kernel_timing import parser, time_ms, write_json
from megatron_ext.bench.sizes import SIZES, describe_size
from megatron_ext.hybridep.fp8 import E4M3_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K] row-major, float32 [...]) with dequantized = q * scale."""
    x = x.contiguous()
    amax = x.abs().amax(-1, keepdim=True).float()
    q = (x.float() * (E4M3_MAX / amax.clamp(min=1e-12))).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).squeeze(-1)


def quantize_columns_per_group(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, K] in `groups` equal blocks of rows -> (e4m3 [K, P] row-major, float32 [groups * K]):
    each column scaled within each block, as a weight gradient's operand."""
    rows, cols = x.shape
    amax = x.view(groups, rows // groups, cols).abs().amax(1).float()  # [G, K]
    scale = (E4M3_MAX / amax.clamp(min=1e-12)).repeat_interleave(rows // groups, 0)
    q = (x.float() * scale).to(torch.float8_e4m3fn).t().contiguous()
    return q, (amax / E4M3_MAX).reshape(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def measure(size: str, iters: int) -> dict:
    s = SIZES[size]
    experts, hidden, ffn = s["experts"], s["hidden"], s["ffn_hidden"]
    rows = s["tokens"] * s["topk"]
    if rows % (16 * experts):
        raise ValueError(f"--size {size}: {rows} rows do not split into {experts} experts of a multiple of 16")
    dev = torch.device("cuda")
    torch.manual_seed(0)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, device=dev) * std).bfloat16()

    x, act, grad, grad_h = rand(rows, hidden), rand(rows, ffn), rand(rows, hidden), rand(rows, 2 * ffn)
    w1, w2 = rand(experts, 2 * ffn, hidden, std=hidden**-0.5), rand(experts, hidden, ffn, std=ffn**-0.5)
    offsets = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (rows // experts)

    # Each GEMM: bf16 operands as grouped_mm takes them, and their quantized twins (row-wise
    # along the contraction dimension; the second operand column-major).
    def rows_b(w):  # [E, N, K] -> e4m3 [E, K, N] column-major, scales [E, N]
        q, scale = quantize_rows(w)
        return q.transpose(1, 2), scale

    def cols(t):  # [P, K] -> e4m3 [K, P], scales [E * K]
        return quantize_columns_per_group(t, experts)

    gemms = {  # name: (a, b as grouped_mm takes them, fp8 a and scale, fp8 b and scale)
        "fc1": (x, w1.transpose(1, 2), quantize_rows(x), rows_b(w1)),
        "fc2": (act, w2.transpose(1, 2), quantize_rows(act), rows_b(w2)),
        "fc2 dgrad": (grad, w2, quantize_rows(grad), rows_b(w2.transpose(1, 2))),
        "fc1 dgrad": (grad_h, w1, quantize_rows(grad_h), rows_b(w1.transpose(1, 2))),
        "fc2 wgrad": (grad.t(), act, cols(grad), (lambda q, sc: (q.t(), sc))(*cols(act))),
        "fc1 wgrad": (grad_h.t(), x, cols(grad_h), (lambda q, sc: (q.t(), sc))(*cols(x))),
    }
    result = {"size": size, "shape": describe_size(s), "rows": rows, "gemm_ms": {}, "fp8_rel_error": {}}
    for name, (a, b, (qa, sa), (qb, sb)) in gemms.items():

        def bf16_call(a=a, b=b):
            return F.grouped_mm(a, b, offs=offsets)

        def fp8_call(qa=qa, qb=qb, sa=sa, sb=sb):
            return torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offsets, out_dtype=torch.bfloat16)

        result["gemm_ms"][name] = {"bf16": time_ms(bf16_call, iters), "fp8": time_ms(fp8_call, iters)}
        result["fp8_rel_error"][name] = _rel(fp8_call(), bf16_call())
    result["gemm_total_ms"] = {k: sum(v[k] for v in result["gemm_ms"].values()) for k in ("bf16", "fp8")}
    return result


def main(argv=None) -> int:
    p = parser("gemm", __doc__)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        p.error("needs a CUDA GPU of compute capability 9.0 or more (torch's fp8 grouped GEMM)")
    results = []
    for size in args.size or ["large"]:
        r = measure(size, args.iters)
        results.append(r)
        print(f"{size} ({r['shape']}, {r['rows']} rows):")
        for name, v in {**r["gemm_ms"], "6 GEMMs": r["gemm_total_ms"]}.items():
            error = r["fp8_rel_error"].get(name)
            print(
                f"  {name:10s} bf16 {v['bf16']:7.3f} ms  fp8 {v['fp8']:7.3f} ms  ({v['fp8'] / v['bf16']:.2f}x)"
                + (f"  fp8 error {error:.3f}" if error is not None else "")
            )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
