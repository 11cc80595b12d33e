"""The fused row moves of a dispatch and a combine: `gather_rows` (`out[r] = src[index[r]]` for
r < n, a zero row for an index past `src`: the permute), `gather_rows_and_values` (with one value
per row, the dispatched probs, in the same launch), and `sum_rows_per_slot` (each slot's float32
sum of its rows in the order of the row table, deterministic, no atomics: the unpermute of a
combine), `sum_rows_per_slot_and_values` (with each slot's values by expert, the combined probs).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.fused.common import _cdiv, _check_count, _grid, _next_pow2, _output, _pow2, triton

if triton is not None:
    import triton.language as tl

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
