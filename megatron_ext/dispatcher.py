"""The HybridEP flex dispatcher with capacity mode, equal token counts and routing-map reuse.

`HybridEPTokenDispatcher` is what Megatron's `MoELayer` builds for `--moe-token-dispatcher-type
flex` once `megatron_ext.patches.apply()` has run. With none of megatron-ext's options set and
deep_ep installed it is Megatron's own `MoEFlexTokenDispatcher`, unchanged. Otherwise its
`HybridEPCapacityManager` drives a HybridEP buffer (deep_ep's or megatron-ext's PyTorch one):

* Token counts. Megatron's default passes each rank's count through (HybridEP needs them equal);
  `--moe-hybridep-pad-uneven-dispatch-inputs` pads to the EP-group maximum, an all-reduce and a
  host read per dispatch. `--moe-hybridep-equal-token-counts` pads to the local count aligned to
  64: no collective, no host read; `--moe-hybridep-verify-equal-token-counts` adds a device-side
  check of that declaration (one small all-reduce, no host read).
* Capacity mode (`--moe-hybridep-capacity-factor f`). The first dispatch of each layer is blocking
  and learns its rows (the padded row count it produced); the layer's capacity becomes
  `capacity_from_rows(EP-group max of rows, f)`, read on the host once. Every later dispatch is
  non-blocking at that capacity and asserts on the device that nothing overflowed
  (`torch._assert_async`), so a too-small capacity fails the step instead of training on
  truncated tokens. Combine gets the dispatch's host-known capacity (after a blocking dispatch,
  its rows), so its backward dispatch is non-blocking too, even after the blocking calibration.
* Recompute. A forward that ran without grad (Megatron's activation checkpointing) is replayed in
  the backward; if it was the calibration dispatch, the replay is blocking again, so the
  recomputed layer has the rows the forward had.
* CUDA graphs. After calibration a capacity-mode dispatch with equal token counts is capturable:
  what a replay must update (the rows used, the overflow count) lives in `DeviceCounters`,
  allocated at calibration and written in place, and no tensor with autograd history outlives the
  step that made it (one kept across steps ties the captured backward to the eager step's stream).
  A graph freezes the capacity and the non-blocking branch: anything that changes them (growth, a
  blocking re-run) happens outside the graph, and whoever captured it must drop it then
  (`megatron_ext.training.recovery` does for Megatron's graphs). Host work attempted under capture (a
  blocking dispatch, calibration, growth, the uneven-count pad) raises `GraphCaptureError`.

What a layer decides (sizing and growth, which dispatch blocks, the overflow check, its counters and
metrics) is `megatron_ext.capacity.policy.CapacityPolicy`, which the manager inherits; this module
is the mechanics: token counts, buffers, the calls into them, and the dispatcher Megatron builds.

Names: a layer's `capacity` is the host int its non-blocking dispatches are sized to (DeepEP's
`num_permuted_tokens`, used only in calls into a buffer); `rows` are the rows a dispatch really
produced (padded per expert), at most its capacity.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher, MoETokenDispatcher

from megatron_ext import fused
from megatron_ext.capacity import budget as budgets
from megatron_ext.capacity import equal_count_padding
from megatron_ext.capacity.policy import (  # noqa: F401 - the names other modules import from here
    CAPACITY_USE_MAX_METRIC,
    CAPACITY_USE_METRIC,
    DEVICE_MESSAGE_LIMIT,
    CapacityPolicy,
    DeviceCounters,
    GraphCaptureError,
    capturing,
    device_message,
    group_device,
    in_backward,
    numbered_layers,
)
from megatron_ext.hybridep import autograd, fp8
from megatron_ext.hybridep.buffers import get_buffer
from megatron_ext.hybridep.deep_ep_buffer import DeepEPTuning, tuning_flags_set
from megatron_ext.hybridep.protocol import Handle, HybridEPBuffer
from megatron_ext.logs import once_per_group
from megatron_ext.options import (
    AUTO,
    KERNEL_CACHE_FLAG,
    HybridEPConfigError,
    HybridEPOptions,
    deep_ep_import_error,
    flag,
    requested_implementation,
    resolve_implementation,
    validate,
)

logger = logging.getLogger(__name__)


# HybridEP's kernels work on 64-token chunks; Megatron pads uneven inputs to this too.
TOKEN_ALIGNMENT = 64

_layer_counter = itertools.count()


@dataclass
class DispatchStats:
    """What one layer's manager did, for tests and the bench."""

    blocking_dispatches: int = 0
    non_blocking_dispatches: int = 0
    calibrations: int = 0
    token_count_all_reduces: int = 0
    capacities: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class InFlight:
    """What a combine needs from its dispatch."""

    buffer: HybridEPBuffer
    handle: Handle
    # The dispatch's output rows, a host int: the layer's capacity, or after a blocking dispatch
    # its rows. Combine's backward dispatches non-blocking with it as its capacity.
    capacity: int
    num_tokens: int  # this rank's tokens before padding
    # With static expert splits, a non-blocking dispatch's map to and from the budget layout.
    budget_map: Optional[budgets.BudgetMap] = None


