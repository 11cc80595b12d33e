"""GroupedMLP (megatron_ext.experts) against a float64 per-expert reference, in one process.

The reference reads the weights from the module's state dict (TEGroupedMLP's per-expert keys), so
it knows nothing of the stacked layout inside. The inputs carry padding rows past
sum(tokens_per_expert) filled with NaN and 1e30: they must give exact zeros and never leak.
CPU throughout; the `gpu`-marked cases repeat them on CUDA and add a torch_dist checkpoint test.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext import fused
from megatron_ext.experts import GroupedMLP
from megatron_ext.tooling.sync import forbid_host_sync

L, H, FFN = 4, 16, 24
COUNTS = [5, 0, 7, 3]  # an empty expert in the middle
PAD = 9


@pytest.fixture(scope="module")
def pg(gloo_group):
    groups = ProcessGroupCollection()
    groups.ep = groups.expt_tp = groups.expt_dp = gloo_group
    return groups


def _config(dtype=torch.float32, gated=True, bias=False, **overrides) -> TransformerConfig:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        num_moe_experts=L,
        moe_ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        params_dtype=dtype,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=bias,
    )
    for name, value in overrides.items():  # set after validation: some are refused only by us
        setattr(cfg, name, value)
    return cfg


def _experts(pg, seed=0, device="cpu", **cfg) -> GroupedMLP:
    """A GroupedMLP whose weights and biases (std 0.3, so the GEMMs matter) came in by its state dict."""
    module = GroupedMLP(L, _config(use_cpu_initialization=device == "cpu", **cfg), pg_collection=pg)
    assert module.linear_fc1.weight.device.type == device
    gen = torch.Generator().manual_seed(seed)
    state = {
        k: (v if k.endswith("_extra_state") else (0.3 * torch.randn(v.shape, generator=gen)).to(v.dtype))
        for k, v in module.state_dict().items()
    }
    module.load_state_dict(state)
    return module


def _inputs(dtype, counts=COUNTS, pad=PAD, seed=1, device="cpu"):
    """x [P, H], counts [L] int64, probs [P] float32, on `device`; the pad rows hold NaN and 1e30."""
    gen = torch.Generator().manual_seed(seed)
    real = sum(counts)
    x = torch.randn(real + pad, H, generator=gen).to(dtype)
    probs = torch.rand(real + pad, generator=gen)
    x[real::2], x[real + 1 :: 2], probs[real:] = float("nan"), 1e30, float("nan")
    return x.to(device), torch.tensor(counts, device=device), probs.to(device)


def _reference(params, cfg, x, counts, probs):
    """What TEGroupedMLP computes, one expert at a time, for the real rows of x (a [sum, H] tensor)."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows, p = x[start : start + n], probs[start : start + n, None]
        h = rows @ params[f"linear_fc1.weight{e}"].T
        if cfg.add_bias_linear:
            h = h + params[f"linear_fc1.bias{e}"]
        if cfg.gated_linear_unit:
            gate, linear = h.chunk(2, dim=-1)
            if (c := cfg.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=c), linear.clamp(min=-c, max=c)
            h = cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)
        else:
            h = cfg.activation_func(h)
        y = (h * p) @ params[f"linear_fc2.weight{e}"].T
        if cfg.add_bias_linear:
            y = y + params[f"linear_fc2.bias{e}"] * p
        out.append(y)
        start += n
    return torch.cat(out)


def _output_grad(x, real, seed=2):
    """A random gradient for the output, NaN on the pad rows (which must not matter)."""
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x)
    grad[real:] = float("nan")
    return grad


def _takes_fused_path(module, x) -> bool:
    """Whether `module` runs the Triton path for `x` (GPU, or CPU under TRITON_INTERPRET=1)."""
    return module._fused_activation is not None and fused.enabled_for(x)


def _run(module, x, counts, probs, grad):
    """Forward, then backward of `grad`; returns the output, grad, and the input and probs gradients."""
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, counts, probs)
    assert bias is None and out.shape == x.shape and out.dtype == x.dtype
    out.backward(grad)
    return out.detach(), grad, x.grad, probs.grad


def _grads_per_expert(module):
    """The module's parameter gradients under their state-dict names (weight{i} / bias{i})."""
    grads = {}
    for linear in ("linear_fc1", "linear_fc2"):
        for pname, param in getattr(module, linear).named_parameters():
            for i in range(L):
                grads[f"{linear}.{pname}{i}"] = param.grad[i]
    return grads


