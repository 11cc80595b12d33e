"""The expert computation and its checkpoints.

Here: `GroupedMLP`. Beside it: its checkpoint layouts (`checkpoint.py`) and its activation
recomputed in the backward (`activation_recompute.py`).

MoE experts for capacity-mode dispatch: two grouped GEMMs, no host synchronisation.

`GroupedMLP` takes the place of Megatron's `TEGroupedMLP` (`MoESubmodules(experts=GroupedMLP)`)
when the dispatcher hands over a fixed number of rows P (a capacity) of which only the first
n = sum(tokens_per_expert) are real. The counts stay on the device: the expert boundaries go to
torch's grouped GEMM as device offsets, which stops at n by itself.

Two paths compute the same function:
* fused (CUDA, bfloat16, no bias, SiLU or GELU with or without GLU, no clamp or offset): the two
  grouped GEMMs around one Triton kernel for activation x probs (`megatron_ext.fused`), each way.
  Every piece stops at n, read on the device, so padding rows cost no work; the backward keeps
  only the input rows and the fc1 output and recomputes the activation.
* torch (everything else, and CPU ranks): the rows past n are masked to zero with `where`,
  forward and backward, and the activation is ordinary autograd.
Capacity mode on a GPU needs bfloat16 experts: for other dtypes torch's grouped GEMM copies the
offsets to the host, so such a layer is refused when it is built.

With `--recompute-granularity selective --recompute-modules moe_act` (as TEGroupedMLP honours it)
the torch path frees the activation's output once fc2 has read it and recomputes it in the
backward (`megatron_ext.experts.activation_recompute`), so only the fc1 output and the probs stay saved
for it (the fused path always does so).

Parameters live as one stacked tensor per linear ([L, out, in]), so the GEMMs read them without a
per-step copy; their checkpoints read like `TEGroupedMLP`'s and `SequentialMLP`'s
(`megatron_ext.experts.checkpoint`, which reads `GroupedMLP` and `_ExpertLinear` as its
`StackedExperts` and `StackedLinear` protocols, so it imports nothing from here).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from megatron_ext import fused
from megatron_ext.experts import checkpoint as experts_checkpoint
from megatron_ext.experts import main_grad
from megatron_ext.experts.activation_recompute import ActivationRecompute
from megatron_ext.options import CAPACITY_FACTOR_FLAG, GROUPED_MLP_WAYS_AROUND


def _refusal(flag: str, problem: str, fix: str, *, capacity_mode: bool = True) -> ValueError:
    # Capacity mode puts these experts in the layer in place of the ones the spec named (logged at
    # INFO only), so the message says so and names the ways around them too; without it, a layer
    # spec named them (as the example's local spec does for --moe-grouped-gemm).
    if capacity_mode:
        return ValueError(
            f"megatron_ext GroupedMLP, the experts {CAPACITY_FACTOR_FLAG} builds here, does not support "
            f"{problem} (`{flag}`); {fix}. Or {GROUPED_MLP_WAYS_AROUND}."
        )
    return ValueError(
        f"megatron_ext GroupedMLP, the experts this layer spec names, does not support {problem} (`{flag}`); "
        f"{fix}. Or build other experts (Megatron's SequentialMLP or TEGroupedMLP)."
    )


def _sync_refusal(dtype: torch.dtype) -> ValueError:
    # torch's grouped GEMM has a CUDA kernel for bfloat16 alone; for other dtypes it loops over the
    # experts with the offsets copied to the host, a synchronisation in every expert call.
    return _refusal(
        CAPACITY_FACTOR_FLAG,
        f"{dtype} experts on a GPU in capacity mode: torch's grouped GEMM reads the expert counts on the "
        "host for any dtype but bfloat16, which would stall every step",
        "train with --bf16",
    )


class _FusedExperts(torch.autograd.Function):
    """fc1 -> activation x probs -> fc2 over device offsets, touching only the first n rows.

    n = offsets[-1], read by the kernels on the device. The grouped GEMMs stop at it by
    construction; the activation runs in one Triton kernel each way. Saved for the backward: the
    input rows (the dispatch's own tensor, not a copy), the fc1 output and the probs; the
    activation's output is recomputed in the backward (one cheap pass), so a capacity of C rows
    keeps [C, H] + [C, fc1 width] per layer and nothing in float32. Rows >= n of the output and of
    the input gradient are left unwritten. `into` says, per weight, whether the backward adds its
    gradient into Megatron's main_grad (`megatron_ext.experts.main_grad`).
    """

    @staticmethod
    def forward(ctx, x, probs, w1, w2, offsets, gated, activation, into):
        n = offsets[-1:]
        h = F.grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        act = fused.activation_probs(h, probs, n, gated=gated, activation=activation)
        out = F.grouped_mm(act, w2.transpose(1, 2), offs=offsets)
        ctx.save_for_backward(x, h, probs, w1, w2, offsets)
        ctx.gated, ctx.activation = gated, activation
        # The parameters themselves (not their saved copies) whose gradients go into main_grad.
        ctx.main_grad_of = tuple(w if added else None for w, added in zip((w1, w2), into))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, h, probs, w1, w2, offsets = ctx.saved_tensors
        n = offsets[-1:]
        grad_out = grad_out.contiguous()
        act = fused.activation_probs(h, probs, n, gated=ctx.gated, activation=ctx.activation)
        # Weight gradients per expert, written in the parameters' own [L, out, in] layout.
        grad_w2 = F.grouped_mm(grad_out.t(), act, offs=offsets)
        del act
        grad_act = F.grouped_mm(grad_out, w2, offs=offsets)
        grad_h, grad_probs = fused.activation_probs_backward(
            grad_act, h, probs, n, gated=ctx.gated, activation=ctx.activation
        )
        del grad_act
        grad_w1 = F.grouped_mm(grad_h.t(), x, offs=offsets)
        grad_x = F.grouped_mm(grad_h, w1, offs=offsets)
        for param, grad in zip(ctx.main_grad_of, (grad_w1, grad_w2)):
            if param is not None:
                main_grad.add_into_main_grad(param, grad)
        return grad_x, grad_probs.to(probs.dtype), grad_w1, grad_w2, None, None, None, None


class _ExpertLinear(torch.nn.Module):
    """The weights of one linear for all L local experts: `weight` [L, out, in], `bias` [L, out].

    Its state dict reads like TE GroupedLinear's: `weight0, bias0, weight1, ..., _extra_state`.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, bias: bool, init_method, config):
        super().__init__()
        self.num_experts = num_experts
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(device=device, dtype=config.params_dtype)
        self.weight = torch.nn.Parameter(torch.empty(num_experts, out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.zeros(num_experts, out_features, **kw)) if bias else None  # TE: zeros
        if config.perform_initialization:
            # Like TE's experts: on GPU, draw from the expert-parallel RNG stream so EP ranks differ.
            tracker = get_cuda_rng_tracker()
            fork = not config.use_cpu_initialization and tracker.is_initialized()
            with tracker.fork(get_expert_parallel_rng_tracker_name()) if fork else contextlib.nullcontext():
                for expert_weight in self.weight.data:  # per expert, as TE initialises weight{i}
                    init_method(expert_weight)
        self.register_state_dict_post_hook(experts_checkpoint.split_per_expert)
        self.register_load_state_dict_pre_hook(experts_checkpoint.stack_per_expert)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # what TE saves when no fp8 state is kept

    def set_extra_state(self, state) -> None:
        """Accept and ignore TE's extra state: fp8 scaling history, meaningless here."""


class GroupedMLP(MegatronModule):
    """The L local experts of one MoE layer, as two grouped GEMMs over device-side expert offsets.

    Args:
        num_local_experts: L.
        config: the TransformerConfig; refused settings raise ValueError naming the flag.
        submodules: ignored (accepted so that `MoESubmodules(experts=GroupedMLP)` works).
        pg_collection: needs `ep` and `expt_tp` (and `expt_dp` for `sharded_state_dict`);
            None takes Megatron's default MoE process groups.
        name: ignored.
    """

    def __init__(
        self, num_local_experts: int, config: TransformerConfig, submodules=None, pg_collection=None, name=None
    ):
        super().__init__(config=config)
        pg_collection = get_default_pg_collection() if pg_collection is None else pg_collection
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        self.num_local_experts = num_local_experts
        self._check_config(config, get_pg_size(self.tp_group))
        ffn = config.moe_ffn_hidden_size
        bias = config.add_bias_linear
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = _ExpertLinear(
            num_local_experts, config.hidden_size, fc1_out, bias=bias, init_method=config.init_method, config=config
        )
        self.linear_fc2 = _ExpertLinear(
            num_local_experts,
            ffn,
            config.hidden_size,
            bias=bias,
            init_method=config.output_layer_init_method,
            config=config,
        )
        # Expert parameters as Megatron's expert linears mark them: allreduce=False sends their
        # gradients over the expert-data-parallel group (layers.py / TE's use_expert_pgs), and the
        # TP attributes TE sets on column (fc1) / row (fc2) expert linears, shifted by the expert axis.
        use_expert_pgs = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for linear, dim in ((self.linear_fc1, 1), (self.linear_fc2, 2)):
            for pname, param in linear.named_parameters():
                param.allreduce = not use_expert_pgs
                param.tensor_model_parallel = pname == "weight" or linear is self.linear_fc1
                if param.tensor_model_parallel:
                    param.partition_dim, param.partition_stride = (dim if pname == "weight" else 1), 1
        # Megatron's --recompute-modules moe_act, as TEGroupedMLP reads it.
        self.activation_recompute = config.recompute_granularity == "selective" and "moe_act" in (
            config.recompute_modules or []
        )
        # (gated, activation code) when the fused path computes this MLP, else None.
        self._fused_activation = self._fused_activation_of(config)
        self._capacity_mode = getattr(config, "moe_hybridep_capacity_factor", None) is not None
        self.register_load_state_dict_pre_hook(experts_checkpoint.from_sequential_mlp)

    @staticmethod
    def _fused_activation_of(config: TransformerConfig):
        """What the fused kernels compute for this config, or None where the torch path must run:
        a bias, a clamp, a GLU offset or an activation they do not have."""
        code = fused.activation_code(config.activation_func)
        if code is None or config.add_bias_linear or config.activation_func_clamp_value is not None:
            return None
        if config.gated_linear_unit and config.glu_linear_offset:
            return None
        return bool(config.gated_linear_unit), code

    def _check_sync_free(self, x: torch.Tensor) -> None:
        """Refuse, on the host and before any kernel, what would make capacity mode read the device."""
        if self._capacity_mode and x.is_cuda and x.dtype != torch.bfloat16:
            raise _sync_refusal(x.dtype)

    @staticmethod
    def _check_config(config: TransformerConfig, expt_tp_size: int) -> None:
        """Refuse what these experts cannot compute, naming the flag: called when they are built, with
        the expert tensor-parallel group's size, and by a dry run of the flags before anything is."""
        on_gpu = not config.use_cpu_initialization
        capacity_mode = getattr(config, "moe_hybridep_capacity_factor", None) is not None
        if capacity_mode and on_gpu:
            if config.params_dtype != torch.bfloat16:
                raise _sync_refusal(config.params_dtype)
        refuse = functools.partial(_refusal, capacity_mode=capacity_mode)
        if config.expert_tensor_parallel_size != 1 or expt_tp_size != 1:
            raise refuse(
                "--expert-tensor-parallel-size",
                "expert tensor parallelism",
                "set it to 1 (Megatron sets it to --tensor-model-parallel-size when it is not given)",
            )
        if getattr(config, "expert_gtp_weight_remat_size", 1) != 1:
            raise refuse("--expert-tensor-parallel-num-weight-shards", "sharded expert weights", "leave it unset")
        if config.moe_mlp_glu_interleave_size is not None:
            raise refuse("--moe-mlp-glu-interleave-size", "interleaved GLU weights", "leave it unset")
        if config.moe_latent_size is not None:
            raise refuse("--moe-latent-size", "latent expert projections", "leave it unset")
        if config.fp8 or config.fp4:
            raise refuse("--fp8-format / --fp4-format", "fp8/fp4 experts", "train the experts in bf16")
        if config.moe_apply_probs_on_input:
            raise refuse("--moe-apply-probs-on-input", "probs applied on the input", "leave it off")
        offloaded = sorted({"expert_fc1", "moe_act", "fused_group_mlp"} & set(config.offload_modules or []))
        if config.fine_grained_activation_offloading and offloaded:
            raise refuse(
                "--offload-modules",
                f"offloading the experts' activations ({', '.join(offloaded)})",
                "drop them from --offload-modules (--recompute-modules moe_act saves the activation's memory)",
            )
        if config.delay_wgrad_compute or config.overlap_dispatch_backward_with_experts_wgrad:
            raise refuse(
                "--delay-wgrad-compute / --overlap-dispatch-backward-with-experts-wgrad",
                "deferred weight gradients (they are computed in the ordinary backward)",
                "leave both off",
            )
        # grouped_mm needs 16-byte row strides in its operands: x [P, H], the fc2 input [P, F] and
        # the transposed weights, whose row strides are H and F elements.
        per_16_bytes = 16 // torch.empty(0, dtype=config.params_dtype).element_size()
        for flag, size in (
            ("--hidden-size", config.hidden_size),
            ("--moe-ffn-hidden-size", config.moe_ffn_hidden_size),
        ):
            if size % per_16_bytes:
                raise refuse(
                    flag,
                    f"a size of {size}: grouped_mm needs rows of a multiple of 16 bytes",
                    f"use a multiple of {per_16_bytes} for {config.params_dtype}",
                )

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """Run the experts over the rows of each expert; rows past n = sum(tokens_per_expert) are
        never read and carry nothing into the real rows or the weight gradients.

        Args:
            permuted_local_hidden_states: [P, H], params dtype; rows grouped by local expert in
                order, then rows past n (any values, NaN included).
            tokens_per_expert: [L] integer counts, on the device (never read on the host);
                a sum above P is clamped to P.
            permuted_probs: [P] float32 router probs of the rows.

        Returns:
            (output [P, H] in the input dtype, None). Rows past n, and the input gradient's rows
            past n: unwritten on the fused path (GPU, bfloat16, no bias, SiLU/GELU with or without
            GLU), as deep_ep's dispatch and TE's op fuser leave them; zeros on the torch path.
        """
        x = permuted_local_hidden_states
        rows, dtype = x.shape[0], x.dtype
        self._check_sync_free(x)
        # Expert boundaries as grouped_mm wants them: inclusive cumulative counts, int32, on the
        # device; clamped to P so that bad counts can never make it read past the rows it has.
        # A capacity-mode dispatch made them with its bookkeeping (`fused.record_dispatch`); else
        # two launches: the sum in int32 directly (counts are far below 2**31), clamped in place.
        offsets = fused.attached_offsets(tokens_per_expert, rows)
        if offsets is None:
            offsets = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32).clamp_(max=rows)
        # Under Megatron's DDP the backward adds the parameters' gradients into their main_grad
        # itself (`megatron_ext.experts.main_grad`), which spares TE's per-layer graphs a copy of each.
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if self._fused_activation is not None and fused.enabled_for(x):
            gated, activation = self._fused_activation
            into = (main_grad.accumulates(w1), main_grad.accumulates(w2))
            return _FusedExperts.apply(x, permuted_probs, w1, w2, offsets, gated, activation, into), None
        w1, w2 = main_grad.into_main_grad(w1), main_grad.into_main_grad(w2)
        row_ids = torch.arange(rows, device=x.device, dtype=torch.int32)
        real = (row_ids < offsets[-1]).unsqueeze(-1)  # [P, 1]
        # grouped_mm leaves rows past offsets[-1] uninitialised and returns garbage gradients for
        # them: zero the inputs there (their gradients go through where(), hence exactly zero) ...
        x = torch.where(real, x, 0)
        probs = torch.where(real, permuted_probs.unsqueeze(-1), 0)
        b1, b2 = (b if b is None else main_grad.into_main_grad(b) for b in (self.linear_fc1.bias, self.linear_fc2.bias))
        if b1 is not None:
            # Each row's expert; padding rows get L and gather an appended zero row, so that their
            # garbage gradients land in that row and are dropped.
            expert = torch.bucketize(row_ids, offsets, right=True)
        h = F.grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        if b1 is not None:
            h = h + F.pad(b1, (0, 0, 0, 1))[expert]
        recompute = ActivationRecompute() if self.activation_recompute else None
        h = recompute(self._activation, h, probs) if recompute else self._activation(h, probs)
        out = F.grouped_mm(h, w2.transpose(1, 2), offs=offsets)
        if recompute:
            recompute.release(out)
        if b2 is not None:  # TEGroupedMLP adds the fc2 bias weighted by the probs
            out = (out + F.pad(b2, (0, 0, 0, 1))[expert] * probs).to(dtype)
        # ... and the outputs there, which grouped_mm did not write.
        return torch.where(real, out, 0), None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The activation (GLU or not) weighted by the float32 probs, back in h's dtype, as
        TEGroupedMLP's unfused path computes it."""
        cfg = self.config
        if cfg.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := cfg.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
            if cfg.glu_linear_offset:
                linear = linear + cfg.glu_linear_offset
            act = cfg.activation_func(gate) * linear
        else:
            act = cfg.activation_func(h)
        return (act * probs).to(h.dtype)

    def backward_dw(self) -> None:
        """Nothing to do: weight gradients are computed in the ordinary backward."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed-checkpoint entries in TEGroupedMLP's global layout (`experts_checkpoint`)."""
        return experts_checkpoint.sharded_state_dict(self, prefix, sharded_offsets, metadata)