def megatron_graph_warmup() -> bool:
    """Whether Megatron is running a graphed module eagerly on stand-in inputs before capturing it:
    its per-layer graphs' warm-up (inputs of zeros) or Transformer Engine's capture helper (inputs
    of ones). Every token of such an input routes alike, so with expert parallelism a few ranks
    receive more rows than any real step sends them; the results are discarded."""
    if capturing():  # the capture itself: what it records must check for overflows
        return False
    try:
        from megatron.core.transformer import cuda_graphs
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return False
    return cuda_graphs.is_graph_warmup() or cuda_graphs.is_graph_capturing()


def expert_pad_multiple(config: Any) -> Optional[int]:
    """The multiple each local expert's rows are padded to, as Megatron's own HybridEP manager pads
    them, or None. megatron-core 0.19 pads in fp8 and fp4 only; the 0.20 line pads whenever its
    experts ask for an alignment (also TE's op fuser and grouped tensors in bf16: 256 rows). The
    0.20 rule comes with its `moe_use_grouped_tensor` option, which tells the two apart."""
    align = get_align_size_for_quantization(config)
    if hasattr(config, "moe_use_grouped_tensor"):
        return align or None
    return align if (config.fp8 or config.fp4) else None


class HybridEPCapacityManager(CapacityPolicy):
    """Dispatch policy for one MoE layer, with Megatron's `_DispatchManager` interface.

    Args:
        group: the TP x EP process group the layer's tokens travel in.
        num_local_experts: experts on this rank (L). num_experts: L x group size.
        config: the layer's TransformerConfig. options: megatron-ext's validated options.
        implementation: 'torch' or 'deep_ep', the buffer to drive.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_local_experts: int,
        num_experts: int,
        config: Any,
        options: HybridEPOptions,
        implementation: str,
    ):
        self.group = group
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts
        self.config = config
        self.options = options
        self.implementation = implementation
        # --moe-hybridep-compact-routing: the most experts a row of the dispatch's map holds (Megatron
        # repeats each token's top-k over the TP ranks of the TP x EP group), or None.
        self.compact_routing_topk = (
            config.moe_router_topk * (num_experts // config.num_moe_experts) if options.compact_routing else None
        )
        self.deep_ep_tuning = DeepEPTuning.from_config(config)
        self._default_name = f"MoE layer #{next(_layer_counter)}"
        self._layer: Optional[weakref.ref] = None  # the MoELayer, bound by the MoELayer patch
        self.pad_multiple = expert_pad_multiple(config)
        # --moe-hybridep-fp8-dispatch: the combine's backward dispatches the gradients in fp8 too, in
        # the format TE's recipe quantizes them in (the forward's tokens go in e4m3).
        self.grad_fp8 = fp8.gradient_dtype(config.fp8) if options.fp8_dispatch else None
        self.capacity: Optional[int] = None
        self.local_calibration_rows: Optional[int] = None  # this rank's rows in the calibration dispatch
        self.calibrated_rows: Optional[int] = None  # their EP-group maximum
        self.stats = DispatchStats()
        # Made at calibration; the bench reports them, the recovery's step-end check reads them.
        self.counters: Optional[DeviceCounters] = None
        self._recompute_blocking = 0  # no-grad calibration forwards still to be replayed blocking
        # Set by megatron_ext.training.recovery around a training step (--moe-hybridep-overflow-policy rerun):
        # an overflow is only counted in `overflows` instead of stopping on the device, and a re-run
        # dispatches blocking, keeping its largest row count.
        self.record_overflow = False
        self.force_blocking = False
        self.blocking_rows_max = 0
        # Static expert splits: each local expert's row budget (EP-group max, set at calibration),
        # the counts handed to the experts ([budget] * L, on the host), and a re-run's largest expert.
        self.expert_budget: Optional[int] = None
        self.calibrated_expert_rows: Optional[int] = None  # the budget's rows before the factor (EP-group max)
        self._budget_counts: Optional[torch.Tensor] = None
        self.blocking_expert_rows_max = 0
        # Set by megatron_ext.training.recovery in Megatron's training loop: each forward dispatch records
        # its rows / capacity in Megatron's MoE metrics (a device add, no read).
        self.log_metrics = False
        self._inflight: Optional[InFlight] = None
        # The overflow assert's message and what it was made for (layer number, capacity, budget).
        self._overflow_message_for: Optional[tuple] = None
        self._overflow_message_text = ""
        self._num_tokens = 0  # this rank's tokens in the current dispatch, before padding
        # The buffer of the latest dispatch (its statistics: tests, the bench).
        self.last_buffer: Optional[HybridEPBuffer] = None
        self.routing_map: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self.dispatched_probs: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    # ----------------------------------------------------------- identity and device state

    def bind_layer(self, layer: Any) -> None:
        """Name this manager after `layer`, its MoELayer (held weakly). Megatron numbers a MoELayer
        after building it (TransformerLayer calls `set_layer_number`), so the number is read when used."""
        self._layer = weakref.ref(layer)

    @property
    def layer_number(self) -> Optional[int]:
        """Megatron's number of this manager's MoE layer (1-based), None when unbound or unnumbered."""
        layer = self._layer() if self._layer is not None else None
        return getattr(layer, "layer_number", None)

    @property
    def name(self) -> str:
        number = self.layer_number
        return self._default_name if number is None else f"MoE layer {number}"

    # ----------------------------------------------------------- token counts

    def _dispatch_tokens(self, num_tokens: int, device: torch.device) -> int:
        """How many tokens this rank hands HybridEP (the same on every rank)."""
        if self.options.equal_token_counts:
            if self.options.verify_equal_token_counts:
                self._verify_equal_counts(num_tokens, device)
            return equal_count_padding(num_tokens, TOKEN_ALIGNMENT)
        if self.config.moe_hybridep_pad_uneven_dispatch_inputs:
            self._refuse_under_capture("--moe-hybridep-pad-uneven-dispatch-inputs (an all-reduce and a host read)")
            largest = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
            self.stats.token_count_all_reduces += 1
            return equal_count_padding(int(largest.item()), TOKEN_ALIGNMENT)
        return num_tokens

    def _verify_equal_counts(self, num_tokens: int, device: torch.device) -> None:
        # max(n) and max(-n) in one all-reduce; every rank computes the same verdict. Built with
        # kernels only: writing a host int into a CUDA tensor (`t[1] = -n`) waits for the GPU.
        signs = 1 - 2 * torch.arange(2, dtype=torch.int64, device=device)
        extremes = signs * num_tokens
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        self.stats.token_count_all_reduces += 1
        torch._assert_async(
            extremes[0] + extremes[1] == 0,
            device_message(
                f"megatron-ext: {self.name}: EP ranks hold different token counts (here {num_tokens}) despite "
                f"{flag('moe_hybridep_equal_token_counts')}; feed equal batches, or replace it (and the verify flag) "
                "with --moe-hybridep-pad-uneven-dispatch-inputs."
            ),
        )

    def _buffer(self, hidden_dim: int, num_tokens: int) -> HybridEPBuffer:
        """The shared buffer this layer dispatches `num_tokens` tokens of `hidden_dim` with."""
        return get_buffer(
            self.implementation,
            self.group,
            hidden_dim=hidden_dim,
            num_tokens=num_tokens,
            num_local_experts=self.num_local_experts,
            reuse_allgather_buffer=self.options.reuse_allgather_buffer,
            transport=self.options.transport,
            deep_ep_tuning=self.deep_ep_tuning,
            compact_routing_topk=self.compact_routing_topk,
            kernel_cache=self.options.kernel_cache,
        )

    # ----------------------------------------------------------- warm-up

    def _warm_up_tokens(self, num_tokens: int) -> int:
        """The tokens a dispatch of `num_tokens` (the same on every rank) hands HybridEP."""
        if self.options.equal_token_counts or self.config.moe_hybridep_pad_uneven_dispatch_inputs:
            return equal_count_padding(num_tokens, TOKEN_ALIGNMENT)
        return num_tokens

    def warm_up(self, num_tokens: int, device: torch.device, warmed: set) -> bool:
        """Build this layer's buffer and run its kernels once, forward and backward, on made-up
        tokens of training's shape (`num_tokens` per rank, the hidden size and dtype of the config):
        deep_ep compiles its dispatch and combine kernels on their first use, and Triton its
        kernels, so a step that follows starts with both ready. Collective over the layer's group:
        every rank of it calls this with the same `num_tokens`. In capacity mode the torch
        implementation runs a non-blocking dispatch too (its own kernels), sized to the blocking
        one's rows; deep_ep's non-blocking kernels are compiled per capacity, which only the
        calibration decides, so a warm-up at another one would compile for nothing. Nothing of the
        layer's state changes: no calibration, no counter, no statistic. `warmed` holds what earlier
        layers warmed (their shared buffer, tokens, pad multiple and passes): a layer that would run
        the same kernels on the same buffer skips, and False says so."""
        padded = self._warm_up_tokens(num_tokens)
        buffer = self._buffer(self.config.hidden_size, padded)
        non_blocking = self.options.capacity_factor is not None and self.implementation == "torch"
        key = (buffer, padded, self.pad_multiple, non_blocking)
        if key in warmed:
            return False
        warmed.add(key)
        # Token t picks experts t*k .. t*k + k-1 (mod E): every expert gets rows, on every rank alike.
        topk = self.config.moe_router_topk
        picks = (
            torch.arange(padded, device=device)[:, None] * topk + torch.arange(topk, device=device)
        ) % self.num_experts
        routing_map = torch.zeros(padded, self.num_experts, dtype=torch.bool, device=device).scatter_(1, picks, True)
        probs = routing_map.float() / topk
        tokens = torch.zeros(padded, self.config.hidden_size, dtype=self.config.params_dtype, device=device)
        tokens.requires_grad_(True)
        capacity: Optional[int] = None
        for _ in range(2 if non_blocking else 1):
            rows, _, _, handle = autograd.dispatch(
                buffer,
                tokens,
                routing_map,
                probs,
                num_local_experts=self.num_local_experts,
                num_permuted_tokens=capacity,
                pad_multiple=self.pad_multiple,
                in_fp8=self.options.fp8_dispatch,  # deep_ep compiles other kernels for 1-byte rows
            )
            capacity = capacity or rows.shape[0]  # a blocking dispatch's rows are known on the host
            combined = autograd.combine(
                buffer,
                rows,
                handle,
                num_permuted_tokens=capacity,
                pad_multiple=self.pad_multiple,
                grad_fp8=self.grad_fp8,
            )
            combined.float().sum().backward()
        return True

    # ----------------------------------------------------------- Megatron's manager interface

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """Take the layer's `[T, E]` routing map and probs; pad them to the dispatch count."""
        num_tokens = routing_map.shape[0]
        routing_map = routing_map.reshape(num_tokens, self.num_experts)
        probs = probs.reshape(num_tokens, self.num_experts).float()  # HybridEP takes float32 probs
        padded = self._dispatch_tokens(num_tokens, routing_map.device)
        if padded > num_tokens:
            routing_map = torch.nn.functional.pad(routing_map, (0, 0, 0, padded - num_tokens), value=False)
            probs = torch.nn.functional.pad(probs, (0, 0, 0, padded - num_tokens))
        self.routing_map, self.token_probs = routing_map, probs
        self._num_tokens = num_tokens

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """Dispatch `[T, H]` tokens; returns `[capacity, H]` rows grouped by local expert (`[rows, H]`
        for a blocking dispatch)."""
        padded = self.routing_map.shape[0]
        if padded > hidden_states.shape[0]:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, padded - hidden_states.shape[0]))
        buffer = self._buffer(hidden_states.shape[1], padded)
        self.last_buffer = buffer
        capacity = self._dispatch_capacity()
        if capacity is None:
            self._refuse_under_capture("a blocking dispatch (the calibration, a re-run after an overflow)")
        dispatched, self.dispatched_probs, self.tokens_per_expert, handle = autograd.dispatch(
            buffer,
            hidden_states,
            self.routing_map,
            self.token_probs,
            num_local_experts=self.num_local_experts,
            num_permuted_tokens=capacity,
            pad_multiple=self.pad_multiple,
            in_fp8=self.options.fp8_dispatch,
        )
        # Consumed: kept past the step, the probs would keep their autograd history (the router's) alive.
        self.token_probs = None
        fused.forget_offsets(self.tokens_per_expert)  # a non-blocking dispatch's bookkeeping makes them anew
        budget_map = None
        if capacity is None:
            self.stats.blocking_dispatches += 1
            rows = dispatched.shape[0]  # known on the host once a blocking dispatch returns
            self.blocking_rows_max = max(self.blocking_rows_max, rows)
            if self.options.static_expert_splits:  # a blocking dispatch has synchronised: one more read is free
                largest = int(self.tokens_per_expert.max()) if self.tokens_per_expert.numel() else 0
                self.blocking_expert_rows_max = max(self.blocking_expert_rows_max, largest)
            if self.capacity is not None and self.log_metrics:  # a re-run: rows against the capacity outgrown
                self._record_capacity_use(torch.full((), rows, dtype=torch.float32, device=dispatched.device))
            if self.options.capacity_factor is not None and self.capacity is None:
                self._calibrate(rows, dispatched.device)
                if self.options.static_expert_splits:
                    self.grow_budget(self.blocking_expert_rows_max, "calibrated")
            capacity = rows  # combine's backward dispatches exactly these rows, non-blocking
        else:
            self.stats.non_blocking_dispatches += 1
            # Under Megatron's graph warm-up the tokens are stand-ins and the results discarded: their
            # overflow is none of training's and their rows say nothing of the headroom. The capture
            # that follows records the checks for every replay.
            if self.options.static_expert_splits:
                budget_map = budgets.budget_map(self.tokens_per_expert, capacity, self._expert_budget())
            if not megatron_graph_warmup():
                counters = self._device_counters(dispatched.device)
                self._record_dispatch(handle, self.tokens_per_expert, counters, budget_map)
        self._inflight = InFlight(buffer, handle, capacity, self._num_tokens, budget_map)
        return dispatched

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """Return `[capacity, H]` expert outputs to their tokens: `[T, H]`."""
        inflight, self._inflight = self._inflight, None
        # The experts have taken them (Megatron reads them between dispatch and combine); dropped so
        # that no autograd history outlives the step.
        self.dispatched_probs = None
        if inflight.budget_map is not None:
            hidden_states = budgets.from_budget(hidden_states, inflight.budget_map)
        tokens = autograd.combine(
            inflight.buffer,
            hidden_states,
            inflight.handle,
            num_permuted_tokens=inflight.capacity,
            pad_multiple=self.pad_multiple,
            grad_fp8=self.grad_fp8,
        )
        return tokens[: inflight.num_tokens]

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        plan = None if self._inflight is None else self._inflight.budget_map
        if plan is None:
            return hidden_states, self.dispatched_probs
        probs = None if self.dispatched_probs is None else budgets.to_budget(self.dispatched_probs, plan)
        return budgets.to_budget(hidden_states, plan), probs

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states  # static expert splits: `combine` maps the budget layout back

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """The experts' counts: on the device, or with static expert splits after a non-blocking
        dispatch the budgets, a CPU tensor (host constants: an expert that splits by them reads nothing)."""
        if self._inflight is not None and self._inflight.budget_map is not None:
            return self._budget_counts
        return self.tokens_per_expert