CASES = [
    pytest.param(dict(dtype=torch.float32, gated=True), id="fp32-swiglu"),
    pytest.param(dict(dtype=torch.float32, gated=False), id="fp32-gelu"),
    pytest.param(dict(dtype=torch.float32, gated=True, bias=True), id="fp32-swiglu-bias"),
    pytest.param(
        dict(dtype=torch.float32, gated=True, activation_func_clamp_value=0.5, glu_linear_offset=1.0),
        id="fp32-swiglu-clamp-offset",
    ),
    pytest.param(dict(dtype=torch.bfloat16, gated=True), id="bf16-swiglu"),
    pytest.param(dict(dtype=torch.bfloat16, gated=False, bias=True), id="bf16-gelu-bias"),
]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", CASES)
@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0, 0], [6, 1, 0, 4]], ids=["gap", "all-empty", "tail-empty"])
def test_forward_and_backward_match_reference(pg, cfg, counts, device):
    module = _experts(pg, device=device, **cfg)
    x, counts, probs = _inputs(cfg["dtype"], counts, device=device)
    real = int(counts.sum())
    out, grad, x_grad, probs_grad = _run(module, x, counts, probs, _output_grad(x, real))

    # Forward: the real rows as the float64 reference, with no NaN from the pad rows; the torch
    # path writes zeros past them, the fused path leaves them unwritten (nothing reads them).
    masks_pad_rows = not _takes_fused_path(module, x)
    params = {
        k: v.detach().double().requires_grad_() for k, v in module.state_dict().items() if "_extra_state" not in k
    }
    ref_x, ref_probs = x[:real].double().requires_grad_(), probs[:real].double().requires_grad_()
    ref = _reference(params, module.config, ref_x, counts, ref_probs)
    tol = _tolerance(cfg["dtype"])
    torch.testing.assert_close(out[:real].double(), ref.detach(), **tol)
    assert not out[:real].isnan().any()
    if masks_pad_rows:
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))

    # Backward: x, probs and every weight as the reference's autograd; the pad rows' gradients zero.
    if real:
        ref.backward(grad[:real].double())
    torch.testing.assert_close(x_grad[:real].double(), ref_x.grad if real else ref_x, **tol)
    torch.testing.assert_close(probs_grad[:real].double(), ref_probs.grad if real else ref_probs, **tol)
    assert torch.equal(probs_grad[real:], torch.zeros_like(probs_grad[real:]))
    if masks_pad_rows:
        assert torch.equal(x_grad[real:], torch.zeros_like(x_grad[real:]))
    grads = _grads_per_expert(module)
    assert sorted(grads) == sorted(params)
    for name, g in grads.items():
        expected = params[name].grad if params[name].grad is not None else torch.zeros_like(params[name])
        torch.testing.assert_close(g.double(), expected, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [CASES[2], CASES[4]])
def test_padding_rows_change_nothing_bitwise(pg, cfg, device):
    """The same real rows with P = sum and P = sum + 13 garbage rows: bitwise equal results."""
    module = _experts(pg, device=device, **cfg)
    x, counts, probs = _inputs(cfg["dtype"], pad=13, device=device)
    real = int(counts.sum())
    padded = _run(module, x, counts, probs, _output_grad(x, real))
    padded_grads = {k: v.clone() for k, v in _grads_per_expert(module).items()}
    exact = _run(module, x[:real], counts, probs[:real], _output_grad(x, real)[:real])
    for a, b in zip(padded, exact):
        assert torch.equal(a[:real], b)
    assert all(torch.equal(g, padded_grads[k]) for k, g in _grads_per_expert(module).items())


@pytest.mark.skipif(fused.interpreting(), reason="Triton's interpreter copies every tensor to the host")
@pytest.mark.parametrize("device", DEVICES)
def test_no_host_sync(pg, device):
    module = _experts(pg, device=device, dtype=torch.bfloat16, bias=True)
    x, counts, probs = _inputs(torch.bfloat16, device=device)
    grad = _output_grad(x, sum(COUNTS))
    with forbid_host_sync():  # on CUDA also torch's sync-debug mode "error"
        out, _, x_grad, probs_grad = _run(module, x, counts, probs, grad)
    assert out.shape == x.shape and x_grad.shape == x.shape and probs_grad.shape == probs.shape


def test_counts_past_the_rows_are_cut_at_p(pg):
    """A sum of counts above P (which a capacity dispatcher never hands over) reads no row past P:
    the experts see the first P rows, as if the last counts had been cut to fit."""
    module = _experts(pg)
    x, counts, probs = _inputs(torch.float32, pad=0)  # 15 rows
    cut = torch.tensor([5, 0, 5, 0])
    torch.testing.assert_close(module(x[:10], counts, probs[:10])[0], module(x[:10], cut, probs[:10])[0])


