"""What quantizing before the dispatch could save: TE's blockwise fp8 quantization of one expert
layer's activations and gradients, timed on one GPU.

    python -m megatron_ext.bench.quantize --size large --json out.json

An fp8 expert layer under `--fp8-recipe blockwise` (TE's op-fuser experts) quantizes four tensors
per step, each row-wise (1 x 128 blocks along a row, for the GEMM that reads rows) and column-wise
(128 x 1 blocks along the tokens, for the weight gradient): the experts' input [R, H], the fc2
input [R, F], the fc1 output's gradient [R, 2F] and the fc2 output's gradient [R, H], R = tokens x
top-k rows. Two of them cross the dispatch: the experts' input (the forward's dispatch) and the
fc2 output's gradient (the combine's backward). Quantized before the dispatch, their row-wise
halves would be made for the T tokens rather than the R rows; their column-wise halves depend on
which rows each expert received, so the receiving rank still makes them.

Times with CUDA events, side by side in one run, Transformer Engine's `Float8BlockQuantizer`
(e4m3, power-of-two scales, 1-D blocks: the recipe's activations and gradients) on each tensor:
row-wise and column-wise together (what TE runs now, one pass), column-wise alone and row-wise
alone, and the row-wise quantization of the T tokens. The summary sets what TE pays now against
what it would pay with the dispatched tensors quantized row-wise before the dispatch, per layer
and for the size's layers. It times TE's whole-tensor kernel; the op fuser runs TE's grouped one,
whose per-step total is in the bench's profile (`.ci/gpu-suite profile`).
"""

from __future__ import annotations

import sys

import torch

from megatron_ext.bench.kernel_timing import parser, time_ms, write_json
from megatron_ext.bench.sizes import SIZES, describe_size

BOTH, COLUMNS, ROWS = "rows+columns", "columns", "rows"
USAGES = {BOTH: (True, True), COLUMNS: (False, True), ROWS: (True, False)}
TOKENS = "rows of the T tokens"


def tensors(size: dict) -> dict[str, tuple[int, bool]]:
    """{tensor: (width, whether a dispatch carries it)} of one expert layer (GLU) at `size`."""
    hidden, ffn = size["hidden"], size["ffn_hidden"]
    return {
        "experts' input": (hidden, True),
        "fc2 input": (ffn, False),
        "fc1 output gradient": (2 * ffn, False),
        "fc2 output gradient": (hidden, True),
    }


def summarize(times: dict[str, dict[str, float]], layers: int) -> dict[str, float]:
    """From per-tensor times ({tensor: {usage: ms}}, with `TOKENS` for those a dispatch carries):
    what TE pays per layer now (each tensor row- and column-wise in one pass), what it would pay
    with the carried tensors quantized row-wise before the dispatch (their tokens row-wise, their
    rows column-wise after it), the difference, and both over `layers` layers."""
    now = sum(t[BOTH] for t in times.values())
    before = sum(t[TOKENS] + t[COLUMNS] if TOKENS in t else t[BOTH] for t in times.values())
    return {
        "now_ms": now,
        "quantized_before_dispatch_ms": before,
        "saved_ms": now - before,
        "layers": layers,
        "now_per_step_ms": now * layers,
        "saved_per_step_ms": (now - before) * layers,
    }


def measure(size_name: str, iters: int) -> dict:
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    size = SIZES[size_name]
    tokens = size["tokens"]
    rows = tokens * size["topk"]
    torch.manual_seed(0)

    def quantizer(rowwise: bool, columnwise: bool):
        return Float8BlockQuantizer(
            tex.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise, force_pow_2_scales=True, block_scaling_dim=1
        )

    def timed(rowwise: bool, columnwise: bool, x: torch.Tensor) -> float:
        q = quantizer(rowwise, columnwise)
        return time_ms(lambda: q(x), iters)

    times = {}
    for name, (width, dispatched) in tensors(size).items():
        x = torch.randn(rows, width, device="cuda").bfloat16()
        times[name] = {usage: timed(*flags, x) for usage, flags in USAGES.items()}
        if dispatched:
            times[name][TOKENS] = timed(True, False, x[:tokens].contiguous())
        del x
    return {
        "size": size_name,
        "shape": describe_size(size),
        "rows": rows,
        "tokens": tokens,
        "quantize_ms": times,
        "summary": summarize(times, size["layers"]),
    }


def main(argv=None) -> int:
    p = parser("quantize", __doc__)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU and Transformer Engine (it times TE's fp8 quantization)")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        p.error(f"needs Transformer Engine (it times TE's fp8 quantization): {exc}")
    results = []
    for size in args.size or ["large"]:
        r = measure(size, args.iters)
        results.append(r)
        print(f"{size} ({r['shape']}; {r['rows']} rows, {r['tokens']} tokens), ms per layer:")
        for name, t in r["quantize_ms"].items():
            print(f"  {name:20s} " + "  ".join(f"{usage} {ms:.3f}" for usage, ms in t.items()))
        s = r["summary"]
        print(
            f"  now {s['now_ms']:.3f}, quantized before the dispatch {s['quantized_before_dispatch_ms']:.3f}: "
            f"{s['saved_ms']:.3f} ms saved per layer, {s['saved_per_step_ms']:.2f} of {s['now_per_step_ms']:.2f} "
            f"per step of {s['layers']} layers"
        )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
