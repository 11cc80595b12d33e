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
* `block_counts` and `dispatch_layout`: a dispatch's whole layout (see `hybridep/layout.py`) and
  the row tables the gathers read, in two launches, with no host read.
* `sum_rows_per_slot`: for every slot (a received token), the float32 sum of its rows, in the
  order of the row table (expert order); a gather per slot, deterministic, with no atomics and no
  sort (the unpermute of a combine); `sum_rows_per_slot_and_values`: with each slot's values by
  expert (the combined probs) in the same launch.

`enabled_for(t)` says whether they run for a tensor: CUDA tensors when Triton imports, and CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, how the CPU tests run them).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the registry's torch brings triton
    triton = None

# Activations the fused kernels compute, by the callable Megatron's config holds.
SILU, GELU = 0, 1
_ACTIVATIONS = {torch.nn.functional.silu: SILU, torch.nn.functional.gelu: GELU}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled_for(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors like `t` (CUDA, or CPU under Triton's interpreter)."""
    return triton is not None and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


def activation_code(activation_func) -> Optional[int]:
    """The kernels' code for Megatron's `activation_func`, or None when they do not have it."""
    return _ACTIVATIONS.get(activation_func)


@functools.cache
def _programs(device_index: Optional[int]) -> int:
    """How many programs a persistent kernel launches: a few per multiprocessor (host query, cached)."""
    if device_index is None:
        return 4  # the interpreter runs programs one after another
    return 8 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(t: torch.Tensor, blocks: int) -> int:
    return max(1, min(blocks, _programs(t.device.index if t.is_cuda else None)))


# Host-side sizes. Triton's own `cdiv` and `next_power_of_2` are constexpr functions whose
# wrapper costs the host microseconds per call, a dozen times per dispatch; these are plain ints.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _pow2(n: int, cap: int) -> int:
    return min(cap, _next_pow2(n))


def _output(
    out: Optional[torch.Tensor],
    rows: int,
    width: int,
    dtype: torch.dtype,
    device,
    row_stride: bool = False,
    name: str = "out",
) -> torch.Tensor:
    """A new `[rows, width]` tensor, or `out` when it can take that many rows (a caller's buffer;
    `row_stride`: its rows may be further apart than `width`, a column slice of a wider buffer, but
    may not overlap). `name`: the argument's name in the error."""
    if out is None:
        return torch.empty(rows, width, dtype=dtype, device=device)
    laid_out = (width == 1 or out.stride(1) == 1) and out.stride(0) >= width if row_stride else out.is_contiguous()
    if not (
        laid_out and out.dtype == dtype and out.device == device and out.shape[0] >= rows and out.shape[1] == width
    ):
        kind = (
            "a [>= {}, {}] {} tensor with contiguous columns and rows apart"
            if row_stride
            else "a contiguous [>= {}, {}] {} tensor"
        )
        raise ValueError(
            f"fused: `{name}` must be {kind.format(rows, width, dtype)} on {device}; got {out.dtype} on "
            f"{out.device} of shape {tuple(out.shape)} and strides {out.stride()}"
        )
    return out


def _check_count(n: torch.Tensor, device: torch.device) -> None:
    if n.numel() != 1 or n.dtype not in (torch.int32, torch.int64) or n.device != device:
        raise ValueError(f"fused: the row count must be a one-element integer tensor on {device}; got {n}")


if triton is not None:

    @triton.jit
    def _activate(x, ACT: tl.constexpr):
        if ACT == 0:
            return x * tl.sigmoid(x)
        else:
            return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _activate_grad(x, ACT: tl.constexpr):
        if ACT == 0:
            s = tl.sigmoid(x)
            return s * (1.0 + x * (1.0 - s))
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)

    @triton.jit
    def _activation_probs_kernel(
        h_ptr,
        probs_ptr,
        n_ptr,
        out_ptr,
        grad_ptr,
        grad_probs_ptr,
        F: tl.constexpr,
        GATED: tl.constexpr,
        ACT: tl.constexpr,
        BACKWARD: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_F: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        # h: [C, 2F] (gated: gate then linear) or [C, F]; rows < n only. Forward: out [C, F] =
        # act(h) * probs. BACKWARD: from grad [C, F], out: grad_h (h's shape), and grad_probs [C].
        n = tl.load(n_ptr)
        h_width = 2 * F if GATED else F
        block = tl.program_id(0)
        while block * BLOCK_R < n:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < n
            p = tl.load(probs_ptr + rows, mask=live, other=0.0)[:, None]
            dot = tl.zeros((BLOCK_R,), dtype=tl.float32)  # backward: sum over F of grad * act * linear
            for start in range(0, F, BLOCK_F):
                cols = start + tl.arange(0, BLOCK_F)
                mask = live[:, None] & (cols < F)[None, :]
                f_at = rows[:, None].to(tl.int64) * F + cols[None, :]
                h_at = rows[:, None].to(tl.int64) * h_width + cols[None, :]
                x = tl.load(h_ptr + h_at, mask=mask, other=0.0).to(tl.float32)
                act = _activate(x, ACT)
                if GATED:
                    linear = tl.load(h_ptr + h_at + F, mask=mask, other=0.0).to(tl.float32)
                else:
                    linear = 1.0
                if BACKWARD:
                    grad = tl.load(grad_ptr + f_at, mask=mask, other=0.0).to(tl.float32)
                    dot += tl.sum(grad * act * linear, axis=1)
                    grad_x = grad * p * linear * _activate_grad(x, ACT)
                    tl.store(out_ptr + h_at, grad_x.to(out_ptr.dtype.element_ty), mask=mask)
                    if GATED:
                        tl.store(out_ptr + h_at + F, (grad * p * act).to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    tl.store(out_ptr + f_at, (act * linear * p).to(out_ptr.dtype.element_ty), mask=mask)
            if BACKWARD:
                tl.store(grad_probs_ptr + rows, dot, mask=live)
            block += PROGRAMS

    @triton.jit
    def _gather_rows_kernel(
        src_ptr,
        index_ptr,
        out_ptr,
        n_ptr,
        S,
        out_stride,
        table_ptr,
        codes_ptr,
        values_ptr,
        C,
        table_stride,
        num_codes,
        H: tl.constexpr,
        L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PROGRAMS: tl.constexpr,
        HAS_VALUES: tl.constexpr,
    ):
        # out[r] = src[index[r]] for r < n (out's rows out_stride apart); an index >= S (a padding
        # row) gives a zero row.
        # HAS_VALUES: also values[r] = table[codes[r] // L, codes[r] % L] for every r < C, 0 where
        # codes[r] >= num_codes (the table's rows are table_stride apart).
        n = tl.load(n_ptr)
        if HAS_VALUES:
            end = C
        else:
            end = n
        block = tl.program_id(0)
        while block * BLOCK_R < end:
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            if block * BLOCK_R < n:
                live = rows < n
                src_rows = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64)
                exists = src_rows < S
                for start in range(0, H, BLOCK_H):
                    cols = start + tl.arange(0, BLOCK_H)
                    in_width = (cols < H)[None, :]
                    values = tl.load(
                        src_ptr + src_rows[:, None] * H + cols[None, :],
                        mask=(live & exists)[:, None] & in_width,
                        other=0,
                    )
                    tl.store(
                        out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                        values,
                        mask=live[:, None] & in_width,
                    )
            if HAS_VALUES:
                in_c = rows < C
                code = tl.load(codes_ptr + rows, mask=in_c, other=0).to(tl.int64)
                known = in_c & (code < num_codes)
                at = (code // L) * table_stride + code % L
                tl.store(values_ptr + rows, tl.load(table_ptr + at, mask=known, other=0), mask=in_c)
            block += PROGRAMS

    @triton.jit
    def _block_counts_kernel(map_ptr, out_ptr, N, stride, L: tl.constexpr, L_P2: tl.constexpr, BLOCK_N: tl.constexpr):
        # out[b, e]: how many of tokens [b * BLOCK_N, (b + 1) * BLOCK_N) the map routes to expert e.
        b = tl.program_id(0)
        tokens = b * BLOCK_N + tl.arange(0, BLOCK_N)
        experts = tl.arange(0, L_P2)
        mask = (tokens < N)[:, None] & (experts < L)[None, :]
        routed = tl.load(map_ptr + tokens[:, None].to(tl.int64) * stride + experts[None, :], mask=mask, other=0)
        tl.store(out_ptr + b * L + experts, tl.sum(routed.to(tl.int32), axis=0), mask=experts < L)

    @triton.jit
    def _layout_kernel(
        map_ptr,
        stride,
        block_counts_ptr,
        slot_of_token_ptr,
        row_slot_ptr,
        row_code_ptr,
        slot_rows_ptr,
        tokens_per_expert_ptr,
        overflow_ptr,
        real_rows_ptr,
        N,
        capacity,
        num_slots,
        pad,
        num_blocks,
        L: tl.constexpr,
        L_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_S: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
    ):
        b = tl.program_id(0)
        experts = tl.arange(0, L_P2)
        is_expert = experts < L
        # Every program sums the block counts: over all blocks (the experts' totals, hence the
        # segments) and over the blocks before its own (its tokens' offsets in their segments).
        counts = tl.zeros((L_P2,), dtype=tl.int64)
        earlier = tl.zeros((L_P2,), dtype=tl.int64)
        start = 0
        while start < num_blocks:
            blocks = start + tl.arange(0, BLOCK_B)
            part = tl.load(
                block_counts_ptr + blocks[:, None] * L + experts[None, :],
                mask=(blocks < num_blocks)[:, None] & is_expert[None, :],
                other=0,
            ).to(tl.int64)
            counts += tl.sum(part, axis=0)
            earlier += tl.sum(tl.where((blocks < b)[:, None], part, 0), axis=0)
            start += BLOCK_B
        padded = (counts + pad - 1) // pad * pad
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        total = tl.sum(padded, axis=0)
        # Rows of this block's routed pairs: segment start + tokens of the expert in earlier blocks
        # + rank within the block (ascending token index).
        tokens = b * BLOCK_N + tl.arange(0, BLOCK_N)
        is_token = tokens < N
        in_map = is_token[:, None] & is_expert[None, :]
        routed = tl.load(map_ptr + tokens[:, None].to(tl.int64) * stride + experts[None, :], mask=in_map, other=0)
        routed = routed.to(tl.int32)
        rank = tl.cumsum(routed, axis=0) - routed
        rows = (starts + earlier)[None, :] + rank.to(tl.int64)
        kept = (routed != 0) & in_map & (rows < capacity)
        if HAS_SLOTS:
            slot = tl.load(slot_of_token_ptr + tokens, mask=is_token, other=0).to(tl.int64)
            has_slot = tl.max(routed, axis=1) > 0
        else:
            slot = tokens.to(tl.int64)
            has_slot = is_token
        code = slot[:, None] * L + experts[None, :]
        tl.store(row_slot_ptr + rows, slot[:, None] + 0 * rows, mask=kept)
        tl.store(row_code_ptr + rows, code, mask=kept)
        tl.store(slot_rows_ptr + code, tl.where(kept, rows, -1).to(tl.int32), mask=in_map & has_slot[:, None])
        # Padding rows (each expert's last segment rows past its tokens) and spare rows past the
        # padded total point at slot `num_slots`, which holds no token.
        padding_start = starts + counts
        j = b
        while j < pad:
            at = padding_start + j
            fill = is_expert & (at < ends) & (at < capacity)
            tl.store(row_slot_ptr + at, num_slots + 0 * at, mask=fill)
            tl.store(row_code_ptr + at, num_slots * L + 0 * at, mask=fill)
            j += num_blocks
        spare = total + b * BLOCK_S
        while spare < capacity:
            at = spare + tl.arange(0, BLOCK_S)
            fill = at < capacity
            tl.store(row_slot_ptr + at, num_slots + 0 * at, mask=fill)
            tl.store(row_code_ptr + at, num_slots * L + 0 * at, mask=fill)
            spare += num_blocks * BLOCK_S
        if b == 0:
            tl.store(
                tokens_per_expert_ptr + experts,
                tl.minimum(ends, capacity) - tl.minimum(starts, capacity),
                mask=is_expert,
            )
            tl.store(overflow_ptr, (total > capacity).to(tl.int32))
            tl.store(real_rows_ptr, tl.minimum(total, capacity))

    @triton.jit
    def _sum_rows_per_slot_kernel(
        rows_ptr,
        table_ptr,
        out_ptr,
        values_ptr,
        values_out_ptr,
        values_out_stride,
        H: tl.constexpr,
        L: tl.constexpr,
        L_P2: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_VALUES: tl.constexpr,
    ):
        # One slot and one column block per program: the slot's rows (table[slot, e], -1 for none)
        # added in table order, in float32. HAS_VALUES: the first column block's program also
        # writes values_out[slot, e] = values[table[slot, e]], 0 where -1.
        slot = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_width = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for e in range(L):
            row = tl.load(table_ptr + slot * L + e).to(tl.int64)
            if row >= 0:
                acc += tl.load(rows_ptr + row * H + cols, mask=in_width, other=0.0).to(tl.float32)
        tl.store(out_ptr + slot * H + cols, acc.to(out_ptr.dtype.element_ty), mask=in_width)
        if HAS_VALUES:
            if tl.program_id(1) == 0:
                experts = tl.arange(0, L_P2)
                is_expert = experts < L
                rows = tl.load(table_ptr + slot * L + experts, mask=is_expert, other=-1).to(tl.int64)
                picked = tl.load(values_ptr + rows, mask=rows >= 0, other=0)
                tl.store(values_out_ptr + slot * values_out_stride + experts, picked, mask=is_expert)


def activation_probs(h: torch.Tensor, probs: torch.Tensor, n: torch.Tensor, *, gated: bool, activation: int):
    """`act(h) * probs` for the first n rows, in float32, stored in h's dtype.

    Args:
        h: `[C, 2F]` (gated: the gate half, then the linear half; act(gate) * linear) or `[C, F]`.
        probs: `[C]` float32. n: one-element integer device tensor, the real rows (<= C).
        activation: `SILU` or `GELU` (`activation_code`).

    Returns:
        `[C, F]` in h's dtype; rows >= n unwritten.
    """
    _check_count(n, h.device)
    rows, width = h.shape
    h, probs = h.contiguous(), probs.contiguous()
    out = torch.empty(rows, width // 2 if gated else width, dtype=h.dtype, device=h.device)
    _activation(h, probs, n, out, gated, activation)
    return out


def activation_probs_backward(
    grad: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, n: torch.Tensor, *, gated: bool, activation: int
):
    """Gradients of `activation_probs` for the first n rows.

    Returns:
        `(grad_h [C, 2F] or [C, F] in h's dtype, rows >= n unwritten;
          grad_probs [C] float32, zero at rows >= n)`.
    """
    _check_count(n, h.device)
    grad, h, probs = grad.contiguous(), h.contiguous(), probs.contiguous()
    grad_h = torch.empty_like(h)
    grad_probs = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    _activation(h, probs, n, grad_h, gated, activation, backward=(grad, grad_probs))
    return grad_h, grad_probs


def _activation(h, probs, n, out, gated, activation, backward=None):
    """Launch `_activation_probs_kernel`: the forward into `out`, or, given `backward` (grad,
    grad_probs), the gradients (grad_h into `out`), in blocks half the size."""
    rows, width = h.shape
    F = width // 2 if gated else width
    grad, grad_probs = backward if backward is not None else (out, probs)  # not read forward
    block_cap = 1024 if backward is None else 512
    block_f = _pow2(F, block_cap)
    block_r = max(1, 2 * block_cap // block_f)
    programs = _grid(h, _cdiv(rows, block_r))
    _activation_probs_kernel[(programs,)](
        h,
        probs,
        n,
        out,
        grad,
        grad_probs,
        F,
        GATED=gated,
        ACT=activation,
        BACKWARD=backward is not None,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        PROGRAMS=programs,
    )


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, n: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """`out[r] = src[index[r]]` for r < n, a zero row where `index[r] >= S` (one launch).

    Args:
        src: `[S, H]`. index: `[C]` integer, values >= 0 for r < n (S or more: a padding row).
        n: one-element device tensor.
        out: where to write (`[C or more, H]` in src's dtype, columns contiguous, rows of any stride:
            a column slice of a wider buffer), or None for a new tensor.

    Returns:
        `out` (`[C, H]` when new) in src's dtype; rows >= n unwritten.
    """
    return _gather(src, index, n, out, None)[0]


def gather_rows_and_values(
    src: torch.Tensor,
    index: torch.Tensor,
    n: torch.Tensor,
    table: torch.Tensor,
    codes: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows` and, in the same launch, one value per row: `values[r] = table[codes[r] // L,
    codes[r] % L]` for every r < C (past n too), 0 where `codes[r] >= table.numel()` (a padding or
    spare row). The rows and probs of a dispatch in one pass.

    Args:
        src, index, n, out: as in `gather_rows`.
        table: `[S_t, L]`, columns contiguous, rows of any stride (a column slice of a wider buffer
            is read as it is). codes: `[C]` integer, values >= 0.

    Returns:
        (`[C, H]` rows as in `gather_rows`, `[C]` values in table's dtype)
    """
    _check_table(table, codes, index.shape[0])
    return _gather(src, index, n, out, (table, codes))


def _check_table(table: torch.Tensor, codes: torch.Tensor, rows: int) -> None:
    if table.dim() != 2 or (table.shape[1] > 1 and table.stride(1) != 1) or codes.shape != (rows,):
        raise ValueError(
            f"fused: the value table must be [S, L] with contiguous columns and one code per row ({rows}); "
            f"got a table of shape {tuple(table.shape)} and strides {table.stride()}, codes of shape "
            f"{tuple(codes.shape)}"
        )


def _gather(src, index, n, out, values):
    _check_count(n, src.device)
    src, index = src.contiguous(), index.contiguous()
    S, H = src.shape
    C = index.shape[0]
    out = _output(out, C, H, src.dtype, src.device, row_stride=True)
    block_h = _pow2(H, 1024)
    block_r = max(1, 4096 // block_h)
    programs = _grid(src, _cdiv(C, block_r))
    if values is None:  # the value arguments are not read
        table, codes, gathered, L, stride = index, index, index, 1, 0
    else:
        table, codes = values[0], values[1].contiguous()
        gathered = torch.empty(C, dtype=table.dtype, device=src.device)
        L, stride = table.shape[1], table.stride(0)
    _gather_rows_kernel[(programs,)](
        src,
        index,
        out,
        n,
        S,
        out.stride(0),
        table,
        codes,
        gathered,
        C,
        stride,
        table.shape[0] * L,
        H=H,
        L=L,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        PROGRAMS=programs,
        HAS_VALUES=values is not None,
    )
    return out, (None if values is None else gathered)


class Layout(NamedTuple):
    """One rank's dispatch layout, made on the device by `dispatch_layout` (see hybridep/layout.py).

    row_slot: `[capacity]` int64, the receive slot of each row (`num_slots` for padding and spare rows).
    row_code: `[capacity]` int64, `slot * L + e` of each row (`num_slots * L` for padding and spare rows).
    slot_rows: `[num_slots, L]` int32, the row of (slot, expert), -1 where none.
    tokens_per_expert: `[L]` int64, padded counts truncated to the capacity.
    overflow: `[1]` int32, 1 when the padded total exceeds the capacity.
    real_rows: `[1]` int64, min(padded total, capacity).
    """

    row_slot: torch.Tensor
    row_code: torch.Tensor
    slot_rows: torch.Tensor
    tokens_per_expert: torch.Tensor
    overflow: torch.Tensor
    real_rows: torch.Tensor


def _map_bytes(local_map: torch.Tensor) -> tuple[torch.Tensor, int]:
    if local_map.dim() != 2 or local_map.dtype is not torch.bool or local_map.stride(1) != 1:
        raise ValueError(f"fused: the routing map must be a [N, L] bool tensor of unit column stride; got {local_map}")
    return local_map.view(torch.uint8), local_map.stride(0)


def _token_block(num_local: int) -> int:
    return max(16, min(256, 4096 // _next_pow2(num_local)))


def block_counts(local_map: torch.Tensor) -> torch.Tensor:
    """`[blocks, L]` int32: the routed tokens of each local expert per block of `_token_block(L)`
    tokens (one launch); `.sum(dim=0)` gives each expert's total.

    Args:
        local_map: `[N, L]` bool, rows of any stride, columns contiguous (a column slice of the
            gathered `[N, E]` map is taken as it is).
    """
    data, stride = _map_bytes(local_map)
    num_tokens, num_local = local_map.shape
    block = _token_block(num_local)
    blocks = max(1, _cdiv(num_tokens, block))
    counts = torch.empty(blocks, num_local, dtype=torch.int32, device=local_map.device)
    _block_counts_kernel[(blocks,)](
        data, counts, num_tokens, stride, L=num_local, L_P2=_next_pow2(num_local), BLOCK_N=block
    )
    return counts


def dispatch_layout(
    local_map: torch.Tensor,
    counts: torch.Tensor,
    capacity: int,
    pad_multiple: Optional[int],
    num_slots: int,
    slot_of_token: Optional[torch.Tensor] = None,
    *,
    spare_slots: bool = False,
) -> Layout:
    """The permuted layout of `hybridep.layout.expert_layout`, with the row tables a fused
    dispatch and combine read, in one launch after `block_counts` (two in all).

    Args:
        local_map: the map `counts` came from. capacity: output rows (host int).
        num_slots: receive slots; slot of token g: g (`slot_of_token` None), or `slot_of_token[g]`
            for the tokens that have a local expert (the others get no slot).
        spare_slots: True when `num_slots` is a bound that the tokens' slots may not fill: the slot
            table's rows of slots no token takes are then -1 too (one more launch).
    """
    data, stride = _map_bytes(local_map)
    num_tokens, num_local = local_map.shape
    device = local_map.device
    row_slot = torch.empty(capacity, dtype=torch.int64, device=device)
    row_code = torch.empty(capacity, dtype=torch.int64, device=device)
    if spare_slots:
        slot_rows = torch.full((num_slots, num_local), -1, dtype=torch.int32, device=device)
    else:
        slot_rows = torch.empty(num_slots, num_local, dtype=torch.int32, device=device)
    tokens_per_expert = torch.empty(num_local, dtype=torch.int64, device=device)
    overflow = torch.empty(1, dtype=torch.int32, device=device)
    real_rows = torch.empty(1, dtype=torch.int64, device=device)
    blocks = counts.shape[0]
    _layout_kernel[(blocks,)](
        data,
        stride,
        counts,
        slot_of_token if slot_of_token is not None else row_slot,  # not read without slots
        row_slot,
        row_code,
        slot_rows,
        tokens_per_expert,
        overflow,
        real_rows,
        num_tokens,
        capacity,
        num_slots,
        pad_multiple or 1,
        blocks,
        L=num_local,
        L_P2=_next_pow2(num_local),
        BLOCK_N=_token_block(num_local),
        BLOCK_B=max(1, 4096 // _next_pow2(num_local)),
        BLOCK_S=1024,
        HAS_SLOTS=slot_of_token is not None,
    )
    return Layout(row_slot, row_code, slot_rows, tokens_per_expert, overflow, real_rows)


def sum_rows_per_slot(
    rows: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """`out[s] = sum_e rows[table[s, e]]` over the entries >= 0, added in e order in float32.

    Args:
        rows: `[C, H]`; only the rows the table names are read.
        table: `[S, L]` int32, row of slot s's e-th part or -1.
        dtype: the output dtype.
        out: where to write (`[S or more, H]`, contiguous, `dtype`), or None for a new tensor.

    Returns:
        `out` (`[S, H]` when new) in `dtype` (a slot with no rows gets zeros).
    """
    return _sum_rows(rows, table, dtype, out, None, None)


def sum_rows_per_slot_and_values(
    rows: torch.Tensor,
    table: torch.Tensor,
    dtype: torch.dtype,
    values: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    values_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sum_rows_per_slot` and, in the same launch, each slot's values by expert:
    `values_out[s, e] = values[table[s, e]]`, 0 where the entry is -1 (the probs of a combine).

    Args:
        rows, table, dtype, out: as in `sum_rows_per_slot`.
        values: `[C]`, one value per row.
        values_out: where to write the values (`[S or more, L]` in values' dtype, columns
            contiguous, rows of any stride: a column slice of a wider buffer), or None.

    Returns:
        (`out`, `values_out`: `[S, L]` when new)
    """
    if values.shape != (rows.shape[0],):
        raise ValueError(f"fused: `values` must be [{rows.shape[0]}] (one per row); got {tuple(values.shape)}")
    slots, L = table.shape
    values_out = _output(values_out, slots, L, values.dtype, values.device, row_stride=True, name="values_out")
    return _sum_rows(rows, table, dtype, out, values.contiguous(), values_out)


def _sum_rows(rows, table, dtype, out, values, values_out):
    rows, table = rows.contiguous(), table.contiguous()
    slots, L = table.shape
    H = rows.shape[1]
    out = _output(out, slots, H, dtype, rows.device)
    if slots == 0:
        return out if values is None else (out, values_out)
    block_h = _pow2(H, 1024)
    has_values = values is not None
    _sum_rows_per_slot_kernel[(slots, _cdiv(H, block_h))](
        rows,
        table,
        out,
        values if has_values else table,  # not read without values
        values_out if has_values else table,
        values_out.stride(0) if has_values else 0,
        H,
        L=L,
        L_P2=_next_pow2(L),
        BLOCK_H=block_h,
        HAS_VALUES=has_values,
    )
    return out if values is None else (out, values_out)