def test_offsets_a_dispatch_attached_to_its_counts_are_used_for_its_rows_only(pg):
    """Counts carrying the offsets their dispatch made (`fused.attach_offsets`) are split by those
    offsets, not summed again; for another row count they are ignored."""
    module = _experts(pg)
    x, counts, probs = _inputs(torch.float32)  # 15 real rows + 9 (unwritten on the fused path: not compared)
    rows, real = x.shape[0], sum(COUNTS)
    as_counted = module(x, counts, probs)[0][:real]
    other = torch.tensor([3, 4, 2, 6])  # the same 15 rows, split otherwise
    as_other = module(x, other, probs)[0][:real]
    assert not torch.equal(as_counted, as_other)
    carrying = counts.clone()
    fused.attach_offsets(carrying, rows, torch.cumsum(other, 0, dtype=torch.int32))
    assert torch.equal(module(x, carrying, probs)[0][:real], as_other)  # the attached offsets split the rows
    assert torch.equal(module(x[: rows - 1], carrying, probs[: rows - 1])[0][:real], as_counted)  # not for P - 1


def _under_megatron_ddp(module) -> list:
    """The module's parameters as Megatron's DDP leaves them: an fp32 `main_grad` (zeros),
    `grad_added_to_main_grad` False, and DDP's own backward hook on autograd's accumulation, bound
    to a stand-in with no bucket communication (overlap_grad_reduce off). Returns the accumulation
    nodes (the hooks live as long as they do)."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel

    ddp = SimpleNamespace(param_to_bucket_group={}, ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    nodes = []
    for param in module.parameters():
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        param.grad_added_to_main_grad = False
        ddp.param_to_bucket_group[param] = None
        node = param.expand_as(param).grad_fn.next_functions[0][0]
        node.register_hook(DistributedDataParallel._make_backward_post_hook(ddp, param))
        nodes.append(node)
    return nodes


@pytest.mark.parametrize("cfg", [CASES[2], CASES[4]])
def test_under_megatron_ddp_the_backward_adds_the_gradients_into_main_grad(pg, cfg):
    """Two micro-batches under Megatron's DDP hook: each parameter's main_grad is bitwise the fp32
    sum the hook alone makes of the plain module's gradients, added once; the backward made the
    additions (the parameters say so, and carry TE's mark that their returned gradients need no
    copy), and DDP's hook left `.grad` empty. Both paths: the fused one under Triton's interpreter."""
    plain, under_ddp = _experts(pg, **cfg), _experts(pg, **cfg)
    nodes = _under_megatron_ddp(under_ddp)
    expected = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in plain.named_parameters()}
    for micro_batch in range(2):
        x, counts, probs = _inputs(cfg["dtype"], seed=10 + micro_batch)
        grad = _output_grad(x, sum(COUNTS), seed=20 + micro_batch)
        _run(plain, x, counts, probs, grad)
        for name, param in plain.named_parameters():
            expected[name].add_(param.grad)
        for param in under_ddp.parameters():
            param.grad_added_to_main_grad = False  # as DDP's zero_grad_buffer leaves it each step
        x_in, probs_in = x.clone().requires_grad_(), probs.clone().requires_grad_()
        under_ddp(x_in, counts, probs_in)[0].backward(grad)
    assert nodes
    for name, param in under_ddp.named_parameters():
        assert torch.equal(param.main_grad, expected[name]), name
        assert param.grad is None and param.grad_added_to_main_grad and param.skip_backward_post_hook, name


def test_the_backward_adds_into_main_grad_itself_and_only_under_megatron_ddps_convention(pg):
    """Without DDP's hook the gradient is in main_grad after the backward (the experts added it);
    a main_grad without DDP's flag, or one Megatron-FSDP fetches (`get_main_grad`), or a
    forward without autograd leaves the ordinary path: `.grad`, main_grad untouched, no mark."""
    module = _experts(pg, dtype=torch.bfloat16)
    x, counts, probs = _inputs(torch.bfloat16)
    grad = _output_grad(x, sum(COUNTS))
    _run(module, x, counts, probs, grad)
    plain = {n: p.grad.float() for n, p in module.named_parameters()}
    for param in module.parameters():
        param.grad = None
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
        param.grad_added_to_main_grad = False
    module(x, counts, probs)[0].backward(grad)
    for name, param in module.named_parameters():
        assert torch.equal(param.main_grad, plain[name]) and param.grad_added_to_main_grad, name

    for unlike_ddp in ("no flag", "fsdp", "no grad"):
        module = _experts(pg, dtype=torch.bfloat16)
        for param in module.parameters():
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
            if unlike_ddp != "no flag":
                param.grad_added_to_main_grad = False
            if unlike_ddp == "fsdp":
                param.get_main_grad = lambda: None
        if unlike_ddp == "no grad":
            with torch.no_grad():
                module(x, counts, probs)
        else:
            _run(module, x, counts, probs, grad)
        for name, param in module.named_parameters():
            assert not param.main_grad.any() and not hasattr(param, "skip_backward_post_hook"), (unlike_ddp, name)
            if unlike_ddp != "no grad":
                assert torch.equal(param.grad.float(), plain[name]), (unlike_ddp, name)


class _OutputOnly(torch.nn.Module):
    """The experts' output alone (TE's graphs take tensors out, not GroupedMLP's (out, None))."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, counts, probs):
        return self.experts(x, counts, probs)[0]


