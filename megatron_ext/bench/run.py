"""One rank's work: build the same MoE stack in every mode, check it, count it, time it.

Per mode, in this order (the same inputs and weights in every mode):
0. `+graph` modes (GPU only): two eager steps on the first two inputs (capacity mode's blocking
   calibration, then the non-blocking path), then one whole step captured in a CUDA graph
   (`megatron_ext.bench.graphed.GraphedStep`); every step below is then a replay of it;
1. `check_steps` forward+backward steps (the first one calibrates capacity mode); outputs, input
   gradients and every parameter gradient are compared with the blocking mode's;
2. `warmup` steps;
3. one step under `count_host_syncs()` and `count_collectives()`: host syncs, all-reduces and
   bytes sent per step and per forward dispatch;
4. `steps` timed steps (CUDA events on a GPU, the host clock on CPU): step time, host time of
   each forward dispatch, peak memory above the step's start (GPU), routing-map bytes allocated;
5. on a GPU, one more step under torch.profiler: the time the GPU was busy in it (kernels, copies,
   memsets), to set against the step time;
6. on a GPU, `runahead_probe()`: does the host enqueue a step while the GPU sleeps?

With `repeat` > 1 all of this runs `repeat` times, mode after mode in table order, so drift in the
machine's speed spreads over every mode instead of landing on one; each round's median is kept.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_ext.bench.counters import DispatchTimer, busy_ms, count_collectives, gpu_operations
from megatron_ext.bench.graphed import GraphedStep
from megatron_ext.bench.modes import BLOCKING, REFERENCES, Mode, skip_reason
from megatron_ext.bench.report import worst_by_tensor
from megatron_ext.bench.sizes import Sizes
from megatron_ext.bench.stack import (
    MoEStack,
    forward_backward,
    grads_by_name,
    load_weights,
    make_inputs,
    megatron_config,
    te_import_error,
)


@dataclass
class ModeResult:
    """One mode on one rank. None: not measured for this mode or on this device."""

    name: str
    status: str = "ok"  # 'ok' | 'skipped' | 'differs' | 'failed'
    detail: str = ""
    equality: str = ""  # 'bitwise' | 'close' | 'differs' (against blocking)
    max_rel_error: float = 0.0
    worst_error_at: str = ""  # where max_rel_error is: 'step N, TENSOR' (empty: bitwise or not checked)
    step_rel_errors: list[float] = field(default_factory=list)  # per checked step, the worst tensor's
    tensor_rel_errors: dict[str, float] = field(default_factory=dict)  # per tensor not bitwise, its worst step's
    step_ms: list[float] = field(default_factory=list)  # every timed step of every round
    round_step_ms: list[float] = field(default_factory=list)  # each round's median
    host_step_ms: list[float] = field(default_factory=list)
    dispatch_host_ms: list[float] = field(default_factory=list)
    host_syncs_per_step: Optional[int] = None
    sync_examples: list[str] = field(default_factory=list)
    all_reduces_per_step: Optional[int] = None
    bytes_sent_per_step: Optional[int] = None
    bytes_sent_per_dispatch: Optional[float] = None
    routing_map_bytes_allocated_per_step: Optional[float] = None
    routing_map_bytes_sent_per_dispatch: Optional[float] = None  # what a rank's map gathers send other ranks
    peak_step_memory_bytes: Optional[int] = None
    forward_memory_bytes: Optional[int] = None  # held at the end of the forward (saved for the backward)
    blocking_dispatches_per_step: Optional[float] = None
    non_blocking_dispatches_per_step: Optional[float] = None
    capacities: list[int] = field(default_factory=list)
    rows_used: list[int] = field(default_factory=list)  # per capacity-mode layer: most rows a dispatch filled
    overflows: Optional[int] = None
    reruns: Optional[int] = None  # overflow_rerun modes: steps re-run blocking after an overflow
    resizes: Optional[int] = None  # overflow_rerun modes: steps after which thin headroom grew capacities
    runahead: Optional[dict] = None  # the first round's probe
    ran_ahead_rounds: list[bool] = field(default_factory=list)
    dispatches_ahead_rounds: list[Optional[int]] = field(default_factory=list)  # None: not seen (a graph replay)
    gpu_busy_ms: Optional[float] = None  # GPU: time a kernel, copy or memset ran in one profiled step (lowest round)

    def to_dict(self) -> dict:
        return asdict(self)

    def merge(self, later: ModeResult) -> None:
        """Fold a later round of the same mode into this one (the worst status and error win)."""
        order = ("ok", "skipped", "differs", "failed")
        if order.index(later.status) > order.index(self.status):
            self.status, self.detail, self.equality = later.status, later.detail, later.equality
        if later.max_rel_error > self.max_rel_error:
            self.max_rel_error, self.worst_error_at = later.max_rel_error, later.worst_error_at
        if later.step_rel_errors:  # a later round checks against the first (bitwise), and keeps none
            ours = self.step_rel_errors or [0.0] * len(later.step_rel_errors)
            self.step_rel_errors = [max(a, b) for a, b in zip(ours, later.step_rel_errors, strict=True)]
        self.tensor_rel_errors = worst_by_tensor([self.tensor_rel_errors, later.tensor_rel_errors])
        for name in (
            "step_ms",
            "round_step_ms",
            "host_step_ms",
            "dispatch_host_ms",
            "ran_ahead_rounds",
            "dispatches_ahead_rounds",
        ):
            getattr(self, name).extend(getattr(later, name))
        for name in ("peak_step_memory_bytes", "forward_memory_bytes"):
            if getattr(later, name) is not None:
                setattr(self, name, max(getattr(self, name) or 0, getattr(later, name)))
        if later.rows_used:
            self.rows_used = [max(a, b) for a, b in zip(self.rows_used, later.rows_used)] or later.rows_used
        for name in ("overflows", "reruns", "resizes"):
            if getattr(later, name) is not None:
                setattr(self, name, (getattr(self, name) or 0) + getattr(later, name))
        if later.gpu_busy_ms is not None:  # the round least disturbed (by the other ranks' waits, say)
            self.gpu_busy_ms = min(later.gpu_busy_ms, self.gpu_busy_ms or later.gpu_busy_ms)


# How far a mode that sums in another order may be from blocking: ||a - b|| / ||b||.
CLOSE_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
# How far fp8 experts may be from bf16 ones (e4m3 keeps 3 mantissa bits), and from each other.
FP8_TOLERANCE = 1e-1


def tolerance(mode: Mode, dtype: str) -> float:
    return FP8_TOLERANCE if mode.fp8_recipe is not None else CLOSE_TOLERANCE[dtype]


class _Runner:
    def __init__(self, sizes: Sizes, rank: int, world_size: int, device: torch.device, progress: Callable):
        self.sizes, self.rank, self.world_size, self.device = sizes, rank, world_size, device
        self.progress = progress
        self.inputs = make_inputs(sizes, rank, sizes.steps_per_mode, device)
        shape = self.inputs[0].shape
        self.loss_weights = torch.linspace(-1.0, 1.0, shape.numel(), device=device).view(shape)
        self.weights: Optional[dict] = None  # the first stack's state, loaded into every other
        self.references: dict[str, list] = {}  # the check results of the modes in REFERENCES
        self.expert_load: Optional[float] = None
        self.recovery = None  # an OverflowRerun around `_megatron_step`, for modes with `overflow_rerun`
        self.graphed: Optional[GraphedStep] = None  # for `graph` modes, once captured
        self._after_forward: Callable[[], None] = lambda: None
        self._stepped: Any = None

    # ------------------------------------------------------------- one step

    def step(self, stack, x, after_forward: Callable[[], None] = lambda: None):
        """One forward+backward on `x`: (output, input gradient); the parameters' gradients on `stack`.

        A graph mode's step is a replay (no `after_forward`: a replay has no point between its
        forward and backward that the host sees)."""
        if self.graphed is not None:
            return self.graphed(x)
        if self.recovery is None:
            return self._step(stack, x, after_forward)
        self._after_forward = after_forward
        self.recovery(model=stack, data_iterator=iter([x]), num_microbatches=1, forward_only=False)
        return self._stepped

    def _megatron_step(self, *, model, data_iterator, num_microbatches, forward_only=False, **_):
        """What the recovery wraps: Megatron's forward_backward_func, one micro-batch here."""
        for _ in range(num_microbatches):
            self._stepped = self._step(model, next(data_iterator), self._after_forward)
        return []

    def _step(self, stack, x, after_forward: Callable[[], None]):
        """`--micro-batches` forward+backward passes on `x`, gradients accumulated (`after_forward`
        after the first forward); the last output and the accumulated input gradient."""
        x = x.detach().requires_grad_(True)
        stack.zero_grad(set_to_none=True)
        out = forward_backward(stack, x, self.loss_weights, self.sizes.micro_batches, after_forward)
        return out, x.grad

    def snapshot(self, stack, out, grad) -> dict[str, torch.Tensor]:
        """The step's output, input gradient and every parameter gradient, by name."""
        tensors = {"output": out, "input gradient": grad}
        tensors.update((f"gradient of {name}", g) for name, g in sorted(grads_by_name(stack).items()))
        # Kept on the device: at the large size a copy to the host and a compare there took longer
        # than the mode's steps (12.9 GB of gradients per snapshot).
        return {name: t.detach().clone() for name, t in tensors.items()}

    # ------------------------------------------------------------- one mode

    def run(self, mode: Mode) -> ModeResult:
        result = ModeResult(mode.name)
        config = megatron_config(self.sizes, self.world_size, self.device, mode)
        torch.manual_seed(self.sizes.seed)  # the same router on every rank, and the same run every time
        stack = MoEStack(config, self.sizes.layers, mode.experts).to(self.device)
        if self.weights is None:
            self.weights = {k: v.detach().clone() for k, v in stack.state_dict().items()}
        else:
            load_weights(stack, self.weights)
        managers = _our_managers(stack)
        timer = DispatchTimer(stack.layers)
        inputs = iter(self.inputs)
        if mode.overflow_rerun:
            from megatron_ext.training.recovery import OverflowRerun

            self.recovery = OverflowRerun(self._megatron_step)
        try:
            if mode.graph and not self._capture(stack, result):
                return result
            self._check(stack, mode, result, inputs)
            for _ in range(self.sizes.warmup):
                self.step(stack, next(inputs))
                self.progress()
            self._count(stack, timer, managers, result, next(inputs))
            self._time(stack, timer, managers, result, inputs)
            if self.device.type == "cuda":
                result.gpu_busy_ms = busy_ms(gpu_operations(functools.partial(self.step, stack, self.inputs[-1])))
                result.runahead = _runahead(
                    functools.partial(self.step, stack, self.inputs[-1]),
                    self.sizes.runahead_sleep_ms,
                    timer,
                    self.sizes.layers,
                    dispatches_seen=self.graphed is None,
                )
                result.ran_ahead_rounds = [result.runahead["ran_ahead"]]
                result.dispatches_ahead_rounds = [result.runahead["dispatches_ahead"]]
            if any(m.capacity is not None for m in managers):
                result.overflows = _overflows(managers)
                result.capacities = [m.capacity for m in managers if m.capacity is not None]
                result.rows_used = [int(m.rows_used) for m in managers if m.rows_used is not None]
            if self.recovery is not None:
                result.reruns, result.resizes = self.recovery.reruns, self.recovery.resizes
        finally:
            self.recovery = None
            self.graphed = None  # the graph, then (with the stack's gradients) its memory pool
            del stack, timer, managers
            _release()
        return result

    def _capture(self, stack, result) -> bool:
        """A graph mode's start: two eager steps, then the capture. False, with the mode marked
        failed, when a capture raised on any rank (then every rank drops the mode together)."""
        for x in self.inputs[:2]:  # not taken from the mode's inputs: the checks start at the first
            self._step(stack, x, lambda: None)
        error = None
        try:
            self.graphed = GraphedStep(stack, self.inputs[0], self.loss_weights, self.sizes.micro_batches)
        except Exception as exc:  # a capture launches no collective: the other ranks meet this rank below
            traceback.print_exc()
            error = _describe(exc)
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error)
        failed = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
        if failed is None:
            return True
        self.graphed = None
        result.status, result.equality = "failed", ""
        result.detail = f"CUDA graph capture failed on rank {failed[0]}: {failed[1]}"
        for _ in range(self.sizes.steps_per_mode):
            self.progress()
        return False

    def _check(self, stack, mode, result, inputs) -> None:
        snapshots = []
        for index in range(self.sizes.check_steps):
            out, grad = self.step(stack, next(inputs))
            try:
                snapshots.append(self.snapshot(stack, out, grad))
            except torch.OutOfMemoryError as exc:
                raise torch.OutOfMemoryError(
                    f"out of device memory keeping checked step {index + 1} of {self.sizes.check_steps} (its output "
                    f"and every gradient stay on the device until the mode's check): lower --check-steps or the "
                    f"stack (--layers). {exc}"
                ) from exc
            if mode.name == BLOCKING and self.expert_load is None:
                self.expert_load = _expert_load(stack)
            self.progress()
        if mode.name in REFERENCES and mode.name in self.references:  # a later round
            if not _compare(self.references[mode.name], snapshots).bitwise:
                result.status, result.equality = "differs", "differs"
                result.detail = f"{mode.name} is not deterministic on rank {self.rank}: a later round differs"
            else:
                result.equality = "bitwise"  # as in its first round, where it was checked
            return
        if mode.name == BLOCKING:
            self.references[mode.name] = snapshots
            result.equality = "bitwise"
            return
        if mode.reference not in self.references:
            result.status, result.equality = "differs", "differs"
            result.detail = f"no results of {mode.reference}, which this mode is checked against (it did not run)"
            return
        compared = _compare(self.references[mode.reference], snapshots)
        if mode.name in REFERENCES:
            self.references[mode.name] = snapshots
        result.max_rel_error, result.worst_error_at = compared.worst, compared.worst_at
        result.step_rel_errors = compared.per_step
        result.tensor_rel_errors = compared.per_tensor
        error = compared.worst
        limit = tolerance(mode, self.sizes.dtype)
        if compared.bitwise:
            result.equality = "bitwise"
        elif mode.equality == "close" and error <= limit:
            result.equality = "close"
        else:
            result.equality = "differs"
            result.status = "differs"
            expected = "bitwise" if mode.equality == "bitwise" else f"within {limit:g}"
            result.detail = (
                f"outputs/gradients differ from {mode.reference} on rank {self.rank}: relative error {error:.3g} "
                f"({compared.worst_at}), expected {expected}"
            )

    def _count(self, stack, timer, managers, result, x) -> None:
        from megatron_ext.tooling.sync import count_host_syncs

        stats_before = _dispatch_counts(managers)
        with count_collectives() as collectives, count_host_syncs() as syncs:
            timer.collectives = collectives
            self.step(stack, x)
            timer.collectives = None
        result.host_syncs_per_step = syncs.count
        result.sync_examples = sorted({e.what for e in syncs.events})[:5]
        self.progress()
        if self.graphed is not None:
            # A replay runs no Python: what is counted at Python calls (collectives, bytes,
            # dispatches) is not seen, so it stays None; host syncs cannot happen in a replay.
            return
        result.all_reduces_per_step = collectives.all_reduces
        result.bytes_sent_per_step = collectives.bytes_sent
        if timer.dispatch_bytes:
            result.bytes_sent_per_dispatch = statistics.fmean(timer.dispatch_bytes)
        after = _dispatch_counts(managers)
        if stats_before is not None:
            result.blocking_dispatches_per_step = after[0] - stats_before[0]
            result.non_blocking_dispatches_per_step = after[1] - stats_before[1]

    def _time(self, stack, timer, managers, result, inputs) -> None:
        cuda = self.device.type == "cuda"
        graphed = self.graphed is not None
        gathers_before = _gather_totals(managers)
        events = []
        peaks, forward_held = [], []
        timer.enabled = True
        for _ in range(self.sizes.steps):
            x = next(inputs)
            after_forward = lambda: None  # noqa: E731
            if cuda and not graphed:
                # Memory is measured from a start without the last step's gradients (the step
                # frees them first anyway), so the peak counts activations, new gradients and
                # transients, not the old gradients' release. (Not in a graph mode: its gradients
                # are the graph's own tensors, which every replay overwrites.)
                stack.zero_grad(set_to_none=True)
                torch.cuda.reset_peak_memory_stats()
                resting = torch.cuda.memory_allocated()

                def after_forward(resting=resting):
                    forward_held.append(torch.cuda.memory_allocated() - resting)

            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            host_start = time.perf_counter()
            self.step(stack, x, after_forward)
            result.host_step_ms.append((time.perf_counter() - host_start) * 1e3)
            if cuda:
                end.record()
                events.append((start, end))
                if not graphed:
                    peaks.append(torch.cuda.max_memory_allocated() - resting)
            self.progress()
        timer.enabled = False
        if cuda:
            torch.cuda.synchronize()
            result.step_ms = [s.elapsed_time(e) for s, e in events]
            if graphed:  # a replay allocates nothing: what the step needs is what the capture took
                result.peak_step_memory_bytes = self.graphed.capture_peak_bytes
            else:
                result.peak_step_memory_bytes = max(peaks)
                result.forward_memory_bytes = max(forward_held)
        else:
            result.step_ms = list(result.host_step_ms)
        result.round_step_ms = [statistics.median(result.step_ms)]
        result.dispatch_host_ms = timer.samples_ms
        gathers_after = _gather_totals(managers)
        if gathers_before is not None and gathers_after is not None and not graphed:  # counted in Python
            allocated, sent, gathers = (after - before for after, before in zip(gathers_after, gathers_before))
            result.routing_map_bytes_allocated_per_step = allocated / self.sizes.steps
            result.routing_map_bytes_sent_per_dispatch = sent / gathers if gathers else None


