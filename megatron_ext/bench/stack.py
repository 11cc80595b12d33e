"""The MoE stack every bench mode runs: its Megatron config, its experts, its inputs, its weights.

Every mode builds the same `MoEStack` (same layers, weights and inputs; `megatron_config` applies
the mode's overrides), so what differs between two rows of the bench is the dispatch alone.
`python -m megatron_ext.bench.kernels` and `.profile` build it too.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import TYPE_CHECKING, Optional

import torch

from megatron_ext.bench.sizes import Sizes
from megatron_ext.options import CUTEDSL_GROUPED_MLP_ENV

if TYPE_CHECKING:
    from megatron_ext.bench.modes import Mode

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# What every MoE stack of the bench and the tests shares, whatever its size and mode: one
# attention head (never built: MoE layers alone), no biases, the router in fp32 without load
# balancing (so routing depends on the tokens alone), SwiGLU experts without the fused bias-act.
MOE_STACK_DEFAULTS = dict(
    num_attention_heads=1,
    add_bias_linear=False,
    moe_router_dtype="fp32",
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    bias_activation_fusion=False,
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
)


def allow_gated_op_fuser_experts() -> None:
    """Megatron-Core 0.19.2 accepts SwiGLU on TE's op fuser only when NVTE_CUTEDSL_FUSED_GROUPED_MLP
    asks for TE's CuTe DSL fused grouped MLP; TE uses that kernel on compute capability 10 alone and
    runs its separate grouped ops (GroupedLinear, ScaledSwiGLU, GroupedLinear) elsewhere, the H200
    included. megatron-ext's config check refuses the op fuser with SwiGLU without it."""
    os.environ.setdefault(CUTEDSL_GROUPED_MLP_ENV, "1")


def megatron_config(sizes: Sizes, world_size: int, device: torch.device, mode: Mode):
    from megatron_ext.options.config import HybridEPTransformerConfig

    if mode.overrides.get("use_transformer_engine_op_fuser"):
        allow_gated_op_fuser_experts()

    dtype = DTYPES[sizes.dtype]
    base = dict(
        MOE_STACK_DEFAULTS,
        num_layers=sizes.layers,
        hidden_size=sizes.hidden,
        num_moe_experts=sizes.experts,
        moe_router_topk=sizes.topk,
        moe_ffn_hidden_size=sizes.ffn_hidden,
        expert_model_parallel_size=world_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu",
        moe_flex_dispatcher_num_sms=sizes.deep_ep_num_sms,
    )
    return HybridEPTransformerConfig(**{**base, **mode.overrides})


def te_import_error() -> Optional[str]:
    """None when Megatron finds Transformer Engine with its op-fuser GroupedLinear, else why not."""
    if not torch.cuda.is_available():
        return "Transformer Engine's experts need a CUDA GPU"
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
        from transformer_engine.pytorch.ops import GroupedLinear  # noqa: F401
    except Exception as exc:  # ImportError, or a library/driver error raised at import
        return f"Transformer Engine does not import: {type(exc).__name__}: {exc}"
    return None if HAVE_TE else "Megatron-Core did not find Transformer Engine"


