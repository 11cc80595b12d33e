"""Bad input to the PyTorch HybridEP buffer raises ValueError naming the argument and the fix.

Every check here fires before the first collective, so one process is enough: a real one-rank
gloo group, and a stand-in group that claims two ranks for the checks that need several.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.hybridep import TorchHybridEPBuffer


class _TwoRanks:
    """Only what the buffer reads before communicating: size and rank."""

    def size(self):
        return 2

    def rank(self):
        return 0


def _inputs(tokens=6, experts=4, hidden=8):
    torch.manual_seed(0)
    routing = torch.rand(tokens, experts) > 0.5
    return torch.randn(tokens, hidden), routing, torch.rand(tokens, experts) * routing


def _raises(argument, fragment, fn, **kwargs):
    with pytest.raises(ValueError, match=re.escape(f"`{argument}` must be")) as err:
        fn(**kwargs)
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "kwargs, argument, fragment",
    [
        (dict(use_fp8="yes"), "use_fp8", "a bool"),
        (dict(num_local_experts=0), "num_local_experts", "positive int"),
        (dict(hidden_dim=0), "hidden_dim", "positive int"),
        (dict(max_num_of_tokens_per_rank=-1), "max_num_of_tokens_per_rank", "non-negative"),
    ],
)
def test_constructor_rejects(gloo_group, kwargs, argument, fragment):
    args = dict(group=gloo_group, hidden_dim=8, max_num_of_tokens_per_rank=6, num_local_experts=4) | kwargs
    _raises(argument, fragment, TorchHybridEPBuffer, **args)


def _dispatch_case(name):
    x, m, p = _inputs()
    cases = {
        "hidden dtype": (dict(hidden=x.long()), "hidden", "bfloat16, float16 or float32"),
        "hidden rank": (dict(hidden=x.unsqueeze(0)), "hidden", "2-D tensor"),
        "map dtype": (dict(routing_map=m.float()), "routing_map", "bool"),
        "map rows": (dict(routing_map=m[:-1]), "routing_map", "one row per token"),
        "probs dtype": (dict(probs=p.bfloat16()), "probs", "float32"),
        "probs shape": (dict(probs=p[:, :2]), "probs", "[6, 4]"),
        "non-blocking without capacity": (dict(non_blocking=True), "num_permuted_tokens", "non_blocking=True"),
        "capacity not multiple": (
            dict(num_permuted_tokens=10, pad_multiple=4, non_blocking=True),
            "num_permuted_tokens",
            "multiple of pad_multiple (4)",
        ),
        "capacity tensor": (
            dict(num_permuted_tokens=torch.tensor(8), non_blocking=True),
            "num_permuted_tokens",
            "host int",
        ),
        "capacity negative": (dict(num_permuted_tokens=-4, non_blocking=True), "num_permuted_tokens", "non-negative"),
        "pad zero": (dict(pad_multiple=0), "pad_multiple", "positive int"),
        "local experts": (dict(num_of_experts_per_rank=2), "num_of_experts_per_rank", "4"),
        "fp8 data in bf16": (dict(use_fp8=True, scaling_factor=torch.ones(6, 1)), "hidden", "quantized data"),
        "fp8 without scales": (
            dict(hidden=x.to(torch.float8_e4m3fn), use_fp8=True),
            "scaling_factor",
            "float32 tensor [6, S]",
        ),
        "fp8 scales of other tokens": (
            dict(hidden=x.to(torch.float8_e4m3fn), use_fp8=True, scaling_factor=torch.ones(5, 1)),
            "scaling_factor",
            "[6, S]",
        ),
        "scaling without fp8": (dict(scaling_factor=torch.ones(6, 1)), "scaling_factor", "None without use_fp8"),
        "no routing": (dict(routing_map=None), "routing_map", "or give topk_idx"),
        "num_of_experts": (dict(num_of_experts=8), "num_of_experts", "4"),
    }
    overrides, argument, fragment = cases[name]
    return dict(hidden=x, routing_map=m, probs=p) | overrides, argument, fragment


@pytest.mark.parametrize(
    "name",
    [
        "hidden dtype",
        "hidden rank",
        "map dtype",
        "map rows",
        "probs dtype",
        "probs shape",
        "non-blocking without capacity",
        "capacity not multiple",
        "capacity tensor",
        "capacity negative",
        "pad zero",
        "local experts",
        "fp8 data in bf16",
        "fp8 without scales",
        "fp8 scales of other tokens",
        "scaling without fp8",
        "no routing",
        "num_of_experts",
    ],
)
def test_dispatch_rejects(gloo_group, name):
    buf = TorchHybridEPBuffer(gloo_group, 8, 6, 4)
    kwargs, argument, fragment = _dispatch_case(name)
    _raises(argument, fragment, buf.dispatch_with_permute, **kwargs)


def test_experts_not_divisible_by_ranks():
    buf = TorchHybridEPBuffer(_TwoRanks(), 8, 6, 2)
    x, m, p = _inputs(experts=5)
    _raises(
        "routing_map", "divisible by the number of ranks", buf.dispatch_with_permute, hidden=x, routing_map=m, probs=p
    )


def test_combine_rejects(gloo_group):
    buf = TorchHybridEPBuffer(gloo_group, 8, 6, 4)
    x, m, p = _inputs()
    rows, row_probs, _, _, handle = buf.dispatch_with_permute(hidden=x, routing_map=m, probs=p, pad_multiple=4)
    _raises("hidden", f"[{rows.shape[0]}, H]", buf.combine_with_unpermute, hidden=rows[:-1], handle=handle)
    _raises("handle", "handle returned by this buffer", buf.combine_with_unpermute, hidden=rows, handle=tuple(handle))
    _raises("probs", "float32", buf.combine_with_unpermute, hidden=rows, probs=row_probs.double(), handle=handle)
    _raises(
        "pad_multiple", "4 (the dispatch's)", buf.combine_with_unpermute, hidden=rows, handle=handle, pad_multiple=16
    )
    _raises(
        "num_permuted_tokens", "the handle's", buf.dispatch_with_permute, hidden=x, handle=handle, num_permuted_tokens=3
    )
    _raises("hidden", "[6, H] to match the handle", buf.dispatch_with_permute, hidden=x[:-1], handle=handle)


def test_a_handle_keeps_the_row_type_of_the_dispatch_that_made_it(gloo_group):
    """As in deep_ep, whose handle carries its dispatch's kernel configuration: a handle made by an
    fp8 dispatch takes fp8 rows only, one made by a plain dispatch plain rows only."""
    buf = TorchHybridEPBuffer(gloo_group, 128, 6, 4)
    x, m, p = _inputs(hidden=128)
    data, scales = x.to(torch.float8_e4m3fn).view(torch.uint8), torch.ones(6, 1)
    plain = buf.dispatch_with_permute(hidden=x, routing_map=m, probs=p)[-1]
    quantized = buf.dispatch_with_permute(hidden=data, routing_map=m, probs=p, use_fp8=True, scaling_factor=scales)[-1]
    _raises(
        "use_fp8",
        "True, as in the dispatch that made this handle",
        buf.dispatch_with_permute,
        hidden=x,
        handle=quantized,
    )
    _raises(
        "use_fp8",
        "False, as in the dispatch that made this handle",
        buf.dispatch_with_permute,
        hidden=data,
        handle=plain,
        use_fp8=True,
        scaling_factor=scales,
    )
    rows = buf.dispatch_with_permute(hidden=data, handle=quantized, use_fp8=True, scaling_factor=scales)[0]
    assert rows.dtype == torch.uint8 and rows.shape[1] == 128


def test_edge_inputs_work(gloo_group):
    """Tokens routed nowhere, experts that receive nothing, an empty dispatch, top-k indices."""
    buf = TorchHybridEPBuffer(gloo_group, 8, 6, 4)
    x, m, p = _inputs()
    nothing = torch.zeros_like(m)
    rows, row_probs, _, counts, handle = buf.dispatch_with_permute(hidden=x, routing_map=nothing, probs=p * 0)
    assert rows.shape == (0, 8) and row_probs.shape == (0,) and counts.tolist() == [0, 0, 0, 0]
    out, out_probs = buf.combine_with_unpermute(hidden=rows, probs=row_probs, handle=handle)
    assert not out.any() and not out_probs.any() and out.shape == x.shape
    topk = torch.tensor([[0, 2]] * 6)
    rows, row_probs, _, counts, _ = buf.dispatch_with_permute(
        hidden=x, topk_idx=topk, topk_weights=torch.full((6, 2), 0.5), num_of_experts=4
    )
    assert counts.tolist() == [6, 0, 6, 0]
    assert torch.equal(rows, torch.cat([x, x])) and torch.equal(row_probs, torch.full((12,), 0.5))


def test_autograd_without_probs_and_with_probs_alone(gloo_group):
    """Gradients flow when dispatch has no probs, and when only the dispatched probs are used."""
    from megatron_ext.hybridep import dispatch

    buf = TorchHybridEPBuffer(gloo_group, 8, 6, 4)
    x, m, p = _inputs()
    x.requires_grad_()
    rows, row_probs, _, _ = dispatch(buf, x, m, None, num_local_experts=4)
    assert row_probs is None
    rows.sum().backward()
    # Each token's gradient is one per row it occupies: the number of its experts.
    assert torch.equal(x.grad, m.sum(1, keepdim=True).float().expand_as(x))
    p.requires_grad_()
    _, row_probs, _, _ = dispatch(buf, x.detach(), m, p, num_local_experts=4, num_permuted_tokens=24)
    (row_probs * 2).sum().backward()
    assert torch.equal(p.grad, 2 * m.float())


def _auto_agrees_or_every_rank_refuses(rank, world_size):
    import torch.distributed as dist

    from megatron_ext import dispatcher
    from megatron_ext.options import HybridEPConfigError, HybridEPOptions

    auto = HybridEPOptions(implementation="auto")
    dispatcher._AGREED.clear()
    dispatcher.resolve_implementation = lambda requested, hidden, fp8_dispatch: "torch"  # the same everywhere: no error
    dispatcher.deep_ep_import_error = lambda: "ModuleNotFoundError: no deep_ep"
    assert dispatcher.agreed_implementation(auto, 256, dist.group.WORLD) == "torch"
    # A node whose deep_ep does not import: every rank raises, naming each rank's choice and why.
    dispatcher._AGREED.clear()
    dispatcher.resolve_implementation = lambda requested, hidden, fp8_dispatch: "deep_ep" if rank == 0 else "torch"
    dispatcher.deep_ep_import_error = lambda: None if rank == 0 else "ImportError: libcuda mismatch"
    with pytest.raises(HybridEPConfigError) as refused:
        dispatcher.agreed_implementation(auto, 256, dist.group.WORLD)
    message = str(refused.value)
    assert "--moe-hybridep-implementation auto picked different buffers" in message, message
    assert "rank 0: deep_ep; rank 1: torch (ImportError: libcuda mismatch)" in message, message
    assert "--moe-hybridep-implementation torch" in message
    # An explicit choice is not gathered (nothing to agree on: the parse checked it).
    explicit = HybridEPOptions(implementation="torch")
    assert dispatcher.agreed_implementation(explicit, 256, dist.group.WORLD) == ("deep_ep" if rank == 0 else "torch")
    # Only the hybridep backend builds a HybridEP buffer: the others neither gather nor refuse.
    dispatcher._AGREED.clear()
    for backend, refused in (("deepep", False), ("hybridep", True)):
        config = SimpleNamespace(moe_flex_dispatcher_backend=backend, hidden_size=256)
        if refused:
            with pytest.raises(HybridEPConfigError, match="picked different buffers"):
                dispatcher.layer_implementation(config, auto, dist.group.WORLD)
        else:
            assert dispatcher.layer_implementation(config, auto, dist.group.WORLD) == (
                "deep_ep" if rank == 0 else "torch"
            )


def test_auto_implementation_is_agreed_across_the_group_or_refused_on_every_rank():
    """`auto` resolves per rank (deep_ep where it imports); ranks that disagree would build
    different buffers and wait in different collectives. Checked with one gather at build."""
    from tests.distributed import run_ranks

    run_ranks(2, _auto_agrees_or_every_rank_refuses)
