"""The quantization bench's bookkeeping: which tensors an fp8 expert layer quantizes, which cross a
dispatch, and what quantizing those before it would save (the timings need a GPU and TE)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.bench import quantize
from megatron_ext.bench.sizes import SIZES


def test_an_expert_layer_quantizes_four_tensors_two_of_which_a_dispatch_carries():
    large = SIZES["large"]  # hidden 4,096, FFN 1,024 (GLU: fc1 writes 2,048 columns)
    assert quantize.tensors(large) == {
        "experts' input": (4096, True),
        "fc2 input": (1024, False),
        "fc1 output gradient": (2048, False),
        "fc2 output gradient": (4096, True),
    }


def test_the_saving_replaces_the_carried_tensors_row_wise_half_by_the_tokens():
    both, cols, rows, tok = quantize.BOTH, quantize.COLUMNS, quantize.ROWS, quantize.TOKENS
    times = {
        "carried": {both: 10.0, cols: 6.0, rows: 5.0, tok: 1.0},
        "not carried": {both: 4.0, cols: 3.0, rows: 2.0},
    }
    summary = quantize.summarize(times, layers=8)
    # now: 10 + 4; before the dispatch: (1 + 6) + 4 -> 3 ms saved a layer, 24 of 112 a step
    assert summary == {
        "now_ms": 14.0,
        "quantized_before_dispatch_ms": 11.0,
        "saved_ms": 3.0,
        "layers": 8,
        "now_per_step_ms": 112.0,
        "saved_per_step_ms": 24.0,
    }
    # Nothing carried (no tensor timed for its tokens), nothing saved.
    uncarried = {name: {usage: ms for usage, ms in t.items() if usage != tok} for name, t in times.items()}
    assert quantize.summarize(uncarried, layers=1)["saved_ms"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_what_it_needs(capsys):
    with pytest.raises(SystemExit) as exit_:
        quantize.main(["--size", "large"])
    assert exit_.value.code == 2
    assert "needs a CUDA GPU and Transformer Engine" in capsys.readouterr().err
