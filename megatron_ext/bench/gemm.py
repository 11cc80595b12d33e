"""One expert layer's GEMMs in bf16 against fp8 with row-wise scales, on one GPU.

    python -m megatron_ext.bench.gemm --size large --json out.json

For a size's expert layer (tokens x top-k rows spread evenly over the experts, GLU, SiLU), times
with CUDA events, side by side in one run:
- each of the six GEMMs (fc1, fc2; their data gradients; their weight gradients) in bf16
  (`grouped_mm`) and in e4m3 (`_scaled_grouped_mm`, operands already quantized);
- the whole layer forward + backward: bf16 (`experts._FusedExperts`) and fp8
  (`fp8_rowwise.Fp8RowwiseExperts`, quantizing with torch operations), the latter both from bf16
  rows and from rows quantized before the dispatch;
and the fp8 layer's error against bf16 (relative Frobenius norm of the output and gradients).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from megatron_ext.bench.sizes import SIZES, describe_size


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def measure(size: str, iters: int) -> dict:
    from megatron_ext import fused
    from megatron_ext.experts import _FusedExperts
    from megatron_ext.fp8_rowwise import Fp8RowwiseExperts, quantize_columns_per_group, quantize_rows

    s = SIZES[size]
    experts, hidden, ffn = s["experts"], s["hidden"], s["ffn_hidden"]
    rows = s["tokens"] * s["topk"]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(rows, device=dev, dtype=torch.float32)
    w1 = (torch.randn(experts, 2 * ffn, hidden, device=dev) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, device=dev) / ffn**0.5).bfloat16()
    offsets = torch.linspace(rows / experts, rows, experts, device=dev).round().to(torch.int32)
    grad = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    g2 = torch.randn(rows, 2 * ffn, device=dev, dtype=torch.bfloat16)
    act = torch.randn(rows, ffn, device=dev, dtype=torch.bfloat16)

    # The six GEMMs as (name, bf16 call, fp8 call); fp8 operands quantized beforehand.
    xq, xs = quantize_rows(x)
    aq, a_s = quantize_rows(act)
    gq, gs = quantize_rows(grad)
    g2q, g2s = quantize_rows(g2)
    w1q, w1s = quantize_rows(w1)
    w2q, w2s = quantize_rows(w2)
    w1t, w1ts = quantize_rows(w1.transpose(1, 2))
    w2t, w2ts = quantize_rows(w2.transpose(1, 2))
    gc, gcs = quantize_columns_per_group(grad, offsets)
    ac, acs = quantize_columns_per_group(act, offsets)
    g2c, g2cs = quantize_columns_per_group(g2, offsets)
    xc, xcs = quantize_columns_per_group(x, offsets)
    sgm = torch._scaled_grouped_mm
    bf = torch.bfloat16
    gemms = {
        "fc1": (
            lambda: F.grouped_mm(x, w1.transpose(1, 2), offs=offsets),
            lambda: sgm(xq, w1q.transpose(1, 2), xs, w1s, offs=offsets, out_dtype=bf),
        ),
        "fc2": (
            lambda: F.grouped_mm(act, w2.transpose(1, 2), offs=offsets),
            lambda: sgm(aq, w2q.transpose(1, 2), a_s, w2s, offs=offsets, out_dtype=bf),
        ),
        "fc2 dgrad": (
            lambda: F.grouped_mm(grad, w2, offs=offsets),
            lambda: sgm(gq, w2t.transpose(1, 2), gs, w2ts, offs=offsets, out_dtype=bf),
        ),
        "fc2 wgrad": (
            lambda: F.grouped_mm(grad.t(), act, offs=offsets),
            lambda: sgm(gc, ac.t(), gcs, acs, offs=offsets, out_dtype=bf),
        ),
        "fc1 dgrad": (
            lambda: F.grouped_mm(g2, w1, offs=offsets),
            lambda: sgm(g2q, w1t.transpose(1, 2), g2s, w1ts, offs=offsets, out_dtype=bf),
        ),
        "fc1 wgrad": (
            lambda: F.grouped_mm(g2.t(), x, offs=offsets),
            lambda: sgm(g2c, xc.t(), g2cs, xcs, offs=offsets, out_dtype=bf),
        ),
    }
    result = {"size": size, "shape": describe_size(s), "rows": rows, "gemm_ms": {}}
    for name, (bf16_call, fp8_call) in gemms.items():
        result["gemm_ms"][name] = {"bf16": _time_ms(bf16_call, iters), "fp8": _time_ms(fp8_call, iters)}

    silu = fused.SILU

    def layer(fn, *inputs):
        leaves = [t.detach().requires_grad_(t.is_floating_point() and t.dtype != torch.float8_e4m3fn) for t in inputs]
        return leaves, fn(*leaves)

    def bf16_step():
        (xi, pi, a, b), out = layer(lambda xx, pp, a, b: _FusedExperts.apply(xx, pp, a, b, offsets, True, silu), x, probs, w1, w2)
        out.backward(grad)
        return out, xi.grad, pi.grad, a.grad, b.grad

    def fp8_step():
        (xi, pi, a, b), out = layer(lambda xx, pp, a, b: Fp8RowwiseExperts.apply(xx, None, pp, a, b, offsets, True, silu), x, probs, w1, w2)
        out.backward(grad)
        return out, xi.grad, pi.grad, a.grad, b.grad

    def fp8_prequantized_step():
        (pi, a, b), out = layer(lambda pp, a, b: Fp8RowwiseExperts.apply(xq, xs, pp, a, b, offsets, True, silu), probs, w1, w2)
        out.backward(grad)
        return out, pi.grad, a.grad, b.grad

    result["layer_ms"] = {
        "bf16": _time_ms(bf16_step, iters),
        "fp8": _time_ms(fp8_step, iters),
        "fp8 quantized before dispatch": _time_ms(fp8_prequantized_step, iters),
    }
    ref, ours = bf16_step(), fp8_step()
    result["fp8_rel_error"] = {
        name: _rel(o, r) for name, o, r in zip(("out", "grad_x", "grad_probs", "grad_w1", "grad_w2"), ours, ref)
    }
    gemm_bf16 = sum(v["bf16"] for v in result["gemm_ms"].values())
    gemm_fp8 = sum(v["fp8"] for v in result["gemm_ms"].values())
    result["gemm_total_ms"] = {"bf16": gemm_bf16, "fp8": gemm_fp8}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.bench.gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", action="append", choices=sorted(SIZES), help="a bench size (repeatable; default large)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per figure (the median is kept)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        p.error("needs a CUDA GPU of compute capability 9.0 or more (torch's fp8 grouped GEMM)")
    results = []
    for size in args.size or ["large"]:
        r = measure(size, args.iters)
        results.append(r)
        print(f"{size} ({r['shape']}, {r['rows']} rows):")
        for name, v in r["gemm_ms"].items():
            print(f"  {name:10s} bf16 {v['bf16']:7.3f} ms  fp8 {v['fp8']:7.3f} ms  ({v['fp8'] / v['bf16']:.2f}x)")
        t = r["gemm_total_ms"]
        print(f"  {'6 GEMMs':10s} bf16 {t['bf16']:7.3f} ms  fp8 {t['fp8']:7.3f} ms  ({t['fp8'] / t['bf16']:.2f}x)")
        lay = r["layer_ms"]
        for name, ms in lay.items():
            print(f"  layer fwd+bwd {name}: {ms:.3f} ms ({ms / lay['bf16']:.2f}x bf16)")
        print("  fp8 relative error: " + ", ".join(f"{k} {v:.4f}" for k, v in r["fp8_rel_error"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
