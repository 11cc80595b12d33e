"""The experts' weight gradients added into Megatron's `main_grad` by their own backward.

Megatron's DDP gives each parameter an fp32 `main_grad` (a view into its gradient buffer) and, per
micro-batch, adds the parameter's `.grad` into it from a hook on autograd's accumulation, unless the
layer says it did so itself (`param.grad_added_to_main_grad`, the convention TE's layers follow
with fused weight-gradient accumulation). `into_main_grad(param)` makes the experts follow it: the
backward of the parameter's use adds the gradient into `main_grad` (the very `add_` the hook would
make, so the sums are bitwise the same), marks it added, and hands the gradient on as a placeholder
that nothing reads.

Why: under Transformer Engine's per-layer graphs (`--cuda-graph-impl transformer_engine`) the
gradients a graph returns for parameters live in the graph's static buffers, and TE (2.20, as
measured) copies each one before handing it to autograd, unless the parameter carries
`skip_backward_post_hook` (TE's mark for "the real gradient went into main_grad already"). For the
experts, whose weights are most of an MoE model's, that copy is a read and a write of every expert
weight per micro-batch. With the gradient in `main_grad` first, the mark is true and the copy is
gone; in eager mode nothing changes but where the same `add_` is issued.

Only Megatron's DDP convention qualifies (a `main_grad` of the parameter's shape and the
`grad_added_to_main_grad` flag it sets); Megatron-FSDP's parameters (`get_main_grad`) and plain
parameters keep the ordinary path. DDP's `delay_wgrad_compute`, which gives
`skip_backward_post_hook` another meaning, is refused by the experts (`GroupedMLP`) already.
"""

from __future__ import annotations

import torch


def _keeps_main_grad(param: torch.Tensor) -> bool:
    """Whether Megatron's DDP gave `param` a `main_grad` and reads `grad_added_to_main_grad`."""
    main_grad = getattr(param, "main_grad", None)
    return (
        isinstance(main_grad, torch.Tensor)
        and main_grad.shape == param.shape
        and hasattr(param, "grad_added_to_main_grad")
        and not hasattr(param, "get_main_grad")  # Megatron-FSDP fetches it lazily: its own path
    )


def accumulates(param: torch.Tensor) -> bool:
    """Whether this forward's backward is to add `param`'s gradient into its `main_grad` (autograd
    on, Megatron's DDP convention); if so, `param` is marked for TE (see the module's docstring)."""
    if not (torch.is_grad_enabled() and param.requires_grad and _keeps_main_grad(param)):
        return False
    param.skip_backward_post_hook = True  # read by TE when it captures the backward graph
    return True


def add_into_main_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """In a backward: `grad` added into `param.main_grad`, as DDP's hook would, and marked added;
    returns `grad`, to be handed to autograd as the placeholder nobody reads."""
    param.main_grad.add_(grad)
    param.grad_added_to_main_grad = True
    return grad


class _IntoMainGrad(torch.autograd.Function):
    """Identity forward; the backward adds the incoming gradient into `param.main_grad`."""

    @staticmethod
    def forward(ctx, param):
        ctx.param = param
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return add_into_main_grad(ctx.param, grad)


def into_main_grad(param: torch.Tensor) -> torch.Tensor:
    """`param` for use in this forward: as is, or, where `accumulates(param)`, a view whose
    backward adds the gradient into `main_grad`."""
    return _IntoMainGrad.apply(param) if accumulates(param) else param
