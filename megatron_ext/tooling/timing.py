"""GPU time of a call, read from CUDA events: what the round trip and the kernel benches time with."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_ms(fn: Callable[[], object], iters: int, warmup: int = 1, each_alone: bool = False) -> float:
    """The median time of `iters` calls of `fn` in ms, between CUDA events recorded around each,
    after `warmup` untimed calls. The calls are queued back to back and the events read at the
    end; `each_alone`: each call is waited for before the next is issued (nothing of one call
    overlaps the next, and the host's launch time counts where it exceeds the GPU's)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if each_alone:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