# One verdict per process group: `auto` is resolved the same for every layer of a process.
_AGREED: dict[Any, str] = {}


def agreed_implementation(options: HybridEPOptions, hidden_size: Optional[int], group: Optional[Any]) -> str:
    """`options.implementation` resolved on this rank; for `auto` with a group of several ranks,
    checked to be the same on every rank (one object all-gather per group and process). A rank whose
    deep_ep does not import (a node without it, a driver error at import) would build the torch
    buffer while the others build deep_ep's, and the two would wait in different collectives:
    every rank raises instead, naming the ranks and why."""
    requested = requested_implementation(options)
    implementation = resolve_implementation(requested, hidden_size, options.fp8_dispatch)
    if requested != AUTO or group is None or dist.get_world_size(group) == 1:
        return implementation
    key = (group, hidden_size, options.fp8_dispatch)
    if key in _AGREED:
        return _AGREED[key]
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (implementation, deep_ep_import_error()), group=group)
    picked = {v[0] for v in verdicts}
    if len(picked) > 1:
        by_rank = "; ".join(
            f"rank {rank}: {chosen}" + (f" ({why})" if chosen == "torch" and why else "")
            for rank, (chosen, why) in enumerate(verdicts)
        )
        raise HybridEPConfigError(
            f"{flag('moe_hybridep_implementation')} auto picked different buffers on the ranks of one "
            f"expert-parallel group ({by_rank}); they would wait in different collectives. Make deep_ep "
            f"import on every node, or pass {flag('moe_hybridep_implementation')} torch."
        )
    _AGREED[key] = implementation
    return implementation