def _our_managers(stack) -> list:
    from megatron_ext.dispatcher import HybridEPCapacityManager

    managers = [getattr(layer.token_dispatcher, "capacity_manager", None) for layer in stack.layers]
    return [m for m in managers if isinstance(m, HybridEPCapacityManager)]


def _overflows(managers) -> int:
    """Non-blocking dispatches that overflowed, over these layers (one host read)."""
    counts = [m.overflows for m in managers if m.overflows is not None]
    return int(torch.stack(counts).sum()) if counts else 0


def _dispatch_counts(managers) -> Optional[tuple[int, int]]:
    if not managers:
        return None
    return (
        sum(m.stats.blocking_dispatches for m in managers),
        sum(m.stats.non_blocking_dispatches for m in managers),
    )


def _gather_totals(managers) -> Optional[tuple[int, int, int]]:
    """(bytes allocated, bytes sent to other ranks, gathers) so far of the routing-map gathers of
    the buffers these managers dispatched through."""
    buffers = {id(m.last_buffer): m.last_buffer for m in managers if m.last_buffer is not None}
    gathers = [getattr(b, "routing_map_gather", None) for b in buffers.values()]
    if not gathers or any(g is None for g in gathers):
        return None  # Megatron's own dispatch, or deep_ep's buffer: not counted here
    stats = [g.stats for g in gathers]
    return sum(s.bytes_allocated for s in stats), sum(s.bytes_sent for s in stats), sum(s.gathers for s in stats)


