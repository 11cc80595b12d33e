"""Training-safe capacity mode: an overflow re-runs the step instead of ending the job.

`OverflowRerun` wraps the `forward_backward_func` of Megatron's training loop (installed by
`megatron_ext.patches`, feature "training") when `--moe-hybridep-capacity-factor` is set and
`--moe-hybridep-overflow-policy` is `rerun` (the default). For each step it:

1. reads the step's micro-batches from the data iterators, so they can be fed again;
2. runs the step with every capacity-mode layer recording an overflow on the device instead of
   stopping at it (the step may train on truncated rows: its results are not kept if so);
3. checks once, at the step's end, whether any rank's layer overflowed (one all-reduce over all
   ranks and one host read for the whole model);
4. if one did: discards the step's gradients (and the MoE auxiliary-loss tracker's values) and
   puts back the fp8 delayed-scaling state that the step recorded (`DelayedScalingState`), runs
   the same micro-batches again with every dispatch blocking, so no micro-batch is skipped and
   nothing is trained on truncated tokens, then grows each layer's capacity to ceil(rows x
   factor) of the largest row count the re-run needed (EP-group maximum). The next step runs in
   capacity mode again. Capacities change only here, between steps, never while activation
   checkpoints of a step may still be replayed.
5. if none did, but some layer filled more than half of the padding above its calibrated rows,
   grows that layer's capacity the same way (from the most rows it filled), so that drifting
   routing is met before it overflows. The check of step 3 covers this too: no extra read.

Outside Megatron's training loop nothing wraps the step, and an overflow stops on the device as
before (`--moe-hybridep-overflow-policy fail` keeps that inside the loop too).

With per-layer graphs (`--cuda-graph-impl local`, of the whole layer or `--cuda-graph-modules
moe`), Megatron's schedule records each graphed module's first pass and captures them all at the
step's end (`create_cudagraphs`); a later step replays them. An overflow's re-run deletes the
graphs first (`delete_cuda_graphs`, and every graph manager's runners, which Megatron's delete
leaves in place once captured: the modules run eagerly again, recording), runs with blocking
dispatches while the schedule's capture is skipped (`capture_paused`: a blocking dispatch cannot
be captured), and deletes what it recorded: the next step records at the new capacities, eagerly
(compiling kernels for their sizes), and captures at its end. A capacity grown for thin headroom
deletes the graphs the same way.

With `--cuda-graph-impl full_iteration`, Megatron wraps the step function in its
`FullCudaGraphWrapper`, which would put this policy's host read inside the captured graph.
`full_iteration_graph` (installed by `megatron_ext.patches` in its place) turns the two inside
out: the graph holds the step, the policy runs around it. The step-end check reads the counters
the replay wrote in place; an overflow's re-run runs the eager step function with blocking
dispatches, and a capacity that grew (after a re-run, or thin headroom) drops the graphs: the
next step runs eagerly at the new capacity (compiling kernels for its sizes) and the one after it
is captured again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_ext.capacity import capacity_reciprocal
from megatron_ext.capacity.policy import megatron_metric_values
from megatron_ext.dispatcher import (
    CAPACITY_USE_MAX_METRIC,
    HybridEPCapacityManager,
    dispatch_managers,
    group_device,
    numbered_layers,
)
from megatron_ext.logs import once_per_job

logger = logging.getLogger("megatron_ext.recovery")  # the name its lines had: users may filter by it


def capacity_managers(model: Any) -> list[HybridEPCapacityManager]:
    """The capacity-mode dispatch managers of `model` (a module or Megatron's list of chunks)."""
    return [m for m in dispatch_managers(model) if m.options.capacity_factor is not None]


# Whether this process runs capacity mode in Megatron's training loop (set by OverflowRerun on its
# first step, on every rank alike): the MoE metrics report then includes CAPACITY_USE_METRIC.
_capacity_metrics = False


def capacity_metrics_on() -> bool:
    return _capacity_metrics


def _config(model: Any) -> Any:
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return get_model_config(chunks[0])


def _policy(model: Any) -> Optional[str]:
    """The overflow policy when capacity mode is on, else None (the config is the same on every
    rank, so every rank decides alike)."""
    config = _config(model)
    if getattr(config, "moe_hybridep_capacity_factor", None) is None:
        return None
    return getattr(config, "moe_hybridep_overflow_policy", "rerun")


def _per_layer_graphs_hold_dispatch(model: Any) -> bool:
    """Whether Megatron's per-layer graphs (`--cuda-graph-impl local`) capture the MoE dispatch."""
    from megatron_ext.options import graph_impl, graphs_hold_dispatch

    config = _config(model)
    return graph_impl(config) == "local" and graphs_hold_dispatch(config)


# True while an overflowed step re-runs under per-layer graphs: the schedule's capture at the
# step's end is skipped (the patched `megatron.core.pipeline_parallel.schedules.create_cudagraphs`).
_capture_paused = False


def capture_paused() -> bool:
    return _capture_paused


def drop_per_layer_graphs(chunks: Iterable[torch.nn.Module], why: str) -> None:
    """Delete Megatron's per-layer graphs of `chunks` and what they recorded: the next step records
    its graphed modules again, eagerly, and the schedule captures them at that step's end."""
    _delete_per_layer_graphs(chunks)
    logger.log(
        once_per_job(logging.WARNING),
        "megatron-ext: %s: the per-layer CUDA graphs are dropped; the next step runs eagerly at the new "
        "capacities and is captured again at its end.",
        why,
    )


def _delete_per_layer_graphs(chunks: Iterable[torch.nn.Module]) -> None:
    """Megatron's `delete_cuda_graphs`, and what it leaves behind. It resets only the runners still
    in its record, which a capture empties: the runners of graphs already captured would keep
    their recorded state, so the modules would run eagerly but never record, and no graph would be
    captured again. Every graph manager in `chunks` forgets its runners (the next step makes new
    ones, which record), and the shared memory pool that the delete released is made again.

    The steps until the next capture run on a side stream, as Megatron sets up before its first
    capture (its graph manager does, when it makes the pool): a capture fails when work before it
    ran on the legacy default stream ("operation would make the legacy stream depend on a capturing
    blocking stream"), and Megatron moves back to that stream after every capture."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, delete_cuda_graphs

    delete_cuda_graphs()
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, CudaGraphManager):
                module.cudagraph_runners = []
                module.custom_cudagraphs_lookup_table.clear()
    if CudaGraphManager.global_mempool is None and torch.cuda.is_available():
        CudaGraphManager.global_mempool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream()
        if current == torch.cuda.default_stream():
            side = torch.cuda.Stream()
            side.wait_stream(current)  # what the default stream queued comes first
            torch.cuda.set_stream(side)


@contextlib.contextmanager
def _eager_under_per_layer_graphs(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """A step run eagerly where per-layer graphs were replayed: the graphs are deleted before it
    (the modules then run their eager forward, recording), the schedule's capture is skipped, and
    what the step recorded is dropped after it."""
    global _capture_paused
    _delete_per_layer_graphs(chunks)
    _capture_paused = True
    try:
        yield
    finally:
        _capture_paused = False
        drop_per_layer_graphs(chunks, "a step re-ran after an overflow")


def _replayable(data_iterator: Any, num_microbatches: int) -> Callable[[], Any]:
    """Read the step's micro-batches now; return a function giving fresh iterators over them,
    shaped like `data_iterator` (an iterator, None, or one per model chunk)."""

    def read(iterator):
        return None if iterator is None else [next(iterator) for _ in range(num_microbatches)]

    if isinstance(data_iterator, list):
        per_chunk = [read(iterator) for iterator in data_iterator]
        return lambda: [None if batches is None else iter(batches) for batches in per_chunk]
    batches = read(data_iterator)
    return lambda: None if batches is None else iter(batches)


def _discard_gradients(chunks: Iterable[torch.nn.Module]) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):  # Megatron's DDP: the gradients live in its buffers
            chunk.zero_grad_buffer()
        for parameter in chunk.parameters():
            parameter.grad = None
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()  # what the overflowed step recorded (aux losses, capacity use)


class DelayedScalingState:
    """The fp8 delayed-scaling state of Transformer Engine's modules in `chunks` (`--fp8-recipe
    delayed`): each module's scales and amax histories (`fp8_meta["scaling_fwd"]` and
    `["scaling_bwd"]`), kept before a step and put back before that step's re-run.

    Delayed scaling quantizes a step with scales made from the amaxes that earlier steps recorded.
    An overflowed step records its own amaxes before it is discarded; without this, its re-run, and
    every step after it, would quantize with scales that a blocking run never had: close to it,
    not the same. A module whose state the step made (its first fp8 step) gets TE's initial state
    back (scale 1, amax history 0). The other recipes' states (current scaling, blockwise) keep no
    scales between steps and are left alone. Device copies only: no host read, nothing in a graph."""

    KEYS = ("scaling_fwd", "scaling_bwd")

    def __init__(self, chunks: Iterable[torch.nn.Module]):
        self.chunks = list(chunks)
        self.modules = [
            module
            for chunk in self.chunks
            for module in chunk.modules()
            if isinstance(getattr(module, "fp8_meta", None), dict)
        ]
        self._kept: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []
        self._absent: set[tuple[int, str]] = set()

    def _metas(self) -> Iterator[tuple[int, str, Any]]:
        for index, module in enumerate(self.modules):
            for key in self.KEYS:
                yield index, key, module.fp8_meta.get(key)

    @staticmethod
    def _delayed(meta: Any) -> bool:
        """Whether a recipe state carries delayed scaling's scales and amax history (TE's
        DelayedScalingRecipeState; current-scaling and blockwise states have neither)."""
        return hasattr(meta, "scale") and hasattr(meta, "amax_history")

    def keep(self) -> None:
        live, self._absent = [], set()
        for index, key, meta in self._metas():
            if meta is None:
                self._absent.add((index, key))
            elif self._delayed(meta):
                live += [meta.scale, meta.amax_history]
        if [(t.shape, t.dtype, t.device) for t in live] != [(t.shape, t.dtype, t.device) for t in self._kept]:
            self._kept = [torch.empty_like(t) for t in live]
        if live:
            with torch.no_grad():
                torch._foreach_copy_(self._kept, live)
        self._live = live

    def restore(self) -> None:
        with torch.no_grad():
            if self._live:
                torch._foreach_copy_(self._live, self._kept)
            for index, key, meta in self._metas():
                if (index, key) in self._absent and self._delayed(meta):
                    meta.scale.fill_(1.0)
                    meta.amax_history.zero_()


def _resumed_iteration() -> int:
    """The iteration Megatron's training loop resumed from (0: a fresh run, or no Megatron args)."""
    try:
        from megatron.training.global_vars import get_args

        return int(getattr(get_args(), "iteration", 0) or 0)
    except (ImportError, AssertionError, AttributeError):  # no training loop, or its args unset
        return 0


def _say_capacities_are_relearned(managers: list[HybridEPCapacityManager]) -> None:
    """Capacities are not stored in checkpoints: a resumed run learns them again, and says so."""
    iteration = _resumed_iteration()
    if iteration > 0 and any(m.capacity is None for m in managers):
        logger.log(
            once_per_job(logging.INFO),
            "megatron-ext: resumed at iteration %d: the capacity of each of the %d capacity-mode MoE layers is "
            "learned again by one blocking dispatch in this step (capacities are not stored in checkpoints); "
            "the steps are the same as blocking dispatch gives, whatever the capacity.",
            iteration,
            len(managers),
        )


class StepCheck:
    """The capacity-mode layers' device counters, taken at a step's start and read at its end.

    Made at the start: the overflow counts of the layers calibrated by then (one stacked copy: a
    replayed graph adds to the counters themselves) and every layer's rows-used maxima zeroed.
    `read` then reports, for the whole model in one all-reduce over every rank and the step's one
    host read, whether any layer overflowed in the step, whether any used more than half its
    headroom, and each layer's largest rows / capacity. It runs after the backward, while the GPU
    waits for the host behind Megatron's own reads, so it launches a fixed handful of kernels
    whatever the layer count (a launch per layer and counter would each be GPU idle time).
    """

    def __init__(self, managers: list[HybridEPCapacityManager]):
        self.managers = managers
        self.calibrated = [m for m in managers if m.counters is not None]
        self._before = torch.stack([m.overflows for m in self.calibrated]) if self.calibrated else None
        maxima = [t for m in self.calibrated for t in (m.counters.rows_used, m.counters.expert_rows_used)]
        if maxima:
            torch._foreach_zero_(maxima)

    def read(self, layers: int) -> tuple[bool, bool, torch.Tensor]:
        """(overflowed, thin headroom, uses): `uses[l - 1]` is layer l's largest rows / capacity on
        any rank, on the device (0 for the layers no rank has calibrated). `layers`: the model's
        numbered layers, the same on every rank whatever its pipeline stage."""
        now = self.calibrated + [m for m in self.managers if m.counters is not None and m not in self.calibrated]
        # Where the counters are (a group's backend takes its tensors there, as NCCL and gloo take CUDA
        # tensors): copying each to another device first would read the GPU once per layer.
        device = now[0].overflows.device if now else group_device()
        flags = torch.zeros(2 + layers, dtype=torch.float32, device=device)  # [overflowed, thin, use of layer 1, ...]
        if now:
            counts = torch.stack([m.overflows for m in now])
            # The layers calibrated before the step count what it added; one calibrated in it, all it has.
            if self._before is not None:
                counts[: len(self.calibrated)] -= self._before
            rows = torch.stack([m.rows_used for m in now]).to(flags.dtype)
            expert_rows = torch.stack([m.expert_rows_used for m in now]).to(flags.dtype)
            limits = _limits(now, device)
            thin = (rows > limits.rows_threshold) | (expert_rows > limits.expert_rows_threshold)
            flags[:2] = torch.stack([(counts > 0).any(), thin.any()]).to(flags.dtype)
            if limits.numbered is not None:
                flags[2:].index_copy_(0, limits.positions, rows[limits.numbered] * limits.reciprocals)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        overflowed, thin = flags[:2].tolist()
        return bool(overflowed), bool(thin), flags[2:]


class _Limits:
    """What `StepCheck.read` compares the counters with, as device tensors (one per manager, in order):
    the rows and the largest expert's rows above which headroom is thin (inf: none), and for the
    managers with a layer number and a capacity, their indices, positions (layer number - 1) and
    capacities' reciprocals (`capacity_reciprocal`: the uses equal those the dispatches recorded).
    Made once per set of host values and kept: they change with a growth only."""

    def __init__(self, managers: list[HybridEPCapacityManager], device: torch.device):
        def thresholds(of):
            return _host_to_device([float("inf") if t is None else float(t) for t in map(of, managers)], device)

        self.rows_threshold = thresholds(lambda m: m.headroom_threshold())
        self.expert_rows_threshold = thresholds(lambda m: m.budget_headroom_threshold())
        numbered = [i for i, m in enumerate(managers) if m.capacity and m.layer_number is not None]
        self.numbered = self.positions = self.reciprocals = None
        if numbered:
            self.numbered = _host_to_device(numbered, device, torch.int64)
            self.positions = _host_to_device([managers[i].layer_number - 1 for i in numbered], device, torch.int64)
            self.reciprocals = _host_to_device([capacity_reciprocal(managers[i].capacity) for i in numbered], device)


_LIMITS: dict[tuple, _Limits] = {}


def _limits(managers: list[HybridEPCapacityManager], device: torch.device) -> _Limits:
    key = (str(device),) + tuple(
        (id(m), m.layer_number, m.capacity, m.headroom_threshold(), m.budget_headroom_threshold()) for m in managers
    )
    if key not in _LIMITS:
        if len(_LIMITS) > 64:  # capacities that grew leave stale entries behind
            _LIMITS.clear()
        _LIMITS[key] = _Limits(managers, device)
    return _LIMITS[key]


def _host_to_device(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`values` as a tensor on `device`: through pinned memory to a GPU (an unpinned copy would wait
    for the GPU's queue to drain)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class OverflowRerun:
    """Megatron's `forward_backward_func`, re-run blocking when a capacity-mode dispatch overflowed."""

    def __init__(self, forward_backward_func: Any):
        self.forward_backward_func = forward_backward_func
        self.reruns = 0  # steps re-run since this wrapper was made
        self.resizes = 0  # steps after which thin headroom grew capacities
        self._first_step = True
        self._scaling: Optional[DelayedScalingState] = None

    def __getattr__(self, name: str) -> Any:  # what Megatron reads off the function it wrapped
        if name == "forward_backward_func":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.forward_backward_func, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.forward_backward_func, *args, **kwargs)

    def run(
        self, step: Callable, *args: Any, eager: Optional[Callable] = None, graph: Any = None, **kwargs: Any
    ) -> Any:
        """One training step through `step` (the step function, or a graph of it), checked at its end.

        `eager`: the step function to re-run an overflowed step with (default `step`: a re-run must not
        replay a graph captured with non-blocking dispatches). `graph`: Megatron's FullCudaGraphWrapper
        holding `step`, dropped when a capacity grows."""
        global _capacity_metrics
        model = kwargs.get("model")
        policy = None if args or model is None else _policy(model)
        if policy is None:
            return step(*args, **kwargs)
        _capacity_metrics = True
        managers = capacity_managers(model)
        if self._first_step:
            self._first_step = False
            _say_capacities_are_relearned(managers)
        for manager in managers:
            manager.log_metrics = True
        if policy != "rerun":
            return step(**kwargs)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if self._scaling is None or [id(c) for c in self._scaling.chunks] != [id(c) for c in chunks]:
            self._scaling = DelayedScalingState(chunks)
        self._scaling.keep()
        step_input = _replayable(kwargs.get("data_iterator"), kwargs["num_microbatches"])
        kwargs["data_iterator"] = step_input()
        check = StepCheck(managers)
        per_layer_graphs = graph is None and _per_layer_graphs_hold_dispatch(model)
        for manager in managers:
            manager.record_overflow = True
        try:
            result = step(**kwargs)
            overflowed, thin, uses = check.read(numbered_layers(_config(model)))
            _record_largest_use(check.calibrated, uses, kwargs["num_microbatches"])
            if not overflowed:
                if thin:  # grow before an overflow: the layers whose headroom is half used
                    used = [m for m in managers if m.rows_used is not None]
                    grown = [m.grow_capacity(m.rows_used, "headroom half used") for m in used]
                    grown += [
                        m.grow_budget(m.expert_rows_used, "headroom half used")
                        for m in used
                        if m.budget_headroom_threshold() is not None
                    ]
                    grown = any(size is not None for size in grown)
                    self.resizes += 1
                    if grown and graph is not None:
                        drop_graphs(graph)
                    elif grown and per_layer_graphs:
                        drop_per_layer_graphs(chunks, "a capacity or budget grew (headroom half used)")
                return result
            self.reruns += 1
            logger.log(
                once_per_job(logging.WARNING),
                "megatron-ext: a capacity-mode MoE dispatch overflowed in this step; its gradients are "
                "discarded and its micro-batches run again with blocking dispatches (re-run %d).",
                self.reruns,
            )
            if not kwargs.get("forward_only", False):
                _discard_gradients(chunks)
            self._scaling.restore()
            for manager in managers:
                manager.force_blocking, manager.blocking_rows_max = True, 0
                manager.blocking_expert_rows_max = 0
            kwargs["data_iterator"] = step_input()
            blocking_before = [m.stats.blocking_dispatches for m in managers]
            with _eager_under_per_layer_graphs(chunks) if per_layer_graphs else contextlib.nullcontext():
                result = (eager or step)(**kwargs)
            _check_rerun_was_eager(managers, blocking_before)
            for manager in managers:
                manager.grow_capacity(manager.blocking_rows_max, "a re-run after an overflow needed")
                if manager.options.static_expert_splits:
                    manager.grow_budget(manager.blocking_expert_rows_max, "a re-run after an overflow needed")
            if graph is not None:
                drop_graphs(graph)
            return result
        finally:
            for manager in managers:
                manager.record_overflow, manager.force_blocking = False, False


def _record_largest_use(managers: list[HybridEPCapacityManager], uses: torch.Tensor, num_microbatches: int) -> None:
    """Each of this rank's layers calibrated before the step records the step's largest rows /
    capacity on any rank (`uses`, on the device: no read; its pipeline stage's layers only:
    Megatron's report sums the stages') into Megatron's `CAPACITY_USE_MAX_METRIC`, scaled by the
    micro-batch count, which Megatron's report divides by. One launch for the whole model: the
    metric's values plus `uses` times a mask holding the count at this rank's layers, 0 elsewhere."""
    numbers = tuple(
        m.layer_number
        for m in managers
        if m.log_metrics and m.capacity and m.layer_number is not None and m.layer_number <= uses.numel()
    )
    if not numbers:
        return
    values = megatron_metric_values(CAPACITY_USE_MAX_METRIC, uses.device, uses.numel())
    key = (str(uses.device), uses.numel(), numbers, num_microbatches)
    scale = _USE_SCALES.get(key)
    if scale is None:
        if len(_USE_SCALES) > 64:  # capacities that grew leave stale entries behind
            _USE_SCALES.clear()
        host = [0.0] * uses.numel()
        for number in numbers:
            host[number - 1] = float(num_microbatches)
        scale = _USE_SCALES[key] = _host_to_device(host, uses.device)
    values.addcmul_(uses, scale)


_USE_SCALES: dict[tuple, torch.Tensor] = {}


def _check_rerun_was_eager(managers: list[HybridEPCapacityManager], blocking_before: list[int]) -> None:
    """Stop, loudly, if some layer ran no blocking dispatch in a re-run: a CUDA graph replayed it
    at the capacity that overflowed, and its step would train on truncated tokens."""
    pairs = zip(managers, blocking_before, strict=True)
    replayed = [m.name for m, before in pairs if m.stats.blocking_dispatches == before]
    if replayed:
        raise RuntimeError(
            f"megatron-ext: the re-run of an overflowed step ran no blocking dispatch in {', '.join(replayed)}: "
            "a CUDA graph replayed it at the capacity that overflowed, so this step would train on truncated "
            "tokens and is stopped. Graph settings that hold the dispatch with the re-run policy are "
            "--cuda-graph-impl full_iteration and local; with others use --moe-hybridep-overflow-policy fail."
        )


def drop_graphs(graph: Any) -> None:
    """Drop the graphs of Megatron's FullCudaGraphWrapper `graph` (captured at capacities that no
    longer hold) and have the step after next capture them again: the next step runs eagerly, at
    the new capacities, so that the kernels for their sizes are compiled outside a capture."""
    graph.reset_cuda_graph()
    if getattr(graph, "use_single_mempool", False):
        _forget_shared_graph_pool()
    for stage in type(graph).curr_iteration:
        type(graph).curr_iteration[stage] = max(graph.cuda_graph_warmup_steps - 1, 0)
    logger.log(
        once_per_job(logging.WARNING),
        "megatron-ext: a capacity grew: the full-iteration CUDA graphs are dropped, the next step runs eagerly "
        "and the one after it is captured again.",
    )


def _forget_shared_graph_pool() -> None:
    """Have the next capture of Megatron's full-iteration graph take a new memory pool. With
    `--cuda-graph-use-single-mempool` (Megatron's default) every capture names one pool handle for
    the whole process, and PyTorch's allocator keeps a pool whose graphs are all deleted as dead:
    a capture that names it again stops at an internal assert (`use_count > 0`). The dropped
    graph's memory goes back to the device here, before the capture that replaces it."""
    from megatron.core import full_cuda_graph

    full_cuda_graph._shared_graph_pool = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_iteration_graph(wrapper_class: type) -> type:
    """Megatron's `FullCudaGraphWrapper`, made so that megatron-ext's overflow policy runs outside
    the graph: Megatron's training loop builds it around the step function, which is our
    `OverflowRerun` once `megatron_ext.patches` is applied; the graph then wraps the plain step
    function and the policy wraps the graph."""

    class FullIterationGraph(wrapper_class):
        def __init__(self, forward_backward_func: Any, *args: Any, **kwargs: Any):
            self.overflow_rerun = forward_backward_func if isinstance(forward_backward_func, OverflowRerun) else None
            if self.overflow_rerun is not None:
                forward_backward_func = self.overflow_rerun.forward_backward_func
            super().__init__(forward_backward_func, *args, **kwargs)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if self.overflow_rerun is None:
                return super().__call__(*args, **kwargs)
            graphed = super().__call__
            return self.overflow_rerun.run(graphed, *args, eager=self.forward_backward_func, graph=self, **kwargs)

    FullIterationGraph.__name__ = FullIterationGraph.__qualname__ = wrapper_class.__name__
    FullIterationGraph.__module__ = __name__
    return FullIterationGraph
