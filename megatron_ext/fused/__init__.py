"""Triton kernels that do work in proportion to the real rows of a capacity-sized tensor.

A capacity-mode dispatch hands over C rows of which only the first n are real; n lives on the
device (the sum of `tokens_per_expert`) and is never read on the host. Every kernel here reads n
from a one-element device tensor and visits only the rows below it, in a persistent loop of a
fixed number of programs, so its cost follows n and not C. Rows at or past n are neither read nor
written (they hold whatever the allocator left there), which is what deep_ep's dispatch and TE's
op-fuser experts do too: whoever reads a capacity-sized tensor must stop at n.

The kernels:
* `activation_probs` / `activation_probs_backward`: the expert activation (SwiGLU, GeGLU, SiLU or
  GELU) weighted by the float32 router probs, in one pass each way, in float32 registers.
* `gather_rows`: `out[r] = src[index[r]]` for r < n, a zero row for an index past `src` (the
  permute of a dispatch); `gather_rows_and_values`: with one value per row (the dispatched
  probs) in the same launch.
* `block_counts` and `dispatch_layout`: a dispatch's whole layout (see `hybridep/torch_buffer/layout.py`) and
  the row tables the gathers read, in two launches, with no host read.
* `sum_rows_per_slot`: for every slot (a received token), the float32 sum of its rows, in the
  order of the row table (expert order); a gather per slot, deterministic, with no atomics and no
  sort (the unpermute of a combine); `sum_rows_per_slot_and_values`: with each slot's values by
  expert (the combined probs) in the same launch.
* `record_dispatch`: a non-blocking dispatch's bookkeeping (its overflow counted, its rows into
  the layer's running maxima and Megatron's capacity-use metric) in one launch, with the experts'
  offsets (`attach_offsets` / `attached_offsets` hand them over on the dispatch's counts).

`enabled_for(t)` says whether they run for a tensor: CUDA tensors when Triton imports, and CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, how the CPU tests run them).

The package by subject: what the kernels share (`common.py`: Triton, `enabled_for`, launch
sizes, argument checks), the activation (`activation.py`), the row gathers and sums
(`rows.py`), the dispatch layout (`layout.py`) and a dispatch's bookkeeping (`counters.py`).
Callers use the names below, imported here.
"""

from __future__ import annotations

from megatron_ext.fused.activation import (  # noqa: F401 (re-exported: the experts and the tests call fused.X)
    GELU,
    SILU,
    activation_code,
    activation_probs,
    activation_probs_backward,
)
from megatron_ext.fused.common import (  # noqa: F401 (re-exported: fused.enabled_for, fused.triton, the tests)
    _cdiv,
    _next_pow2,
    enabled_for,
    interpreting,
    triton,
)
from megatron_ext.fused.counters import (  # noqa: F401 (re-exported: the capacity policy and the experts)
    attach_offsets,
    attached_offsets,
    forget_offsets,
    record_dispatch,
)
from megatron_ext.fused.layout import Layout, block_counts, dispatch_layout  # noqa: F401 (re-exported: callers)
from megatron_ext.fused.rows import (  # noqa: F401 (re-exported: the torch buffer and the tests call fused.X)
    gather_rows,
    gather_rows_and_values,
    sum_rows_per_slot,
    sum_rows_per_slot_and_values,
)