def _expert_load(stack) -> Optional[float]:
    """max / mean tokens per expert in the first layer's latest dispatch, over the EP group."""
    managers = _our_managers(stack)
    if not managers or managers[0].tokens_per_expert is None:
        return None
    local = managers[0].tokens_per_expert.to(torch.float64)
    world = dist.get_world_size(managers[0].group)
    everyone = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(everyone, local.contiguous(), group=managers[0].group)
    return float(everyone.max() / everyone.mean().clamp_min(1e-9))


@dataclass
class Comparison:
    """One mode's checked steps against its reference's: `worst` is the largest ||a - b|| / ||b||
    over every step and tensor, `worst_at` where it is ('step N, TENSOR'; empty when bitwise),
    `per_step` each step's largest, `per_tensor` each tensor's largest (tensors that differ only)."""

    bitwise: bool
    worst: float
    worst_at: str
    per_step: list[float]
    per_tensor: dict[str, float] = field(default_factory=dict)


def _compare(reference: list[dict], actual: list[dict]) -> Comparison:
    """Step by step and tensor by tensor (by name: the two stacks may build their experts apart)."""
    bitwise, worst, worst_at, per_step, per_tensor = True, 0.0, "", [], {}
    for step, (ref_step, act_step) in enumerate(zip(reference, actual, strict=True), start=1):
        step_worst = 0.0
        if ref_step.keys() != act_step.keys():
            unmatched = sorted(ref_step.keys() ^ act_step.keys())
            return Comparison(False, float("inf"), f"step {step}, tensors in one run only: {unmatched[:3]}", per_step)
        for name, ref in ref_step.items():
            act = act_step[name]
            if ref.shape != act.shape:
                where = f"step {step}, {name}: shape {tuple(act.shape)} against {tuple(ref.shape)}"
                return Comparison(False, float("inf"), where, per_step)
            if torch.equal(ref, act):
                continue
            bitwise = False
            diff = (act.float() - ref.float()).norm()  # float32: enough for a relative error, half double's memory
            error = float(diff / ref.float().norm().clamp_min(1e-30))
            step_worst = max(step_worst, error)
            per_tensor[name] = max(per_tensor.get(name, 0.0), error)
            if error > worst:
                worst, worst_at = error, f"step {step}, {name}"
        per_step.append(step_worst)
    return Comparison(bitwise, worst, worst_at, per_step, per_tensor)