def _weight_shaped_clones(graphed, inputs, grad) -> int:
    """How many `aten::clone`s of an expert weight's shape one replay of `graphed`, forward and
    backward, makes."""
    shapes = [list(p.shape) for p in graphed.parameters() if p.dim() == 3]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        graphed(*inputs).backward(grad)
    torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name == "aten::clone" and e.input_shapes and e.input_shapes[0] in shapes)


@pytest.mark.gpu
def test_under_tes_per_layer_graphs_the_weight_gradients_reach_main_grad_without_a_copy(pg):
    """Transformer Engine's graphs of the fused experts under Megatron's DDP hook: two replayed
    micro-batches leave in main_grad bitwise the fp32 sum of an eager module's gradients, and TE
    copies no expert weight's gradient out of the graph (it does for a module without DDP's
    main_grad: the control, which shows the count can see a copy).

    All of it on a side stream, as Megatron's initialisation sets one for `--cuda-graph-impl
    transformer_engine` before DDP is built: DDP keeps each parameter's AccumulateGrad node, whose
    stream is the one current when the node was made, and TE's backward capture then waits on that
    stream; on the legacy default stream that wait is illegal during capture
    (cudaErrorStreamCaptureImplicit)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    with torch.cuda.stream(torch.cuda.Stream()):
        _graphed_experts_under_ddp(te, pg)


def _graphed_experts_under_ddp(te, pg) -> None:
    x0, counts, probs0 = _inputs(torch.bfloat16, pad=0, device="cuda")
    batches = []
    for micro_batch in range(2):
        x, _, probs = _inputs(torch.bfloat16, pad=0, seed=30 + micro_batch, device="cuda")
        batches.append((x, probs, _output_grad(x, sum(COUNTS), seed=40 + micro_batch)))

    eager = _experts(pg, device="cuda", dtype=torch.bfloat16)
    expected = {n: torch.zeros(p.shape, dtype=torch.float32, device="cuda") for n, p in eager.named_parameters()}
    for x, probs, grad in batches:
        _run(eager, x, counts, probs, grad)
        for name, param in eager.named_parameters():
            expected[name].add_(param.grad)

    def graphed_experts(under_ddp: bool):
        wrapper = _OutputOnly(_experts(pg, device="cuda", dtype=torch.bfloat16))
        nodes = _under_megatron_ddp(wrapper.experts) if under_ddp else []
        sample = (x0.clone().requires_grad_(), counts, probs0.clone().requires_grad_())
        graphed = te.make_graphed_callables(wrapper, sample, num_warmup_iters=2, allow_unused_input=True)
        for param in wrapper.experts.parameters():  # TE's warm-up backwards ran: start the step clean
            param.grad = None
            if under_ddp:
                param.main_grad.zero_()
        return graphed, wrapper.experts, nodes

    control, _, _ = graphed_experts(under_ddp=False)
    x, probs, grad = batches[0]
    if _weight_shaped_clones(control, (x.clone().requires_grad_(), counts, probs.clone().requires_grad_()), grad) == 0:
        pytest.skip("this Transformer Engine hands its graphs' parameter gradients out without copying them")

    graphed, experts, nodes = graphed_experts(under_ddp=True)
    assert nodes
    copies = 0
    for x, probs, grad in batches:
        copies += _weight_shaped_clones(
            graphed, (x.clone().requires_grad_(), counts, probs.clone().requires_grad_()), grad
        )
    assert copies == 0
    for name, param in experts.named_parameters():
        assert param.grad is None and torch.equal(param.main_grad, expected[name]), name


def test_default_process_groups(pg):
    """pg_collection=None takes Megatron's default MoE groups (parallel_state)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        module = GroupedMLP(L, _config())
        assert module.ep_group.size() == 1 and module.tp_group.size() == 1
    finally:
        parallel_state.destroy_model_parallel()


