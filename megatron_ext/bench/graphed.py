"""One whole bench step (forward, loss, backward) captured in a CUDA graph and replayed: `+graph` modes.

It follows PyTorch's whole-network capture ("CUDA Graphs" in torch.cuda's notes): static input,
one warm-up step on a side stream, then `torch.cuda.graph`. What a replay produces lives in static
tensors that the next replay overwrites: the output, the input's gradient and every parameter's
`.grad` (allocated in the graph's pool during the capture). So between replays nothing zeroes the
gradients or sets them to None: the capture's backward writes them whole, it does not accumulate.

A replay runs no Python: the bench's counters that wrap Python calls (dispatches, collectives)
see nothing during one, and host syncs cannot happen in it.
"""

from __future__ import annotations

import torch

from megatron_ext.bench.modes import GRAPH_SKIP_REASON
from megatron_ext.bench.stack import forward_backward


class GraphedStep:
    """`stack`'s forward+backward on inputs like `example`, captured once; call it as the bench's step.

    The caller runs the eager steps a capture needs first (capacity mode's blocking calibration,
    then one non-blocking step, which compiles its kernels): the capture itself must read nothing
    on the host. Every rank captures (the step's collectives are in the graph); a capture launches
    no collective, so a rank whose capture raised is not waited for by the others until the
    caller's next collective, where the ranks can agree to drop the mode.
    """

    def __init__(
        self, stack: torch.nn.Module, example: torch.Tensor, loss_weights: torch.Tensor, micro_batches: int = 1
    ):
        if example.device.type != "cuda":
            raise RuntimeError(f"{GRAPH_SKIP_REASON}: the input is on {example.device}")
        self.stack, self.loss_weights, self.micro_batches = stack, loss_weights, micro_batches
        self.x_static = example.detach().clone().requires_grad_(True)
        # Warm-up on a side stream, as PyTorch's recipe does: the first run on that stream sets up
        # autograd's and the allocator's per-stream state outside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward_backward()
        torch.cuda.current_stream().wait_stream(side)
        if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            # As Megatron's full-iteration graph does (PyTorch with pytorch#180090): an autograd node
            # that still holds an eager step's stream would otherwise pull that stream, which is not
            # capturing, into the capture and invalidate it.
            torch.autograd.graph.set_override_stale_capture_stream(True)
        # Measured from a start without gradients, as the bench's eager steps are.
        self.x_static.grad = None
        stack.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resting = torch.cuda.memory_allocated()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local, as Megatron's graphs: a CUDA call from another thread (NCCL's watchdog
        # querying its events) must not invalidate this thread's capture. Captured on the warm-up's
        # stream: cuBLAS keeps a workspace per stream and thread (32 MiB each on Hopper, one for the
        # forward's thread and one for autograd's), so a fresh capture stream would add two.
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.out_static = self._forward_backward().detach()  # kept without its autograd node
        torch.cuda.synchronize()
        # What the graph's pool holds for a step: its activations, gradients and transients.
        self.capture_peak_bytes = torch.cuda.max_memory_allocated() - resting

    def _forward_backward(self) -> torch.Tensor:
        # The input's and the parameters' gradients start as None, so the backward writes fresh
        # tensors (in the graph's pool under capture) instead of adding to the warm-up's.
        self.x_static.grad = None
        self.stack.zero_grad(set_to_none=True)
        return forward_backward(self.stack, self.x_static, self.loss_weights, self.micro_batches)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on `x`: (the output, the input's gradient), both the graph's static tensors."""
        with torch.no_grad():  # x_static is a leaf that requires grad: copy into it outside autograd
            self.x_static.copy_(x)
        self.graph.replay()
        return self.out_static, self.x_static.grad