def _runahead(step, sleep_ms: float, timer, layers: int, dispatches_seen: bool = True) -> dict:
    """The probe's verdict on a whole step, and how many of the step's forward dispatches the host
    got past while the GPU slept (a step of more kernels than CUDA's launch queue holds stops the
    host however free of syncs it is; a blocking dispatch stops it at the first layer). Without
    `dispatches_seen` (a graph replay calls no dispatch in Python) that count is None."""
    from megatron_ext.tooling.sync import runahead_probe

    probe = runahead_probe(step, sleep_ms=sleep_ms)
    returned = [t for t in timer.returned_at if t >= probe.behind_started][:layers]
    woke = probe.behind_started + probe.gpu_sleep_ms / 1e3
    return dict(
        host_idle_ms=probe.host_idle_ms,
        host_behind_sleep_ms=probe.host_behind_sleep_ms,
        gpu_sleep_ms=probe.gpu_sleep_ms,
        ran_ahead=not probe.waited,
        dispatches_ahead=sum(t < woke for t in returned) if dispatches_seen else None,
        dispatches=layers,
    )


def _describe(exc: BaseException) -> str:
    """`exc` on one line; a capture that failed inside `torch.cuda.graph` raises again as it ends
    (the capture was invalidated), and the first error is the one that says why."""

    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

    first = exc.__context__
    if first is not None and not exc.__suppress_context__:
        return f"{line(first)} (then, ending the capture: {line(exc)})"
    return line(exc)