def _te_grouped_mlp_keys(bias: bool) -> list[str]:
    """TEGroupedMLP's state-dict keys: TE GroupedLinear registers weight{i} then bias{i} per GEMM,
    and every TE module saves an `_extra_state` (an empty uint8 tensor when no fp8 state is kept)."""
    keys = []
    for linear in ("linear_fc1", "linear_fc2"):
        for i in range(L):
            keys += [f"{linear}.weight{i}"] + ([f"{linear}.bias{i}"] if bias else [])
        keys.append(f"{linear}._extra_state")
    return keys


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_state_dict_is_te_grouped_mlp_layout(pg, bias, gated):
    state = GroupedMLP(L, _config(gated=gated, bias=bias), pg_collection=pg).state_dict()
    assert list(state) == _te_grouped_mlp_keys(bias)
    fc1_out = 2 * FFN if gated else FFN
    for i in range(L):
        assert state[f"linear_fc1.weight{i}"].shape == (fc1_out, H)
        assert state[f"linear_fc2.weight{i}"].shape == (H, FFN)
        if bias:
            assert state[f"linear_fc1.bias{i}"].shape == (fc1_out,)
            assert state[f"linear_fc2.bias{i}"].shape == (H,)
    for linear in ("linear_fc1", "linear_fc2"):
        extra = state[f"{linear}._extra_state"]
        assert extra.dtype == torch.uint8 and extra.numel() == 0


def test_state_dict_round_trip_and_load(pg):
    source = _experts(pg, bias=True)
    x, counts, probs = _inputs(torch.float32)
    out = source(x, counts, probs)[0]

    # Round trip into a module initialised differently: same weights, same outputs.
    target = GroupedMLP(L, _config(bias=True), pg_collection=pg)
    target.load_state_dict(source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    assert torch.equal(target(x, counts, probs)[0], out)

    # A modified dict changes the outputs accordingly: doubling expert 2's fc2 weight and bias doubles
    # exactly its rows (rows 5..11), and nothing else.
    state = source.state_dict()
    state["linear_fc2.weight2"] = state["linear_fc2.weight2"] * 2
    state["linear_fc2.bias2"] = state["linear_fc2.bias2"] * 2
    target.load_state_dict(state)
    changed = target(x, counts, probs)[0]
    assert torch.equal(changed[5:12], 2 * out[5:12])
    assert torch.equal(changed[:5], out[:5]) and torch.equal(changed[12:], out[12:])

    # The dist-checkpoint form (per-expert `_extra_state{i}`, from TE) and TE's single-grouped form
    # (one stacked `weight`) load too.
    state = dict(source.state_dict())
    state |= {f"linear_fc1._extra_state{i}": torch.empty(0, dtype=torch.uint8) for i in range(1, L)}
    state["linear_fc2.weight"] = torch.stack([state.pop(f"linear_fc2.weight{i}") for i in range(L)])
    target = GroupedMLP(L, _config(bias=True), pg_collection=pg)
    target.load_state_dict(state)
    assert torch.equal(target(x, counts, probs)[0], out)

    # An incomplete set of per-expert weights is reported, not silently half-loaded.
    state = source.state_dict()
    del state["linear_fc1.weight3"]
    with pytest.raises(RuntimeError, match="linear_fc1.weight"):
        target.load_state_dict(state)


@pytest.mark.parametrize("ep, allreduce", [(1, True), (2, False)])
def test_params_are_marked_as_megatron_expert_params(pg, ep, allreduce):
    module = GroupedMLP(L, _config(bias=True, expert_model_parallel_size=ep), pg_collection=pg)
    params = dict(module.named_parameters())
    assert sorted(params) == ["linear_fc1.bias", "linear_fc1.weight", "linear_fc2.bias", "linear_fc2.weight"]
    assert all(p.allreduce is allreduce for p in params.values())
    # TE's column (fc1) / row (fc2) attributes, one axis further in for the stacked expert axis.
    assert params["linear_fc1.weight"].partition_dim == 1 and params["linear_fc2.weight"].partition_dim == 2
    assert not params["linear_fc2.bias"].tensor_model_parallel


def test_sharded_state_dict_is_te_grouped_mlp_global_layout(pg):
    """One ShardedTensor per stacked parameter, at the global key and shape TEGroupedMLP writes."""
    module = GroupedMLP(L, _config(bias=True), pg_collection=pg)
    entries = module.sharded_state_dict(prefix="mlp.experts.", sharded_offsets=((0, 3, 8),))
    weight = entries["mlp.experts.linear_fc1.weight"]
    assert weight.key == "mlp.experts.experts.linear_fc1.weight" and weight.data is module.linear_fc1.weight
    assert weight.global_shape == (8, L, 2 * FFN, H) and weight.global_offset == (3, 0, 0, 0)
    assert entries["mlp.experts.linear_fc2.bias"].global_shape == (8, L, H)
    extras = [f"mlp.experts.linear_fc2._extra_state{i or ''}" for i in range(L)]
    assert [entries[k].global_offset for k in extras] == [(3, i) for i in range(L)]
    assert {entries[k].key for k in extras} == {"mlp.experts.experts.linear_fc2._extra_state"}


def test_grouped_mlp_has_what_the_checkpoint_functions_read(pg):
    """experts_checkpoint reads GroupedMLP and its linears through protocols, so that it imports
    nothing of megatron_ext.experts (no import circle): the modules must keep what they name."""
    from megatron_ext.experts import checkpoint as experts_checkpoint

    module = GroupedMLP(L, _config(bias=True), pg_collection=pg)
    for protocol, instances in (
        (experts_checkpoint.StackedExperts, [module]),
        (experts_checkpoint.StackedLinear, [module.linear_fc1, module.linear_fc2]),
    ):
        names = [*protocol.__annotations__, *(n for n in vars(protocol) if not n.startswith("_"))]
        assert names, protocol
        for instance in instances:
            assert all(hasattr(instance, name) for name in names), (protocol.__name__, names)
    assert module.linear_fc1.num_experts == module.num_local_experts == L
    assert module.linear_fc1.weight.shape[0] == L  # the stacked layout the functions split per expert


REFUSED = [
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size"),
    (dict(expert_gtp_weight_remat_size=2), "--expert-tensor-parallel-num-weight-shards"),
    (dict(moe_mlp_glu_interleave_size=8), "--moe-mlp-glu-interleave-size"),
    (dict(moe_latent_size=8), "--moe-latent-size"),
    (dict(fp8="e4m3"), "--fp8-format"),
    (dict(fp4="e2m1"), "--fp4-format"),
    (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input"),
    (dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), "--overlap-dispatch-backward-with-experts-wgrad"),
    (dict(dtype=torch.bfloat16, hidden_size=12), "--hidden-size"),
    (dict(dtype=torch.bfloat16, moe_ffn_hidden_size=20), "--moe-ffn-hidden-size"),
    (dict(dtype=torch.float32, moe_ffn_hidden_size=22), "--moe-ffn-hidden-size"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]), "--offload-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), "--offload-modules"),
]


