"""Capacity mode in CUDA graphs on one GPU: a Megatron MoE layer's forward and backward captured
after its calibration and replayed on fresh inputs, on both implementations, with and without MoE
recompute; and Megatron's full-iteration graph with megatron-ext's overflow policy around it, an
overflow inside a replay caught, re-run blocking, the graph dropped and captured again.

Every replayed step is compared bitwise with the same layer run eagerly (same weights, same
kernels), and the torch implementation's with the blocking dispatch too.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.options import deep_ep_import_error
from tests.megatron_env import FLEX, copy_weights, loss_weights, make_config, moe_layer, run_steps, step_inputs

pytestmark = pytest.mark.gpu

HIDDEN = 256  # deep_ep's buffer takes hidden sizes from 128 on
TOKENS = 128
RECOMPUTE = {
    "no-recompute": {},
    "moe-recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "moe_act-recompute": dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True),
}


def _config(implementation: str, **overrides):
    return make_config(
        1,
        **FLEX,
        hidden_size=HIDDEN,
        moe_hybridep_implementation=implementation,
        moe_hybridep_capacity_factor=1.5,
        moe_hybridep_equal_token_counts=True,
        **overrides,
    )


def _needs(implementation: str) -> None:
    if implementation == "deep_ep" and deep_ep_import_error() is not None:
        pytest.skip(f"deep_ep does not import: {deep_ep_import_error()}")


class Captured:
    """A layer's forward and backward in one CUDA graph, after PyTorch's whole-network recipe."""

    def __init__(self, layer, example: torch.Tensor):
        self.layer = layer
        self.x = example.detach().clone().requires_grad_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one eager step on the side stream warms what capture will run
            self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def _step(self) -> torch.Tensor:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None  # made afresh by each step's backward, not accumulated
        out = self.layer(self.x)[0]
        (out * loss_weights(out)).sum().backward()
        return out

    def __call__(self, x: torch.Tensor):
        with torch.no_grad():
            self.x.copy_(x)
        self.graph.replay()
        grads = {n: p.grad.clone() for n, p in self.layer.named_parameters() if p.grad is not None}
        return self.out.detach().clone(), self.x.grad.clone(), grads


@pytest.mark.parametrize("recompute", list(RECOMPUTE), ids=list(RECOMPUTE))
@pytest.mark.parametrize("implementation", ["torch", "deep_ep"])
def test_replays_equal_eager_steps(megatron, implementation, recompute):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.megatron_env import assert_same_steps

    _needs(implementation)
    model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=True, force_reset_rng=True)
    graphed = moe_layer(_config(implementation, **RECOMPUTE[recompute]), experts="grouped")
    eager = moe_layer(_config(implementation, **RECOMPUTE[recompute]), experts="grouped", seed=7)
    copy_weights(graphed, eager)
    inputs = step_inputs(0, 6, TOKENS, HIDDEN, seed=21)
    run_steps(graphed, inputs[:1])  # the calibration, eagerly
    run_steps(eager, inputs[:1])
    manager = graphed.token_dispatcher.capacity_manager
    step = Captured(graphed, inputs[1])
    replayed = [step(x) for x in inputs[2:]]
    assert_same_steps(run_steps(eager, inputs[2:]), replayed, f"{implementation} graph")
    if implementation == "torch":
        blocking = moe_layer(make_config(1, **FLEX, hidden_size=HIDDEN, moe_hybridep_implementation="torch"), "grouped")
        copy_weights(graphed, blocking)
        assert_same_steps(run_steps(blocking, inputs[2:]), replayed, "torch graph against blocking")
    # The calibration, and with MoE recompute its blocking replay in the backward: nothing else blocked.
    assert manager.stats.calibrations == 1
    assert manager.stats.blocking_dispatches == (2 if recompute == "moe-recompute" else 1)
    # The device counters saw the replays: rows used are the rows of the last one (one rank: every row stays).
    assert int(manager.rows_used) == TOKENS * graphed.config.moe_router_topk and int(manager.overflows) == 0


def _full_iteration(layer, rerun):
    """Megatron's FullCudaGraphWrapper as its training loop builds it with megatron-ext patched,
    with Megatron's default of one memory pool for every capture (`--cuda-graph-use-single-mempool`),
    in the state of a new process."""
    from megatron.core import full_cuda_graph
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from megatron_ext.training.recovery import full_iteration_graph

    FullCudaGraphWrapper.cuda_graph["training"] = None
    FullCudaGraphWrapper.curr_iteration["training"] = 0
    full_cuda_graph._shared_graph_pool = None
    return full_iteration_graph(FullCudaGraphWrapper)(rerun, cuda_graph_warmup_steps=1, use_single_mempool=True)


def _schedule(*, model, data_iterator, num_microbatches, forward_only=False, **_):
    """Megatron's schedule in miniature; gradients accumulate in place (as in Megatron's DDP buffers)."""
    layer, losses = model[0], []
    if isinstance(data_iterator, list):  # one iterator per model chunk, as FullCudaGraphWrapper hands it
        data_iterator = data_iterator[0]
    for _ in range(num_microbatches):
        x = next(data_iterator)["x"].detach().requires_grad_(True)
        out = layer(x)[0]
        loss = (out * loss_weights(out)).sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


def _train_step(layer, graph_or_func, batch: torch.Tensor):
    for p in layer.parameters():
        if p.grad is not None:
            p.grad.zero_()
    losses = graph_or_func(
        model=[layer], data_iterator=iter([{"x": batch}]), num_microbatches=1, seq_length=TOKENS, forward_only=False
    )
    return losses[0].clone(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implementation", ["torch", "deep_ep"])
def test_an_overflow_inside_a_replayed_full_iteration_graph_is_rerun_and_recaptured(megatron, implementation):
    """Steps: 0 eager (calibrates), 1 captured with a capacity too small (set by hand: on one rank
    the rows never outgrow a calibrated capacity), so its replay overflows: re-run eagerly and
    blocking, the capacity grows, the graph is dropped; 2 eager at the new capacity; 3 captured
    again; 4 replayed. Every step's loss and gradients equal the blocking layer's, and the
    capacity-use metric reads the replay's rows."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.dispatcher import CAPACITY_USE_METRIC
    from megatron_ext.training.recovery import OverflowRerun

    _needs(implementation)
    # Megatron's RNG states as its training loop makes them with CUDA graphs (the wrapper registers them).
    model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=True, force_reset_rng=True)
    layer = moe_layer(_config(implementation), experts="grouped")
    blocking = moe_layer(
        make_config(1, **FLEX, hidden_size=HIDDEN, moe_hybridep_implementation=implementation), "grouped"
    )
    copy_weights(layer, blocking)
    manager = layer.token_dispatcher.capacity_manager
    rerun = OverflowRerun(_schedule)
    graph = _full_iteration(layer, rerun)
    inputs = step_inputs(0, 5, TOKENS, HIDDEN, seed=22)
    tracker = get_moe_metrics_tracker()
    try:
        for step, x in enumerate(inputs):
            if step == 1:
                manager.capacity = 64  # below the TOKENS x top-k rows every dispatch makes here
                # One eager step at that capacity, its overflow only recorded, as the step before a
                # capture always is: Triton compiles the kernels for a new capacity, never in a capture.
                manager.record_overflow = True
                run_steps(layer, [x])
                manager.record_overflow = False
            tracker.clear()
            loss, grads = _train_step(layer, graph, x)
            expected_loss, expected_grads = _train_step(blocking, _schedule, x)
            assert torch.equal(loss, expected_loss), step
            assert grads.keys() == expected_grads.keys()
            assert all(torch.equal(grads[n], expected_grads[n]) for n in grads), step
            captured = FullCudaGraphWrapper.cuda_graph["training"] is not None
            assert captured == (step in (3, 4)), (step, captured)
        assert rerun.reruns == 1 and manager.capacity > 64 and manager.stats.calibrations == 2
        rows = TOKENS * layer.config.moe_router_topk
        use = tracker.metrics[CAPACITY_USE_METRIC].values
        expected = torch.tensor(rows / manager.capacity, device=use.device)  # to float32's last bit
        torch.testing.assert_close(use[0], expected, rtol=2.5e-7, atol=0, msg=lambda m: f"{m} {manager.capacity}")
    finally:
        graph.reset_cuda_graph()
        tracker.clear()