def _release() -> None:
    from megatron_ext.hybridep.buffers import release_buffers
    from megatron_ext.hybridep.torch_buffer.allgather import release_shared_routing_map_buffers

    release_buffers()
    release_shared_routing_map_buffers()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def unavailable(modes: tuple[Mode, ...], sizes: Any, world_size: int, *, cuda: bool, gloo: bool) -> dict[str, str]:
    """The modes of `modes` that cannot run here, each with why (`skip_reason`); `sizes`: the stack's
    (a `Sizes` or the parsed arguments). What it asks of deep_ep and TE is asked only for modes that need them."""
    from megatron_ext.options import deep_ep_import_error, deep_ep_shape_error
    from megatron_ext.patches._moe_layer import te_expert_count_error

    deep_ep_error = te_error = fuser_error = None
    if any(m.needs_deep_ep for m in modes):
        missing = deep_ep_import_error()
        deep_ep_error = f"deep_ep does not import: {missing}" if missing else deep_ep_shape_error(sizes.hidden)
    if any(m.needs_te for m in modes):
        te_error = te_import_error()
        # TE's op-fuser experts run one grouped GEMM over a rank's experts, which has a limit.
        fuser_error = te_expert_count_error(
            SimpleNamespace(num_moe_experts=sizes.experts, expert_model_parallel_size=world_size)
        )
    reasons = {
        m.name: skip_reason(
            m, cuda=cuda, gloo=gloo, deep_ep_error=deep_ep_error, te_error=te_error, fuser_error=fuser_error
        )
        for m in modes
    }
    return {name: why for name, why in reasons.items() if why is not None}


