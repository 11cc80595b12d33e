"""Capacity mode's policy: what a layer decides, apart from how it moves tokens.

`CapacityPolicy` is the part of a layer's dispatch manager (`megatron_ext.dispatcher.
HybridEPCapacityManager`, which inherits it and does the mechanics: buffers, token counts, the
dispatch and combine calls) that decides:

* sizing: the calibration that learns a layer's rows from its first (blocking) dispatch and sizes
  its capacity to the EP group's maximum x the factor; each local expert's budget with static
  expert splits; their growth (after an overflow's re-run, or when half the headroom is used);
* which dispatch runs blocking (`_dispatch_capacity`);
* the overflow check of every non-blocking dispatch, on the device, and the device counters it
  writes in place (`DeviceCounters`), which `megatron_ext.training.recovery` reads once a step;
* the capacity-use metrics it records in Megatron's MoE logging.

It reads the manager's `group`, `options`, `config`, `pad_multiple`, `stats`, `name` and
`layer_number`, and the state the manager's `__init__` sets (`capacity`, `calibrated_rows`,
`counters`, `expert_budget`, ...). Host reads happen in sizing alone: once per layer at calibration,
and in a growth, between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_ext import fused
from megatron_ext.capacity import budget as budgets
from megatron_ext.capacity import budget_from_rows, capacity_from_rows, capacity_reciprocal, half_headroom
from megatron_ext.capacity.host_constant import host_constant
from megatron_ext.hybridep import overflow_flag
from megatron_ext.hybridep.protocol import Handle
from megatron_ext.logs import once_per_group
from megatron_ext.options import flag

logger = logging.getLogger("megatron_ext.dispatcher")  # the name users filter the layers' lines by


def group_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where `group`'s collectives take their tensors: this rank's GPU on NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch's CUDA `_assert_async` refuses messages of 255 characters or more.
DEVICE_MESSAGE_LIMIT = 255


@dataclass(frozen=True)
class DeviceCounters:
    """What a layer's non-blocking dispatches record on the device: int64 scalars, allocated once at
    calibration (before any CUDA graph capture) and only ever written in place, so a replayed graph
    updates the very tensors the overflow policy, the metrics and the bench read. Never read here."""

    # The most rows a non-blocking dispatch filled since the counters were made or last reset
    # (in place, by megatron_ext.training.recovery's `StepCheck` at the start of a step); 0: none filled.
    rows_used: torch.Tensor
    # Non-blocking dispatches that overflowed since the layer was built (only grows).
    overflows: torch.Tensor
    # With static expert splits: the most rows one local expert received, as `rows_used`.
    expert_rows_used: torch.Tensor
    # [1] bool: whether the last non-blocking dispatch did not overflow (what the assert reads).
    not_overflowed: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device) -> DeviceCounters:
        counts = (torch.zeros((), dtype=torch.int64, device=device) for _ in range(3))
        return cls(*counts, torch.ones(1, dtype=torch.bool, device=device))


class GraphCaptureError(RuntimeError):
    """Capacity mode was asked, during a CUDA graph capture, for work that reads the host."""


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The names of megatron-ext's per-layer metrics in Megatron's MoE logging (console, TensorBoard,
# W&B): rows / capacity of each forward dispatch, averaged over micro-batches and ranks; and the
# largest rows / capacity a step reached on any rank, which shows the rank nearest an overflow.
CAPACITY_USE_METRIC = "hybridep_capacity_use"
CAPACITY_USE_MAX_METRIC = "hybridep_capacity_use_max"


def numbered_layers(config: Any) -> int:
    """The model's transformer layers (with multi-token prediction's), as Megatron's MoE metrics
    number them: the same on every rank, a pipeline stage with no MoE layer too."""
    return config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)


def megatron_metric_values(name: str, device: torch.device, num_layers: int) -> torch.Tensor:
    """The per-layer values of Megatron's MoE metric `name` (one float32 per numbered layer, on
    `device`), for a kernel to add into in place. A missing entry is made by Megatron's own `record`
    (adding 0 to layer 1); an entry that does not fit is refused, naming it."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get(name)
    if entry is None:
        tracker.record(name, torch.zeros((), device=device), 1, num_layers)
        entry = tracker.metrics[name]
    values = entry.values
    if not (
        values.dtype == torch.float32
        and values.device == device
        and values.is_contiguous()
        and values.numel() == num_layers
    ):
        raise RuntimeError(
            f"megatron-ext: Megatron's MoE metric {name!r} holds {values.dtype} {tuple(values.shape)} on "
            f"{values.device}; expected float32 values of its {num_layers} layers on {device}. Leave this "
            "metric's name to megatron-ext."
        )
    return values