def _transformer_layer(config, seed: int, norm: str = "torch"):
    """One TransformerLayer (attention + a MoE layer with megatron-ext's GroupedMLP), Megatron's
    local spec, its norms torch's or (`norm="te"`) Transformer Engine's; with
    `cuda_graph_impl='local'` in `config` it holds Megatron's per-layer graph manager."""
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.bench.stack import experts_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if norm == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TENorm
    moe = spec.submodules.mlp  # functools.partial(MoELayer, submodules=...): the same experts in both layers
    spec.submodules.mlp = functools.partial(moe.func, submodules=experts_spec("grouped", config.num_moe_experts))
    torch.manual_seed(seed)
    layer = build_module(spec, config=config, layer_number=1)
    # The local spec's norms are torch's, made in fp32 whatever params_dtype says: Megatron's
    # Float16Module casts the whole model, as this does.
    return layer.to(device="cuda", dtype=config.params_dtype) if torch.cuda.is_available() else layer


def _schedule_ending_in_capture(**kwargs):
    """`_schedule`, ended as Megatron's schedules end a step under `--cuda-graph-impl local`: by
    capturing what the step recorded (megatron-ext's patch skips that during a re-run)."""
    from megatron.core.pipeline_parallel import schedules

    losses = _schedule(**kwargs)
    if kwargs["model"][0].config.cuda_graph_impl == "local":
        schedules.create_cudagraphs()
    return losses