def layer_implementation(config: Any, options: HybridEPOptions, group: Optional[Any]) -> str:
    """The HybridEP implementation a flex dispatcher on `config` uses: agreed across `group` for the
    hybridep backend only. The other backends build no HybridEP buffer, so what `auto` resolves to
    there is never used and ranks need not gather it (nor be refused over it)."""
    hybridep = getattr(config, "moe_flex_dispatcher_backend", None) == "hybridep"
    return agreed_implementation(options, config.hidden_size, group if hybridep else None)


def dispatch_managers(model: Any) -> list[HybridEPCapacityManager]:
    """megatron-ext's dispatch managers of `model` (a module or Megatron's list of chunks), blocking
    or capacity mode, in module order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            manager = getattr(getattr(module, "token_dispatcher", None), "capacity_manager", None)
            if isinstance(manager, HybridEPCapacityManager):
                found.append(manager)
    return found


class HybridEPTokenDispatcher(MoEFlexTokenDispatcher):
    """Megatron's flex dispatcher, with megatron-ext's manager for the hybridep backend.

    Megatron's own manager is kept when the backend is not hybridep, or when no megatron-ext
    option changes the dispatch and deep_ep is installed (stock behaviour, exactly). Otherwise,
    including hybridep without deep_ep, `HybridEPCapacityManager` drives the buffer.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Optional[Any] = None,
    ):
        options = HybridEPOptions.from_config(config)
        implementation = layer_implementation(config, options, getattr(pg_collection, "tp_ep", None))
        self.uses_megatron_ext = config.moe_flex_dispatcher_backend == "hybridep" and (
            options.changes_dispatch or implementation == "torch"
        )
        if not self.uses_megatron_ext:
            super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
            return
        options = validate(config)
        # MoEFlexTokenDispatcher.__init__ would build Megatron's HybridEP manager, which needs
        # deep_ep and a GPU; set up what it sets, with our manager instead.
        MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self._comm_manager = HybridEPCapacityManager(
            group=self.tp_ep_group,
            num_local_experts=num_local_experts,
            num_experts=self.tp_size * config.num_moe_experts,
            config=config,
            options=options,
            implementation=implementation,
        )
        self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.routing_map"]
        tuning = tuning_flags_set(config) + ([KERNEL_CACHE_FLAG] if options.kernel_cache is not None else [])
        if tuning and implementation == "torch":
            logger.log(
                once_per_group(logging.INFO, self.tp_ep_group),
                "megatron-ext: %s apply to deep_ep's kernels; the torch implementation's have no such setting, "
                "so they have no effect here.",
                " and ".join(tuning),
            )

    @property
    def capacity_manager(self) -> HybridEPCapacityManager:
        """megatron-ext's dispatch manager of this layer (Megatron names it `_comm_manager`)."""
        return self._comm_manager

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Megatron's preprocessing, run eagerly for our manager (it holds collectives to compile around)."""
        if not self.uses_megatron_ext:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        routing_map, probs = self._initialize_metadata(routing_map, probs)
        self._comm_manager.setup_metadata(routing_map, probs)
        return hidden_states, self._comm_manager.token_probs