def device_message(text: str) -> str:
    """`text` cut to what a CUDA device-side assert carries (fewer than 255 characters)."""
    return text if len(text) < DEVICE_MESSAGE_LIMIT else text[: DEVICE_MESSAGE_LIMIT - 4] + "..."


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint recompute is)."""
    return torch._C._current_autograd_node() is not None


@dataclass(frozen=True)
class Sized:
    """What a layer sizes from the rows it has seen: the policy attribute holding the size, the one
    holding those rows (EP-group max, before the factor), the sizing rule, its name in a refusal
    under capture, and the log line of a growth (its level; the old and new size, why, the rows)."""

    size: str
    rows: str
    size_of: Callable[[int, float, Optional[int]], int]
    what: str
    level: int
    message: str


CAPACITY = Sized(
    "capacity",
    "calibrated_rows",
    capacity_from_rows,
    "growing the capacity",
    logging.WARNING,
    "capacity %s -> %d (%s: %d rows, EP-group max, x %s).",
)
EXPERT_BUDGET = Sized(
    "expert_budget",
    "calibrated_expert_rows",
    budget_from_rows,
    "sizing the expert budgets",
    logging.INFO,
    "expert budget %s -> %d rows each (%s: largest expert %d rows, EP-group max, x %s).",
)


class CapacityPolicy:
    """Sizing, growth, the overflow check and the metrics of one capacity-mode layer (see the module)."""

    @property
    def rows_used(self) -> Optional[torch.Tensor]:
        """`counters.rows_used` (None before calibration)."""
        return None if self.counters is None else self.counters.rows_used

    @property
    def overflows(self) -> Optional[torch.Tensor]:
        """`counters.overflows` (None before calibration)."""
        return None if self.counters is None else self.counters.overflows

    @property
    def expert_rows_used(self) -> Optional[torch.Tensor]:
        """`counters.expert_rows_used` (None before calibration)."""
        return None if self.counters is None else self.counters.expert_rows_used

    def _refuse_under_capture(self, what: str) -> None:
        if not capturing():
            return
        if self.options.capacity_factor is None:
            fix = (
                f"set {flag('moe_hybridep_capacity_factor')} and {flag('moe_hybridep_equal_token_counts')} "
                "(capacity mode reads nothing on the host after its calibration)"
            )
        else:
            fix = (
                "capture only after the layer has calibrated in an eager step (Megatron: --cuda-graph-warmup-steps "
                ">= 1), and re-run or grow capacities outside the graph (megatron-ext's overflow policy does)"
            )
        raise GraphCaptureError(
            f"megatron-ext: {self.name}: {what} reads the host, which a CUDA graph capture cannot do; {fix}."
        )

    # ----------------------------------------------------------- static expert splits

    def _expert_budget(self) -> int:
        if self.expert_budget is None:  # a capacity set by hand, no calibration: no expert can exceed it
            self.grow_budget(self.capacity, "no calibration: the capacity")
        return self.expert_budget

    def grow_budget(self, largest_rows: int, why: str) -> Optional[int]:
        """Size each local expert's budget to the EP-group max of `largest_rows` (the largest expert's
        rows) x the factor, aligned, if that is more than it has; return the new budget or None. One
        all-reduce and one host read: between steps, or in a blocking dispatch, only. A CUDA graph
        captured with the old budget must be dropped after (megatron_ext.training.recovery does)."""
        budget = self._grow(EXPERT_BUDGET, largest_rows, why)
        if budget is not None:
            self._budget_counts = host_constant(torch.full((self.num_local_experts,), budget, dtype=torch.int64))
        return budget

    def budget_headroom_threshold(self) -> Optional[int]:
        """Rows of one expert above which the budgets' headroom is thin (half of the room above the
        calibrated rows used up); None without static expert splits or before their calibration."""
        if self.expert_budget is None or self.calibrated_expert_rows is None:
            return None
        return half_headroom(self.calibrated_expert_rows, self.expert_budget)

    # ----------------------------------------------------------- capacity mode

    def _dispatch_capacity(self) -> Optional[int]:
        """The capacity to dispatch non-blocking with, or None for a blocking dispatch."""
        if self.capacity is None or self.force_blocking:
            return None
        if self._recompute_blocking and in_backward():
            self._recompute_blocking -= 1  # replaying the calibration forward: blocking, as it was
            return None
        return self.capacity

    def _device_counters(self, device: torch.device) -> DeviceCounters:
        if self.counters is None:  # made at calibration; here for a capacity set by hand
            self._refuse_under_capture("allocating the layer's device counters")
            self.counters = DeviceCounters.zeros(device)
        return self.counters

    def _calibrate(self, rows: int, device: torch.device) -> None:
        self.counters = self.counters or DeviceCounters.zeros(device)
        self.local_calibration_rows = rows
        self.calibrated_rows = self._group_max(rows)  # the one host read of capacity mode, per layer
        self.capacity = capacity_from_rows(self.calibrated_rows, self.options.capacity_factor, self.pad_multiple)
        self.stats.calibrations += 1
        self.stats.capacities.append(self.capacity)
        if not torch.is_grad_enabled() and not in_backward():
            self._recompute_blocking += 1
        logger.log(
            once_per_group(logging.INFO, self.group),
            "megatron-ext: %s: calibrated %d rows (EP-group max %d) x %s -> capacity %d.",
            self.name,
            rows,
            self.calibrated_rows,
            self.options.capacity_factor,
            self.capacity,
        )

    def _record_dispatch(
        self,
        handle: Handle,
        tokens_per_expert: torch.Tensor,
        counters: DeviceCounters,
        budget_map: Optional[budgets.BudgetMap] = None,
    ) -> None:
        """What a non-blocking dispatch leaves on the device: its overflow counted (and, with the
        fail policy, asserted), its rows into `rows_used` (with budgets, its largest expert's into
        `expert_rows_used`), its rows / capacity into Megatron's metric. Where the fused kernels run
        (`fused.enabled_for`), one launch and the assert, which also makes the experts' offsets (kept
        on `tokens_per_expert`, `fused.attach_offsets`); elsewhere torch's ops, with equal results."""
        if not fused.enabled_for(tokens_per_expert) or not tokens_per_expert.is_contiguous():
            self._assert_no_overflow(handle, counters, budget_map)
            rows = tokens_per_expert.sum()  # the rows it produced, on the device (never read)
            torch.maximum(counters.rows_used, rows, out=counters.rows_used)
            if budget_map is not None:
                largest = tokens_per_expert.max().to(torch.int64)
                torch.maximum(counters.expert_rows_used, largest, out=counters.expert_rows_used)
            self._record_capacity_use(rows)
            return
        metric = self._capacity_use_values(tokens_per_expert.device)
        offsets = fused.record_dispatch(
            overflow_flag(handle),
            tokens_per_expert,
            counters.overflows,
            counters.rows_used,
            counters.not_overflowed,
            budget_flag=None if budget_map is None else budget_map.overflow,
            expert_rows_used=None if budget_map is None else counters.expert_rows_used,
            metric=metric,
            metric_index=0 if metric is None else self.layer_number - 1,
            reciprocal=capacity_reciprocal(self.capacity),
            offsets_limit=None if budget_map is not None else self.capacity,  # budgets: the experts get others
        )
        if offsets is not None:
            fused.attach_offsets(tokens_per_expert, self.capacity, offsets)
        if not self.record_overflow:
            torch._assert_async(counters.not_overflowed, self._overflow_message(budget_map is not None))

    def _capacity_use_values(self, device: torch.device) -> Optional[torch.Tensor]:
        """Megatron's per-layer values of `CAPACITY_USE_METRIC` for the fused bookkeeping to add this
        layer's use into (what `record` would add to), or None when no use is recorded. The entry is
        made by Megatron's own `record` the first time (adding 0): `megatron_metric_values`."""
        if not self.log_metrics or self.layer_number is None or in_backward():  # a recompute replay: counted once
            return None
        return megatron_metric_values(CAPACITY_USE_METRIC, device, numbered_layers(self.config))

    def _record_capacity_use(self, rows: torch.Tensor) -> None:
        """Rows / capacity of this forward dispatch (`capacity_reciprocal`'s product) into Megatron's
        MoE metrics (`CAPACITY_USE_METRIC`, logged per iteration as the mean over micro-batches and
        MoE layers)."""
        if not self.log_metrics or self.layer_number is None or in_backward():  # a recompute replay: counted once
            return
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().record(
            CAPACITY_USE_METRIC,
            rows * capacity_reciprocal(self.capacity),  # float32, like rows.float() x it, in one launch
            self.layer_number,
            numbered_layers(self.config),
        )

    def headroom_threshold(self) -> Optional[int]:
        """Rows above which the layer's headroom is thin: half of the padding above the calibrated
        rows used up. None before calibration."""
        if self.capacity is None or self.calibrated_rows is None:
            return None
        return half_headroom(self.calibrated_rows, self.capacity)

    def grow_capacity(self, local_rows: int | torch.Tensor, why: str) -> Optional[int]:
        """Size the capacity to the EP-group maximum of `local_rows` x the factor if that is more
        than it has; return the new capacity, or None when it stays. One all-reduce and one host
        read: call it between steps only (`megatron_ext.training.recovery` does). A CUDA graph captured with
        the old capacity must be dropped after a growth (it would dispatch at the old one)."""
        capacity = self._grow(CAPACITY, local_rows, why)
        if capacity is not None:
            self.stats.calibrations += 1
            self.stats.capacities.append(capacity)
        return capacity

    def _grow(self, sized: Sized, local_rows: int | torch.Tensor, why: str) -> Optional[int]:
        """Size `sized` to the EP group's maximum of `local_rows` x the factor if that exceeds its size
        now; return the new size, or None when it stays. One all-reduce and one host read, refused
        under capture."""
        self._refuse_under_capture(f"{sized.what} (an all-reduce and a host read)")
        rows = self._group_max(local_rows)
        current = getattr(self, sized.size)
        size = sized.size_of(rows, self.options.capacity_factor, self.pad_multiple)
        if current is not None and size <= current:
            # Rounding kept the size: count the rows as learned, so that the headroom check does not
            # come back to this layer every step.
            setattr(self, sized.rows, max(getattr(self, sized.rows) or 0, rows))
            return None
        logger.log(
            once_per_group(sized.level, self.group),
            "megatron-ext: %s: " + sized.message,
            self.name,
            current,
            size,
            why,
            rows,
            self.options.capacity_factor,
        )
        setattr(self, sized.size, size)
        setattr(self, sized.rows, rows)
        return size

    def _group_max(self, local_rows: int | torch.Tensor) -> int:
        """The EP group's maximum of `local_rows` (a host int or a device scalar): one all-reduce
        and one host read."""
        device = group_device(self.group)
        if isinstance(local_rows, torch.Tensor):
            largest = local_rows.reshape(1).to(device=device, dtype=torch.int64).clone()
        else:  # made on the device: no copy from host memory
            largest = torch.full((1,), local_rows, dtype=torch.int64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        return int(largest.item())

    def _assert_no_overflow(
        self, handle: Handle, counters: DeviceCounters, budget_map: Optional[budgets.BudgetMap] = None
    ) -> None:
        overflow = overflow_flag(handle)
        if budget_map is not None:  # an expert over its budget is an overflow too
            overflow = torch.maximum(overflow.to(torch.int32), budget_map.overflow)
        counters.overflows.add_(overflow.reshape(()))  # int64 += the flag's int32 or bool: one launch, no cast
        if self.record_overflow:
            return
        # The one-element flag as it is (indexing it would cost the host a view).
        torch._assert_async(overflow.eq(0), self._overflow_message(budget_map is not None))

    def _overflow_message(self, with_budget: bool) -> str:
        """The device assert's message of an overflow, made once per layer, capacity and budget."""
        # By the layer number, not the name: `name` formats a string on every read.
        key = (self.layer_number, self.capacity, self.expert_budget if with_budget else None)
        if self._overflow_message_for != key:
            budget = f" or an expert its budget of {self.expert_budget}" if with_budget else ""
            # The fixes first after the facts: the device's limit cuts what comes after 254 characters.
            self._overflow_message_text = device_message(
                f"megatron-ext: {self.name}: dispatch overflowed its capacity of {self.capacity} rows{budget}; "
                f"stopped, not trained on truncated tokens. Raise {flag('moe_hybridep_capacity_factor')} "
                f"({self.options.capacity_factor}) or use {flag('moe_hybridep_overflow_policy')} rerun."
            )
            self._overflow_message_for = key
        return self._overflow_message_text
