"""The fused kernels compile for A100, H100/H200 and B200 GPUs, on a machine without a GPU.

On CPU the kernels run under Triton's interpreter, which executes them with numpy and neither
type-checks nor lowers them as the GPU compiler does: a kernel can pass every CPU test and still
fail to compile on the first GPU that runs it. Here each wrapper of `megatron_ext.fused` is called
with CPU tensors while its launch is recorded instead of run; each launch is then compiled ahead
of time for sm_80, sm_90 and sm_100 (Triton's compiler and the ptxas its wheel ships), with the
argument types and constexprs the wrapper chose. What the kernels compute is the other tests' work (test_fused.py,
under the interpreter and on the GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext import fused
from megatron_ext.fused import activation as fused_activation
from megatron_ext.fused import layout as fused_layout
from megatron_ext.fused import rows as fused_rows

pytestmark = pytest.mark.skipif(
    fused.triton is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton's compiler (not its interpreter)",
)

# Each kernel by the module of `megatron_ext.fused` that defines (and launches) it.
KERNELS = {
    "_activation_probs_kernel": fused_activation,
    "_gather_rows_kernel": fused_rows,
    "_block_counts_kernel": fused_layout,
    "_layout_kernel": fused_layout,
    "_sum_rows_per_slot_kernel": fused_rows,
}
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.uint8: "*u8",
}


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _types(kernel, args, kwargs) -> tuple[dict, dict, dict]:
    """One recorded launch as Triton's compiler takes it: each argument's type, the constexprs, and
    the divisibility by 16 that Triton's launcher assumes of a pointer or an int where it holds (its
    vectorised variants: what a GPU compiles for aligned tensors)."""
    from triton.backends.compiler import BaseBackend

    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[param.name], divisible = "i1", False
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        else:
            raise AssertionError(f"{kernel.fn.__name__}: no Triton type for {param.name}={value!r}")
        if divisible:
            attrs[(param.num,)] = BaseBackend.parse_attr("D")
    return signature, constexprs, attrs


def _call_every_wrapper():
    """Every wrapper, with each choice that changes the compiled kernel (dtypes, flags, constexprs)."""
    gen = torch.Generator().manual_seed(0)
    n = torch.tensor([5])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for gated in (True, False):
            for activation in (fused.SILU, fused.GELU):
                h = torch.randn(8, 32 if gated else 16, generator=gen).to(dtype)
                probs, grad = torch.rand(8, generator=gen), torch.randn(8, 16, generator=gen).to(dtype)
                fused.activation_probs(h, probs, n, gated=gated, activation=activation)
                fused.activation_probs_backward(grad, h, probs, n, gated=gated, activation=activation)
        src, index = torch.randn(20, 24, generator=gen).to(dtype), torch.randint(0, 21, (12,), generator=gen)
        fused.gather_rows(src, index, n)
        fused.gather_rows(src, index, n, out=torch.empty(12, 32).to(dtype)[:, :24])
        fused.gather_rows_and_values(src, index, n, torch.rand(4, 8)[:, :3], index)
        table = torch.randint(-1, 12, (6, 3), generator=gen, dtype=torch.int32)
        fused.sum_rows_per_slot(src, table, dtype)
        fused.sum_rows_per_slot_and_values(src[:12], table, dtype, torch.rand(12), values_out=torch.rand(6, 8)[:, :3])
    # The large bench's sizes: H 4096 bf16, FFN 1024, 32 local experts (the widest blocks).
    big = torch.randn(8, 4096, generator=gen).to(torch.bfloat16)
    fused.gather_rows_and_values(big, index[:8], n, torch.rand(16, 32), index[:8])
    fused.sum_rows_per_slot_and_values(
        big, torch.randint(-1, 8, (4, 32), generator=gen, dtype=torch.int32), big.dtype, torch.rand(8)
    )
    fused.activation_probs(
        torch.randn(8, 2048, generator=gen).to(torch.bfloat16), torch.rand(8), n, gated=True, activation=fused.SILU
    )
    fused.dispatch_layout(
        torch.rand(64, 256, generator=gen)[:, 32:64] < 0.1, torch.zeros(1, 32, dtype=torch.int32), 96, 128, 64
    )
    local_map = torch.rand(64, 16, generator=gen) < 0.3
    counts = torch.zeros(4, 4, dtype=torch.int32)  # the counts' values are not read when recording
    fused.block_counts(local_map[:, 4:8])
    fused.dispatch_layout(local_map[:, 4:8], counts, 96, None, 64)
    fused.dispatch_layout(local_map[:, 4:8], counts, 96, 16, 128, torch.arange(64), spare_slots=True)


def _recorded_launches(monkeypatch) -> list:
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(KERNELS[name], name, _Recorder(getattr(KERNELS[name], name), launches))
    _call_every_wrapper()
    return launches


def test_every_kernel_is_launched_by_the_calls(monkeypatch):
    """The calls reach every kernel of megatron_ext.fused (a new kernel must join KERNELS and _call_every_wrapper)."""
    jitted = {
        name
        for module in (fused_activation, fused_layout, fused_rows)
        for name, value in vars(module).items()
        if type(value).__name__ == "JITFunction"
    }
    assert jitted - {"_activate", "_activate_grad"} == set(KERNELS)
    launched = {kernel.fn.__name__ for kernel, _, _ in _recorded_launches(monkeypatch)}
    assert launched == set(KERNELS)


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_launch_compiles_for_the_gpu(monkeypatch, arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = {}
    for kernel, args, kwargs in _recorded_launches(monkeypatch):
        signature, constexprs, attrs = _types(kernel, args, kwargs)
        key = (kernel.fn.__name__, repr(signature), repr(constexprs), repr(attrs))
        launches[key] = (kernel, signature, constexprs, attrs)
    failed = []
    for (name, signature, constexprs, _), (kernel, types, values, attrs) in launches.items():
        source = ASTSource(fn=kernel, signature=types, constexprs=values, attrs=attrs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        except Exception as exc:  # the compiler's error names the line; report every failing launch
            failed.append(f"{name} {signature} {constexprs}:\n{str(exc)[-2000:]}")
            continue
        assert compiled.asm.get("cubin"), f"{name}: no cubin for sm_{arch}"
    assert not failed, "\n\n".join(failed)