def experts_spec(kind: str, num_experts: int):
    """The experts and shared-experts spec for `kind` ('grouped', 'te' or 'te-op-fuser')."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_ext.experts import GroupedMLP

    if kind == "grouped":
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
        shared = spec.submodules.mlp.keywords["submodules"].shared_experts
        return MoESubmodules(experts=GroupedMLP, shared_experts=shared)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    if kind == "te-op-fuser":
        allow_gated_op_fuser_experts()
    return get_moe_module_spec(use_te=True, num_experts=num_experts, moe_grouped_gemm=True).keywords["submodules"]


class MoEStack(torch.nn.Module):
    """`layers` Megatron MoE layers that read the same input; their outputs are summed: x + sum(moe(x)).

    Not chained on purpose: routing is discontinuous, so when a mode sums in another order (stock
    Megatron in bf16) a rounding difference in layer 1 would change which experts layer 2 picks,
    and no tolerance could tell that from a bug. Each layer's routing, dispatch, experts and
    combine run as they do in a model, forward and backward, in sequence on one stream.
    """

    def __init__(self, config, layers: int, experts: str = "grouped"):
        super().__init__()
        from megatron.core.transformer.moe.moe_layer import MoELayer

        submodules = experts_spec(experts, config.num_moe_experts)
        self.config = config  # where Megatron's get_model_config (and so the overflow recovery) looks
        with fp8_init_context(config):  # fp8 weights (--fp8-param-gather) are made fp8 here
            self.layers = torch.nn.ModuleList(
                MoELayer(config, submodules=submodules, layer_number=i + 1) for i in range(layers)
            )

    def mark_first_microbatch(self) -> None:
        """What Megatron's schedule does at a step's first micro-batch (`set_is_first_microbatch`):
        TE's layers in fp8 then cast their weights once and keep the casts for the step's others."""
        for layer in self.layers:
            layer.set_is_first_microbatch()

    def forward(self, x):
        out = x
        with fp8_context(self.config):
            for layer in self.layers:
                out = out + layer(x)[0]
        return out


def forward_backward(stack, x, loss_weights, micro_batches: int = 1, after_first_forward=lambda: None):
    """The bench's step on `x`: `micro_batches` forward and backward passes of `stack`, the loss
    `(out * loss_weights).sum()`, gradients accumulating onto what the caller left (the caller
    zeroes them); the first pass marked as Megatron's schedule marks a step's first micro-batch
    (a `MoEStack`; tests step plain modules). Returns the last output."""
    for index in range(micro_batches):
        if index == 0 and hasattr(stack, "mark_first_microbatch"):
            stack.mark_first_microbatch()
        out = stack(x)
        if index == 0:
            after_first_forward()
        (out.float() * loss_weights).sum().backward()
    return out


def fp8_init_context(config):
    """Where TE's layers create fp8 weights (`fp8_param`, Megatron's `--fp8-param-gather`), as a
    TransformerBlock builds its layers: Megatron's fp8 init context; nothing otherwise."""
    if not getattr(config, "fp8_param", False):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config, is_init=True)


def fp8_context(config):
    """Megatron's fp8 context for `config` (Transformer Engine's autocast with its recipe), as a
    TransformerBlock enters it around its layers; nothing without fp8."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config)


def make_inputs(sizes: Sizes, rank: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """Fresh `[T, 1, H]` inputs per step and rank; `skew` adds a fixed +-1 vector to every token."""
    generator = torch.Generator().manual_seed(sizes.seed * 7919 + rank)
    direction = torch.randint(0, 2, (sizes.hidden,), generator=torch.Generator().manual_seed(sizes.seed)) * 2 - 1
    dtype = DTYPES[sizes.dtype]
    return [
        (torch.randn(sizes.tokens, 1, sizes.hidden, generator=generator) + sizes.skew * direction).to(
            device=device, dtype=dtype
        )
        for _ in range(count)
    ]


_PER_EXPERT = re.compile(r"^(.*\.(?:weight|bias))(\d+)$")


def stack_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` by parameter name, TE GroupedLinear's per-expert `...experts.*.weight{i}` stacked
    under GroupedMLP's `...weight` ([experts, out, in]), so TE's experts compare with megatron-ext's."""
    out, per_expert = {}, {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match and "experts." in name:
            per_expert.setdefault(match.group(1), {})[int(match.group(2))] = tensor
        else:
            out[name] = tensor
    out.update({name: torch.stack([e[i] for i in sorted(e)]) for name, e in per_expert.items()})
    return out


def grads_by_name(module) -> dict[str, torch.Tensor]:
    """Every parameter gradient by name, per-expert ones stacked (`stack_per_expert`)."""
    return stack_per_expert({n: p.grad for n, p in module.named_parameters() if p.grad is not None})


def load_weights(stack, weights: dict) -> None:
    """The first stack's weights into `stack`; GroupedMLP and TEGroupedMLP name them alike, and
    TE's `_extra_state` (its fp8 metadata, none here) may be absent on either side."""
    missing, unexpected = stack.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not carry over: missing {missing[:4]}, unexpected {unexpected[:4]}")
