"""Real Megatron-Core MoE layers on CPU gloo ranks, for tests.

`megatron_ext.tooling.cpu_ranks.use_cpu_ranks()` stands in Megatron's CUDA-only streams, device query,
host copy and CUDA RNG state with CPU ones (the bench uses the same).
"""

from __future__ import annotations

import torch

from megatron_ext.bench.modes import FLEX  # noqa: F401 - the tests import it from here
from megatron_ext.bench.stack import MOE_STACK_DEFAULTS
from megatron_ext.tooling.cpu_ranks import use_cpu_ranks
from tests.distributed import outcome_test, results_fixture


def on_gpu() -> bool:
    """True on GPU ranks (one NCCL rank per GPU, or gloo ranks sharing a GPU): layers and inputs go
    to the rank's GPU."""
    from megatron_ext.tooling.ranks import placement

    return placement().device == "cuda"


def init_megatron(world_size: int) -> None:
    """Megatron's parallel state with every rank in one expert-parallel group (the process group
    already up): CPU stand-ins on CPU ranks, Megatron's CUDA RNG on GPU ranks."""
    from megatron.core import parallel_state

    if on_gpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
        model_parallel_cuda_manual_seed(1)
        return
    use_cpu_ranks()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)


# The bench's MoE stack defaults, at the tests' small sizes.
BASE = dict(
    MOE_STACK_DEFAULTS,
    num_layers=1,
    hidden_size=16,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=24,
    params_dtype=torch.float32,
    use_cpu_initialization=True,
)


# On NCCL ranks the layers run in bfloat16: the only dtype for which torch's grouped GEMM reads no
# count on the host, so the only one capacity mode accepts on a GPU (GroupedMLP refuses others).
GPU_DTYPE = dict(params_dtype=torch.bfloat16, bf16=True)


def make_config(world_size: int, **overrides):
    from megatron_ext.options.config import HybridEPTransformerConfig

    on_device = GPU_DTYPE if on_gpu() else {}
    return HybridEPTransformerConfig(**{**BASE, **on_device, "expert_model_parallel_size": world_size, **overrides})


def moe_layer(config, experts: str = "spec", seed: int = 1234):
    """A Megatron MoELayer; experts 'spec' (Megatron's local spec: SequentialMLP), 'grouped'
    (megatron_ext's GroupedMLP), or, on a GPU with TE, 'te' / 'te-op-fuser' (Megatron's TE spec:
    TEGroupedMLP, set `use_transformer_engine_op_fuser` for the latter). Weights depend on `seed` only."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if experts == "spec":
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        submodules = spec.submodules.mlp.keywords["submodules"]
    else:
        from megatron_ext.bench.stack import experts_spec

        submodules = experts_spec(experts, config.num_moe_experts)
    torch.manual_seed(seed)
    layer = MoELayer(config, submodules=submodules, layer_number=1)
    return layer.cuda() if on_gpu() else layer


def copy_weights(source, target) -> None:
    """Load `source`'s weights into `target` (same parameter names)."""
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (missing, unexpected)


def loss_weights(out: torch.Tensor) -> torch.Tensor:
    """The weights of `run_steps`' loss, sum(out x weights): -1 to 1 across the output, in its dtype."""
    return torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype, device=out.device).view_as(out)


