"""The bench's stack and run sizes: `Sizes`, the named `--size` presets, and a parser that fills them in.

`run` and `stack` take a `Sizes`; `cli` (and `profile`, `kernels`) parse them. This module imports
nothing of the bench's, so each of those can import it without a circle.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Sizes:
    """The stack and the run; the same for every mode."""

    layers: int
    tokens: int  # per rank
    hidden: int
    ffn_hidden: int
    experts: int
    topk: int
    dtype: str  # 'bf16' | 'fp16' | 'fp32'
    skew: float
    capacity_factor: float
    steps: int
    check_steps: int
    warmup: int
    seed: int
    runahead_sleep_ms: float = 300.0
    repeat: int = 1
    deep_ep_num_sms: Optional[int] = None  # --moe-flex-dispatcher-num-sms of every mode (None: deep_ep's default)
    micro_batches: int = 1  # forward+backward passes per step, gradients accumulated
    size: Optional[str] = None  # the `--size` preset the stack came from, if any (flags may override it)

    @property
    def steps_per_mode(self) -> int:
        """Checked, warm-up, counted and timed steps in one round."""
        return self.check_steps + self.warmup + 1 + self.steps


# Named stacks, so a command names its size instead of spelling six flags: the sizes the
# benchmarks report (docs/benchmarks.md). Without --size, DEFAULT_SIZE (a stack CPU ranks run in seconds).
SIZE_FIELDS = ("layers", "tokens", "hidden", "ffn_hidden", "experts", "topk")
SIZES = {
    "small": dict(layers=8, tokens=512, hidden=512, ffn_hidden=256, experts=16, topk=2),
    "mid": dict(layers=4, tokens=4096, hidden=2048, ffn_hidden=1024, experts=32, topk=4),
    "fine": dict(layers=8, tokens=4096, hidden=2048, ffn_hidden=768, experts=128, topk=8),
    "large": dict(layers=8, tokens=8192, hidden=4096, ffn_hidden=1024, experts=64, topk=8),
    # A DeepSeek-V3-like slice of experts: the GEMMs, not the dispatch, dominate the step.
    "wide": dict(layers=4, tokens=4096, hidden=7168, ffn_hidden=2048, experts=32, topk=8),
}
DEFAULT_SIZE = dict(layers=2, tokens=256, hidden=128, ffn_hidden=128, experts=8, topk=2)


def describe_size(fields: dict) -> str:
    return (
        f"{fields['layers']} layers, T {fields['tokens']}, H {fields['hidden']}, FFN {fields['ffn_hidden']}, "
        f"E {fields['experts']}, top-{fields['topk']}"
    )


def fill_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """Each stack-size field left unset (None) from `args.size`'s preset, or else from DEFAULT_SIZE;
    a field given as a flag stays. Only the fields `args` has (a tool may take a few of them)."""
    preset = SIZES[args.size] if getattr(args, "size", None) else DEFAULT_SIZE
    for name in SIZE_FIELDS:
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, preset[name])
    return args


def least_bytes(fields: dict, world_size: int, dtype_bytes: int, capacity_factor: float = 1.0) -> int:
    """A lower bound of the memory the bench's `world_size` ranks hold together for this stack:
    the expert weights (GLU: 3 x hidden x FFN each) and their gradients, and on every rank each
    layer's dispatched rows (tokens x top-k, hidden wide; `capacity_factor` times as many in a
    capacity mode, whose layers hold their capacity) and fc1 outputs (2 x FFN wide), kept for the
    backward. The bench holds more: the checked steps' reference outputs and gradients, the
    dispatch buffers."""
    weights = 2 * fields["layers"] * fields["experts"] * 3 * fields["hidden"] * fields["ffn_hidden"]
    rows = fields["tokens"] * fields["topk"]
    held = math.ceil(rows * max(capacity_factor, 1.0))
    activations = world_size * fields["layers"] * (held * fields["hidden"] + rows * 2 * fields["ffn_hidden"])
    return (weights + activations) * dtype_bytes


class SizedParser(argparse.ArgumentParser):
    """A parser whose results have the stack sizes filled in (`fill_sizes`): the size flags default
    to None so that one given next to --size can be told from one left out. Its errors are one
    line, without argparse's usage block (`--help` prints that)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        return fill_sizes(parsed), rest

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
