"""What the one-GPU kernel benches (`gemm`, `quantize`) share: their command line, CUDA-event
timing and the JSON record."""

from __future__ import annotations

import argparse
import json

import torch

from megatron_ext.bench.sizes import SIZES
from megatron_ext.tooling.timing import cuda_ms


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """`python -m megatron_ext.bench.MODULE` with `--size` (repeatable), `--iters` and `--json`."""
    p = argparse.ArgumentParser(prog=f"python -m megatron_ext.bench.{module}", description=doc.split("\n\n")[0])
    p.add_argument("--size", action="append", choices=sorted(SIZES), help="a bench size (repeatable; default large)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per figure (the median is kept)")
    p.add_argument("--json", help="write the results here")
    return p


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """The median of `iters` timed calls of `fn` (CUDA events, after `warmup` calls), in ms; each
    call alone, as a layer's kernels run between other work."""
    return cuda_ms(fn, iters, warmup, each_alone=True)


def write_json(path: str | None, results: list[dict]) -> None:
    """The results with the device and torch's version, where `--json` asked for them."""
    if path:
        with open(path, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1
            )