@pytest.mark.parametrize("overrides, flag", REFUSED, ids=[f for _, f in REFUSED])
def test_refused_configurations_name_the_flag(pg, overrides, flag):
    with pytest.raises(ValueError, match=re.escape(flag)) as refused:
        GroupedMLP(L, _config(moe_hybridep_capacity_factor=1.5, **overrides), pg_collection=pg)
    # The user named other experts: the message says capacity mode built these, and the ways around.
    message = str(refused.value)
    assert "the experts --moe-hybridep-capacity-factor builds here" in message, message
    assert "--use-transformer-engine-op-fuser" in message and "drop --moe-hybridep-capacity-factor" in message


@pytest.mark.parametrize("overrides, flag", REFUSED, ids=[f for _, f in REFUSED])
def test_a_dry_run_refuses_as_the_build_does(pg, overrides, flag):
    """`check_experts` (the example's dry run) runs the build's own check: the same refusal, word for word."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_ext.patches._moe_layer import check_experts

    config = _config(moe_hybridep_capacity_factor=1.5, **overrides)
    with pytest.raises(ValueError) as built:
        GroupedMLP(L, config, pg_collection=pg)
    with pytest.raises(ValueError) as checked:
        check_experts(config, MoESubmodules(experts=GroupedMLP))
    assert str(checked.value) == str(built.value) and flag in str(checked.value)
    check_experts(config, MoESubmodules(experts=torch.nn.Identity))  # other experts: their own build checks


def test_without_capacity_mode_a_refusal_names_the_spec_that_chose_these_experts(pg):
    # The example's local spec builds GroupedMLP for --moe-grouped-gemm in either mode.
    with pytest.raises(ValueError) as refused:
        GroupedMLP(L, _config(expert_tensor_parallel_size=2), pg_collection=pg)
    message = str(refused.value)
    assert message.startswith("megatron_ext GroupedMLP, the experts this layer spec names, does not support expert")
    assert "set it to 1 (Megatron sets it to --tensor-model-parallel-size" in message
    assert "--moe-hybridep-capacity-factor" not in message


def test_16_byte_rows_are_accepted(pg):
    GroupedMLP(L, _config(dtype=torch.float32, moe_ffn_hidden_size=20), pg_collection=pg)  # 80-byte rows


def _te_layout_sharded_state_dict(module, prefix, layer):
    """What TEGroupedMLP writes for `module`'s weights, built apart from GroupedMLP's code: one
    ShardedTensor per expert under a prepended expert axis, fc1's GLU halves as two chunks, and
    one (empty) `_extra_state` object per expert."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    entries, state = {}, module.state_dict()
    for name in ("linear_fc1", "linear_fc2"):
        key = f"{prefix}experts.{name}."
        for i in range(L):
            weight = state[f"{name}.weight{i}"].detach().clone()
            if name == "linear_fc1" and module.config.gated_linear_unit:
                entries[f"{name}.weight{i}"] = [
                    ShardedTensor.from_rank_offsets(
                        key + "weight", half, layer, (1, i, L), (2, j, 2), prepend_axis_num=2
                    )
                    for j, half in enumerate(weight.chunk(2))
                ]
            else:
                entries[f"{name}.weight{i}"] = ShardedTensor.from_rank_offsets(
                    key + "weight", weight, layer, (1, i, L), prepend_axis_num=2
                )
            entries[f"{name}._extra_state{i or ''}"] = make_sharded_object_for_checkpoint(
                torch.empty(0, dtype=torch.uint8), key + "_extra_state", (layer, (1, i, L)), replica_id=0
            )
    return entries