def run_steps(layer, inputs, wrap=None):
    """Forward + backward per input; returns [(output, input grad, {param: grad})] per step.

    `wrap(layer, x)` replaces the plain call (e.g. to checkpoint the layer).
    """
    results = []
    for x in inputs:
        x = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = wrap(layer, x) if wrap is not None else layer(x)[0]
        (out * loss_weights(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        results.append((out.detach().clone(), x.grad.clone(), grads))
    return results


def step_inputs(rank: int, steps: int, tokens: int, hidden: int, seed: int = 0):
    """Fresh `[tokens, 1, hidden]` inputs per step and rank (dynamic routing)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    inputs = [torch.randn(tokens, 1, hidden, generator=generator) for _ in range(steps)]
    return [x.cuda().to(GPU_DTYPE["params_dtype"]) for x in inputs] if on_gpu() else inputs


def assert_same_steps(expected, actual, what: str = "") -> None:
    """Two `run_steps` results, step by step: outputs, input gradients, parameter gradients, bitwise."""
    assert len(expected) == len(actual), (len(expected), len(actual))
    for step, ((out_a, dx_a, g_a), (out_b, dx_b, g_b)) in enumerate(zip(expected, actual)):
        assert torch.equal(out_a, out_b), f"{what} step {step}: output"
        assert torch.equal(dx_a, dx_b), f"{what} step {step}: input grad"
        assert g_a.keys() == g_b.keys(), (sorted(g_a), sorted(g_b))
        for name in g_a:
            assert torch.equal(g_a[name], g_b[name]), f"{what} step {step}: grad {name}"


_OVERFLOW_SCRIPT = """
import faulthandler, os, torch, torch.distributed as dist
faulthandler.dump_traceback_later({dump_after}, exit=True)  # a hang shows where it hangs, then ends
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
dist.init_process_group("nccl")
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
import megatron_ext.patches
megatron_ext.patches.apply(training=False)  # no training loop here: an overflow stops on the device
from tests.megatron_env import make_config, moe_layer
layer = moe_layer(make_config(1, **{overrides!r}, moe_hybridep_capacity_factor=1.0), experts="grouped")
x = torch.randn({tokens}, 1, {hidden}, device="cuda", dtype=torch.bfloat16)
layer(x)[0].sum().backward()
layer.token_dispatcher.capacity_manager.capacity = {capacity}
layer(x)[0].sum().backward()
torch.cuda.synchronize()
print("NO FAILURE")
"""


def overflow_on_the_device(overrides: dict, tokens: int, hidden: int, capacity: int, port: int) -> str:
    """Run, in a fresh process on GPU 0, a capacity-mode layer whose capacity is then set to
    `capacity` rows; assert that the process ended at the device-side assert with the layer's
    message, and return its output. (A device assert ends the process: it cannot run in pytest's.)
    A process that has not ended after MEGATRON_EXT_TEST_CHILD_TIMEOUT seconds (240) dumps its
    Python stacks, is ended, and fails the test with its output."""
    import os
    import subprocess
    import sys

    timeout = float(os.environ.get("MEGATRON_EXT_TEST_CHILD_TIMEOUT", "240"))
    dump_after = timeout - min(15, timeout / 10)  # the child dumps its stacks and ends itself first
    script = _OVERFLOW_SCRIPT.format(
        port=port, overrides=overrides, tokens=tokens, hidden=hidden, capacity=capacity, dump_after=dump_after
    )
    stuck = f"the overflowing layer's process had not ended after {dump_after:.0f} s (MEGATRON_EXT_TEST_CHILD_TIMEOUT)"
    try:
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    except subprocess.TimeoutExpired as stopped:  # not even the dump ended it
        from tests.distributed import timed_out_output

        raise AssertionError(f"{stuck}:\n{timed_out_output(stopped)[-6000:]}") from None
    output = result.stdout + result.stderr
    assert "Timeout (" not in output, f"{stuck}:\n{output[-6000:]}"  # faulthandler's dump ended it
    print("\n".join(line for line in output.splitlines() if "megatron-ext" in line or "Assertion" in line))
    assert result.returncode != 0 and "NO FAILURE" not in output, output[-3000:]
    assert f"capacity of {capacity} rows" in output, (
        f"the device-side assert did not carry the layer's message:\n{output[-6000:]}"
    )
    return output


def run_megatron_checks(rank: int, world_size: int, out_dir: str, checks, args_of=lambda check: ()) -> None:
    """A spawned rank's work in the Megatron test modules: Megatron's parallel state, the patch
    (without the training-loop feature: no training loop here), then each check, its outcome
    recorded (`tests.distributed.Checks`) and saved to `out_dir`. `args_of(check)`: its extra args."""
    from tests.distributed import Checks

    init_megatron(world_size)
    import megatron_ext.patches

    megatron_ext.patches.apply(training=False)
    outcomes = Checks()
    for check in checks:
        outcomes.run(check.__name__, check, rank, world_size, *args_of(check))
    outcomes.save(out_dir, rank)


def megatron_check_tests(checks, world_sizes):
    """A Megatron test module's `results` fixture (`checks` run by `run_megatron_checks` on spawned
    gloo ranks, once per world size) and its test, one case per check. In a test module:
    `results, test_x = megatron_check_tests(CHECKS, WORLD_SIZES)`."""
    return results_fixture(run_megatron_checks, world_sizes, checks), outcome_test(checks)
