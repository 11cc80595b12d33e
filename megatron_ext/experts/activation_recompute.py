"""Release an activation's output after its consumer read it, and recompute it for the backward.

`--recompute-granularity selective --recompute-modules moe_act`, as Megatron's `TEGroupedMLP`
honours it, for megatron-ext's `GroupedMLP` (`megatron_ext.experts`): `ActivationRecompute`
runs `fn(h, probs)` keeping only `h` and `probs`; once the next GEMM has read the output,
`release(gemm_output)` frees its memory, and a hook on the GEMM's output refills it in place just
before the GEMM's backward needs it.
"""

from __future__ import annotations

import torch


class ActivationRecompute:
    """Runs `fn(h, probs)` without keeping its output: the output's memory is released once the
    next GEMM has consumed it (`release`) and refilled by recomputing `fn` just before that GEMM's
    backward needs it (a hook on the GEMM's output). Only `h` and `probs` stay saved."""

    def __init__(self):
        self.ctx = None
        self.output: torch.Tensor | None = None

    def __call__(self, fn, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        self.output = _DiscardedOutput.apply(fn, self, h, probs)
        return self.output

    def release(self, consumer_output: torch.Tensor) -> None:
        if not consumer_output.requires_grad:  # no backward will come: nothing to recompute
            return
        self.output.untyped_storage().resize_(0)
        consumer_output.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        ctx, output = self.ctx, self.output
        if ctx is None:  # already recomputed (the hook fires once per backward)
            return
        h, probs = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            recomputed = ctx.fn(h, probs)
        # Refill the released storage in place: the GEMM saved `output` itself for its backward.
        # A storage copy leaves the tensor's version counter alone, as autograd requires.
        storage = output.untyped_storage()
        storage.resize_(recomputed.untyped_storage().nbytes())
        storage.copy_(recomputed.untyped_storage())
        ctx.recomputed = (h, probs, recomputed)
        self.ctx = self.output = None


class _DiscardedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, owner: ActivationRecompute, h, probs):
        with torch.no_grad():
            out = fn(h, probs)
        ctx.fn = fn
        ctx.recomputed = None
        ctx.save_for_backward(h, probs)
        owner.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.recomputed is None:
            raise RuntimeError(
                "megatron_ext GroupedMLP: the moe_act recompute did not run before the activation's backward "
                "(use .backward(), not torch.autograd.grad on part of the graph, with --recompute-modules moe_act)."
            )
        h, probs, out = ctx.recomputed
        ctx.recomputed = None
        torch.autograd.backward(out, grad)
        return None, None, h.grad, probs.grad