@pytest.mark.gpu
def test_dist_checkpoint_interchanges_with_te_layout(pg, tmp_path):
    """Megatron's torch_dist checkpoints (which need CUDA): ours loads what TEGroupedMLP's layout
    wrote, and TEGroupedMLP's layout loads what ours wrote."""
    from megatron.core import dist_checkpointing

    prefix, layer = "decoder.layers.0.mlp.", (0, 0, 1)  # a model of one layer: a save must cover all
    (tmp_path / "te").mkdir(), (tmp_path / "ours").mkdir()
    source = _experts(pg, device="cuda", dtype=torch.bfloat16)
    dist_checkpointing.save(_te_layout_sharded_state_dict(source, prefix, layer), str(tmp_path / "te"))
    target = _experts(pg, seed=5, device="cuda", dtype=torch.bfloat16)
    loaded = dist_checkpointing.load(target.sharded_state_dict(prefix, (layer,)), str(tmp_path / "te"))
    target.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items()})
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))

    source = _experts(pg, seed=7, device="cuda", dtype=torch.bfloat16)
    dist_checkpointing.save(source.sharded_state_dict(prefix, (layer,)), str(tmp_path / "ours"))
    request = _te_layout_sharded_state_dict(_experts(pg, seed=9, device="cuda", dtype=torch.bfloat16), prefix, layer)
    loaded = dist_checkpointing.load(request, str(tmp_path / "ours"))
    for name, expected in source.state_dict().items():
        if "weight" in name:
            got = loaded[name]
            assert torch.equal(torch.cat(got) if isinstance(got, list) else got, expected), name


MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"])


def _saved_bytes(module, x, counts, probs) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bytes the forward leaves saved for the backward (each storage once, as it stands once the
    forward has returned), and the output, x and probs of that forward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = module(x, counts, probs)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in params), out, x, probs


@pytest.mark.parametrize("cfg", [CASES[2], CASES[4], CASES[5]])
def test_moe_act_recompute_frees_the_activation_and_changes_nothing(pg, cfg):
    """--recompute-modules moe_act: bitwise the same outputs and gradients, and no longer saved for
    the backward: with GLU silu(gate), silu(gate) * linear and the weighted output (3 [P, FFN]
    tensors); without GLU the activation's output and the weighted output (2)."""
    plain = _experts(pg, **cfg)
    recomputed = _experts(pg, **cfg, **MOE_ACT)
    assert recomputed.activation_recompute and not plain.activation_recompute
    x, counts, probs = _inputs(cfg["dtype"], device="cpu")
    grad = _output_grad(x, sum(COUNTS))
    expected = _run(plain, x, counts, probs, grad)
    expected_grads = {k: v.clone() for k, v in _grads_per_expert(plain).items()}
    actual = _run(recomputed, x, counts, probs, grad)
    real = sum(COUNTS)  # rows past it are unwritten on the fused path
    for what in (0, 2, 3):  # the output, and the gradients of x and probs
        assert torch.equal(expected[what][:real], actual[what][:real]), what
    assert all(torch.equal(g, expected_grads[k]) for k, g in _grads_per_expert(recomputed).items())

    rows, element = x.shape[0], x.element_size()
    without, _, _, _ = _saved_bytes(plain, x, counts, probs)
    with_recompute, out, x_in, probs_in = _saved_bytes(recomputed, x, counts, probs)
    # The fused path keeps no activation output with or without the flag: nothing more to free.
    freed = 0 if _takes_fused_path(plain, x) else 3 if recomputed.config.gated_linear_unit else 2
    assert without - with_recompute == freed * rows * FFN * element, (without, with_recompute)
    out.backward(grad)  # the released output is recomputed for the backward, twice in a row too
    assert x_in.grad is not None and torch.equal(x_in.grad[:real], actual[2][:real])
    assert torch.equal(probs_in.grad, actual[3])


def test_moe_act_recompute_without_grad_and_under_the_sync_guard(pg):
    module = _experts(pg, dtype=torch.bfloat16, **MOE_ACT)
    x, counts, probs = _inputs(torch.bfloat16)
    with torch.no_grad():
        reference, _ = module(x, counts, probs)  # nothing is released or hooked without a backward
    grad = _output_grad(x, sum(COUNTS))
    with forbid_host_sync():
        out, _, x_grad, _ = _run(module, x, counts, probs, grad)
    real = sum(COUNTS)  # rows past it are unwritten on the fused path
    assert torch.equal(out[:real], reference[:real]) and x_grad.shape == x.shape