def run_modes(
    sizes: Sizes,
    modes: tuple[Mode, ...],
    device: torch.device,
    progress: Callable[[], None] = lambda: None,
    starting: Callable[[str], None] = lambda name: None,
) -> tuple[list[ModeResult], dict[str, Any]]:
    """Run every mode on this rank (all ranks call this together). Returns the results and facts.

    `progress()` is called after every step, `starting(name)` before each mode.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    runner = _Runner(sizes, rank, world_size, device, progress)
    cannot = unavailable(
        modes, sizes, world_size, cuda=device.type == "cuda", gloo=world_size > 1 and dist.get_backend() != "nccl"
    )
    results: dict[str, ModeResult] = {}
    for _ in range(sizes.repeat):
        for mode in sorted(modes, key=lambda m: REFERENCES.index(m.name) if m.name in REFERENCES else len(REFERENCES)):
            starting(mode.name)
            why = cannot.get(mode.name)
            if why is not None:
                results[mode.name] = ModeResult(mode.name, status="skipped", detail=why)
                for _ in range(sizes.steps_per_mode):
                    progress()
                continue
            result = runner.run(mode)
            if mode.name in results:
                results[mode.name].merge(result)
            else:
                results[mode.name] = result
    return list(results.values()), dict(expert_load_max_over_mean=runner.expert_load)