def _train_step_with_main_grad(layer, func, batch: torch.Tensor):
    """`_train_step` for a layer under Megatron's per-layer graphs, whose backward graph adds the
    weight gradients into each parameter's `main_grad` (Megatron's DDP buffers; made here once, as
    the graph keeps the tensor it captured): a step's gradients are `.grad` where it ran eagerly,
    `main_grad` where it replayed."""
    for p in layer.parameters():
        if not hasattr(p, "main_grad"):
            p.main_grad = torch.zeros_like(p)
        p.main_grad.zero_()
        p.grad = None
    losses = func(
        model=[layer], data_iterator=iter([{"x": batch}]), num_microbatches=1, seq_length=TOKENS, forward_only=False
    )
    grads = {n: (p.grad if p.grad is not None else p.main_grad).clone() for n, p in layer.named_parameters()}
    return losses[0].clone(), grads


@pytest.mark.parametrize("norm", ["torch", "te"])
def test_an_overflow_under_per_layer_graphs_is_rerun_and_captured_again(megatron, norm):
    """`--cuda-graph-impl local` (the whole layer) with the re-run policy, on Megatron's own graph
    manager, the layer's norms torch's or Transformer Engine's. Steps: 0 records (calibrates) and
    is captured at its end; 1 replays; before 2 the graphs are deleted and the capacity cut below
    the rows (on one rank rows never outgrow a calibrated capacity), so 2 overflows: the policy
    deletes the graphs, re-runs it eagerly and blocking without capturing, and grows the capacity;
    3 records and is captured again; 4 replays. Every step's loss and gradients equal a blocking
    layer's."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    import megatron_ext.patches as patches
    from megatron_ext.training.recovery import OverflowRerun, drop_per_layer_graphs

    if norm == "te":
        pytest.importorskip("transformer_engine.pytorch")
    elif cuda_graphs.HAVE_TE_GRAPHS:
        # Megatron then releases the layer input that torch's norm saved in C++ (its weight's
        # gradient came out wrong here): megatron-ext refuses the flags (--transformer-impl local).
        pytest.skip("torch norms under per-layer graphs where TE imports: refused at parsing")
    model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=True, force_reset_rng=True)
    shape = dict(num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0)
    graphed = _transformer_layer(_config("torch", **shape, cuda_graph_impl="local"), seed=5, norm=norm)
    blocking = _transformer_layer(
        make_config(1, **FLEX, hidden_size=HIDDEN, **shape, moe_hybridep_implementation="torch"), seed=6, norm=norm
    )
    copy_weights(graphed, blocking)
    manager = graphed.mlp.token_dispatcher.capacity_manager
    inputs = step_inputs(0, 5, TOKENS, HIDDEN, seed=23)
    with patches.patched(dispatcher=False, experts=False, arguments=False, training=True):
        rerun = OverflowRerun(_schedule_ending_in_capture)
        try:
            for step, x in enumerate(inputs):
                if step == 2:
                    drop_per_layer_graphs([graphed], "the test cuts the capacity")
                    manager.capacity = 64  # below the TOKENS x top-k rows every dispatch makes here
                loss, grads = _train_step_with_main_grad(graphed, rerun, x)
                expected_loss, expected_grads = _train_step(blocking, _schedule, x)
                assert torch.equal(loss, expected_loss), step
                assert grads.keys() == expected_grads.keys()
                params = dict(graphed.named_parameters())
                differ = {
                    n: (
                        float((grads[n].float() - expected_grads[n].float()).abs().max()),
                        params[n].grad is None,
                        float(params[n].main_grad.float().sum()),
                        float(expected_grads[n].float().sum()),
                    )
                    for n in grads
                    if not torch.equal(grads[n], expected_grads[n])
                }
                assert not differ, (
                    f"step {step}: gradients differ (max diff, .grad None, main_grad sum, expected sum): {differ}"
                )
                assert _CudagraphGlobalRecord.cudagraph_created == (step != 2), step
        finally:
            drop_per_layer_graphs([graphed], "the test ends")
    assert rerun.reruns == 1 and manager.capacity > 64
    # The calibration and the re-run: every other dispatch (the captures' too) was non-blocking.
    assert manager.stats.blocking_dispatches == 2
