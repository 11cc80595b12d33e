"""What a step costs on the host and on the wire, counted where the calls happen.

`count_collectives()` wraps torch.distributed's collectives (and Megatron's aliases of them) and
adds up, per rank, the bytes each call hands to *other* ranks:
* all_to_all_single: the rows of every split but this rank's own (all rows / W x (W-1) without
  splits);
* all_gather / all_gather_into_tensor: the input, once per other rank;
* reduce_scatter: the input minus this rank's own shard;
* all_reduce: counted as calls, not bytes (its bytes depend on NCCL's algorithm; the calls are
  what the modes differ in: each is a point where ranks wait for each other).
Collectives issued by other libraries' own kernels (deep_ep's) are not seen: reported as None.

`DispatchTimer` times, per MoE layer forward, the host time from the layer's dispatch
preprocessing to the end of its token dispatch (Megatron's `MoELayer.preprocess` + `dispatch`),
which is where a dispatcher reads counts on the host, if it does.

`gpu_operations()` lists what the GPU ran during a step (torch.profiler, CUDA only): the bench's
GPU busy time per step (`busy_ms`) and `python -m megatron_ext.bench.profile`'s kernel table
(`kernel_times`) both come from it.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_BYTES_FUNCTIONS = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
)
# Megatron binds some collectives to module globals at import time; wrap those too.
_MEGATRON_ALIASES = (
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.utils", "dist_all_gather_func"),
)


@dataclass
class CollectiveLog:
    bytes_sent: int = 0
    all_reduces: int = 0
    calls: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ranks(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _bytes_to_others(name: str, args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group")
    world, rank = _ranks(group)
    if world == 1:
        return 0
    if name == "all_to_all_single":
        source = args[1] if len(args) > 1 else kwargs["input"]
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        if splits is None:
            return _nbytes(source) * (world - 1) // world
        splits = [int(s) for s in splits]  # host ints: Megatron and megatron-ext pass lists or numpy
        row = _nbytes(source) // max(sum(splits), 1)
        return row * (sum(splits) - splits[rank])
    if name == "all_gather":
        source = args[1] if len(args) > 1 else kwargs["tensor"]
        return _nbytes(source) * (world - 1)
    if name in ("all_gather_into_tensor", "_all_gather_base", "dist_all_gather_func"):
        source = args[1] if len(args) > 1 else kwargs["input_tensor"]
        return _nbytes(source) * (world - 1)
    source = args[1] if len(args) > 1 else kwargs["input"]  # reduce-scatter
    return _nbytes(source) * (world - 1) // world


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Count the collectives of this process inside the block (see the module docstring)."""
    import importlib

    log = CollectiveLog()
    originals: list[tuple[object, str, object]] = []

    def wrap(owner, attribute, kind):
        original = getattr(owner, attribute)

        def counted(*args, **kwargs):
            log.calls += 1
            if kind == "all_reduce":
                log.all_reduces += 1
            else:
                log.bytes_sent += _bytes_to_others(kind, args, kwargs)
            return original(*args, **kwargs)

        originals.append((owner, attribute, original))
        setattr(owner, attribute, counted)

    try:
        for name in _BYTES_FUNCTIONS:
            wrap(dist, name, name)
        wrap(dist, "all_reduce", "all_reduce")
        for module_name, attribute in _MEGATRON_ALIASES:
            module = importlib.import_module(module_name)
            if hasattr(module, attribute):
                kind = "dist_all_gather_func" if "gather" in attribute else "reduce_scatter_tensor"
                wrap(module, attribute, kind)
        yield log
    finally:
        for owner, attribute, original in reversed(originals):
            setattr(owner, attribute, original)


class DispatchTimer:
    """Host time (and, while `collectives` is set, bytes sent) of each forward dispatch of the layers.

    A forward dispatch is Megatron's `MoELayer.preprocess` followed by `MoELayer.dispatch`; a
    recompute in the backward is not counted.
    """

    def __init__(self, layers):
        self.samples_ms: list[float] = []
        self.returned_at: list[float] = []  # time.perf_counter() as each forward dispatch returned
        self.dispatch_bytes: list[int] = []
        self.enabled = False  # time while True
        self.collectives: CollectiveLog | None = None  # count bytes while set
        self._started: dict[int, tuple[float, int]] = {}
        for layer in layers:
            self._wrap(layer)

    def _sent(self) -> int:
        return self.collectives.bytes_sent if self.collectives is not None else 0

    def _wrap(self, layer) -> None:
        from megatron_ext.dispatcher import in_backward

        preprocess, dispatch = layer.preprocess, layer.dispatch
        key = id(layer)

        def timed_preprocess(*args, **kwargs):
            self._started[key] = (time.perf_counter(), self._sent())
            return preprocess(*args, **kwargs)

        def timed_dispatch(*args, **kwargs):
            result = dispatch(*args, **kwargs)
            started = self._started.pop(key, None)
            if started is None or in_backward():  # a recompute replays the forward in the backward
                return result
            self.returned_at.append(time.perf_counter())
            if self.enabled:
                self.samples_ms.append((time.perf_counter() - started[0]) * 1e3)
            if self.collectives is not None:
                self.dispatch_bytes.append(self._sent() - started[1])
            return result

        layer.preprocess, layer.dispatch = timed_preprocess, timed_dispatch


def gpu_operations(step: Callable[[], object], steps: int = 1) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel, copy and memset the GPU ran in `steps` calls of `step()`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]


def kernel_times(step: Callable[[], object], steps: int) -> dict[str, float]:
    """GPU milliseconds per step by kernel (or copy/memset) name, over `steps` calls of `step()`."""
    times: dict[str, float] = collections.defaultdict(float)
    for name, start, end in gpu_operations(step, steps):
        times[name] += (end - start) / 1e3 / steps
    return dict(times)


def busy_ms(operations: list[tuple[str, float, float]]) -> float:
    """Milliseconds in which at least one of `operations` ran (from `gpu_operations`).

    The union of their intervals, not their sum: operations on two streams (a collective's next
    to a GEMM) that overlap count once, so the busy time never exceeds the wall time it spans.
    """
    total = 0.0
    reached = float("-inf")  # the latest end so far, in start order
    for _, start, end in sorted(operations, key=lambda operation: operation[1]):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total / 1e3