FUSED_CASES = [
    pytest.param(dict(dtype=torch.bfloat16, gated=True), True, id="swiglu"),
    pytest.param(dict(dtype=torch.bfloat16, gated=False), True, id="gelu"),
    pytest.param(dict(dtype=torch.bfloat16, gated=True, activation_func=F.gelu), True, id="geglu"),
    pytest.param(dict(dtype=torch.bfloat16, gated=True, bias=True), False, id="bias"),
    pytest.param(dict(dtype=torch.bfloat16, gated=True, activation_func_clamp_value=0.5), False, id="clamp"),
    pytest.param(dict(dtype=torch.bfloat16, gated=True, glu_linear_offset=1.0), False, id="offset"),
    pytest.param(dict(dtype=torch.bfloat16, gated=False, activation_func=F.relu), False, id="relu"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg, supported", FUSED_CASES)
def test_fused_path_is_taken_exactly_where_it_is_supported(pg, cfg, supported, device, monkeypatch):
    """The Triton kernels run for the configurations they compute (on a GPU, or on CPU under Triton's
    interpreter) and nowhere else; the torch path takes the rest."""
    calls = []
    original = fused.activation_probs
    monkeypatch.setattr(fused, "activation_probs", lambda *a, **k: calls.append(1) or original(*a, **k))
    module = _experts(pg, device=device, **cfg)
    x, counts, probs = _inputs(cfg["dtype"], device=device)
    _run(module, x, counts, probs, _output_grad(x, sum(COUNTS)))
    expected = supported and fused.enabled_for(x)
    assert (module._fused_activation is not None) == supported
    assert len(calls) == (2 if expected else 0)  # forward, and the recompute in the backward


@pytest.mark.parametrize("device", DEVICES)
def test_fused_path_saves_the_input_and_the_fc1_output_only(pg, device):
    """What the fused path keeps for the backward: the input rows (not a copy), the fc1 output, the
    float32 probs and the offsets; no activation output and no [P, FFN] float32 tensor."""
    module = _experts(pg, device=device, dtype=torch.bfloat16)
    x, counts, probs = _inputs(torch.bfloat16, device=device)
    if not _takes_fused_path(module, x):
        pytest.skip("the fused path runs on a GPU, or on CPU under TRITON_INTERPRET=1")
    saved, out, x_in, probs_in = _saved_bytes(module, x, counts, probs)
    rows, element = x.shape[0], x.element_size()
    assert saved == rows * H * element + rows * 2 * FFN * element + rows * 4 + L * 4, saved
    out.backward(_output_grad(x, sum(COUNTS)))
    assert x_in.grad.shape == x.shape and probs_in.grad.shape == probs.shape


def _capacity_config(dtype):
    cfg = _config(dtype=dtype, moe_hybridep_capacity_factor=1.5)
    cfg.use_cpu_initialization = False
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_capacity_mode_refuses_gpu_experts_that_would_sync(pg, dtype):
    """torch's grouped GEMM copies the offsets to the host for any dtype but bfloat16: capacity mode
    refuses such experts on a GPU when the layer is built (checked before any CUDA call)."""
    with pytest.raises(ValueError, match=r"--moe-hybridep-capacity-factor.*--bf16"):
        GroupedMLP(L, _capacity_config(dtype), pg_collection=pg)


@pytest.mark.gpu
def test_capacity_mode_on_gpu_refuses_fp32_and_runs_bf16_without_a_sync(pg):
    """On the GPU: fp32 capacity-mode experts are refused at build (the grouped GEMM would read the
    offsets on the host) and at the forward of a module moved there; bf16 ones run under the guard."""
    with pytest.raises(ValueError, match="--bf16"):
        GroupedMLP(L, _capacity_config(torch.float32), pg_collection=pg)
    moved = _experts(pg, dtype=torch.float32, moe_hybridep_capacity_factor=1.5).cuda()  # built on CPU
    x, counts, probs = _inputs(torch.float32, device="cuda")
    with pytest.raises(ValueError, match="--bf16"):
        moved(x, counts, probs)
    module = GroupedMLP(L, _capacity_config(torch.bfloat16), pg_collection=pg)
    x, counts, probs = _inputs(torch.bfloat16, device="cuda")
    grad = _output_grad(x, sum(COUNTS))
    with forbid_host_sync():
        out, _, x_grad, _ = _run(module, x, counts, probs, grad)
    assert out.shape == x.shape and x_grad.shape == x.shape
