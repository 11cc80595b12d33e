"""The PyTorch HybridEP buffer on a CUDA GPU with NCCL (one rank): same results as the CPU
reference, non-blocking bitwise equal to blocking, and the run-ahead probe's verdicts."""

from __future__ import annotations

import pytest
import torch

from tests import reference
from tests.test_torch_buffer import CASES, HIDDEN, TOLERANCE, _forward_backward, _reference_forward_backward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_reference_and_nonblocking_is_bitwise_blocking(nccl_group, index):
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import forbid_host_sync

    num_tokens, num_experts, topk, pad_multiple, dtype, _ = CASES[index]
    gen = torch.Generator().manual_seed(500 + index)
    hidden, maps, probs = reference.random_routing(gen, 1, num_tokens, num_experts, topk, HIDDEN, dtype)
    weights = [torch.randn(num_tokens, HIDDEN, generator=gen)]
    buf = TorchHybridEPBuffer(nccl_group, HIDDEN, num_tokens, num_experts, reuse_allgather_buffer=True)
    x, m, p = hidden[0].cuda(), maps[0].cuda(), probs[0].cuda()
    cuda_weights = [w.cuda() for w in weights]
    blocking = _forward_backward(buf, x, m, p, 0, cuda_weights, num_experts, None, pad_multiple)
    capacity = -(-(blocking["rows"].shape[0] + 8) // (pad_multiple or 1)) * (pad_multiple or 1)
    with forbid_host_sync():
        roomy = _forward_backward(buf, x, m, p, 0, cuda_weights, num_experts, capacity, pad_multiple)
    torch.cuda.synchronize()
    _, ref_out, ref_grad_x, ref_grad_p = _reference_forward_backward(hidden, maps, probs, weights, 1, pad_multiple)
    ref_rows = reference.dispatch(hidden, maps, probs, 1, pad_multiple)[0][0]
    assert torch.equal(blocking["rows"].cpu(), ref_rows.to(dtype))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(blocking["out"].double().cpu(), ref_out[0], **tol)
    torch.testing.assert_close(blocking["grad_x"].double().cpu(), ref_grad_x[0], **tol)
    torch.testing.assert_close(blocking["grad_p"].double().cpu(), ref_grad_p[0], **tol)
    exact = blocking["rows"].shape[0]
    assert torch.equal(roomy["rows"][:exact], blocking["rows"])  # rows past it: unwritten by the fused permute
    for key in ("out", "grad_x", "grad_p", "counts"):
        assert torch.equal(roomy[key], blocking[key]), key
    assert int(roomy["flag"]) == 0


def _step(buf, x, m, p, capacity):
    from megatron_ext.hybridep import combine, dispatch

    xg, pg = x.detach().requires_grad_(), p.detach().requires_grad_()
    rows, row_probs, _, handle = dispatch(buf, xg, m, pg, num_local_experts=m.shape[1], num_permuted_tokens=capacity)
    out = combine(buf, rows * row_probs.unsqueeze(1).to(rows.dtype), handle, num_permuted_tokens=capacity)
    out.float().sum().backward()


def test_nonblocking_step_runs_ahead_and_blocking_waits(nccl_group):
    from megatron_ext.hybridep import TorchHybridEPBuffer
    from megatron_ext.tooling.sync import runahead_probe

    T, H, E, K = 8192, 2048, 64, 8
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    m = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(
        1, torch.rand(T, E, device="cuda").topk(K, 1).indices, True
    )
    p = torch.rand(T, E, device="cuda") * m
    buf = TorchHybridEPBuffer(nccl_group, H, T, E, reuse_allgather_buffer=True)
    capacity = -(-int(m.sum()) * 3 // 2 // 4) * 4
    non_blocking = runahead_probe(lambda: _step(buf, x, m, p, capacity))
    blocking = runahead_probe(lambda: _step(buf, x, m, p, None))
    print(f"\nnon-blocking step: {non_blocking}\nblocking step: {blocking}")
    assert not non_blocking.waited, f"non-blocking step waited for the GPU: {non_blocking}"
    assert blocking.waited, f"the probe did not see the blocking dispatch's host read: {blocking}"


def test_compact_routing_gather_replays_in_a_cuda_graph(nccl_group):
    """Compact routing's device work (map -> top-k indices, the gather, the over-k assert, the
    expansion) captured once and replayed on fresh maps, no host read, each replay giving back its
    map. One NCCL rank: the gather is called as at several ranks (a group of one skips it)."""
    from megatron_ext.hybridep.torch_buffer.allgather import RoutingMapGather
    from megatron_ext.tooling.sync import forbid_host_sync

    T, E, K = 512, 64, 8
    gather = RoutingMapGather(nccl_group, reuse=True, topk=K)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fresh_map() -> torch.Tensor:  # top-K rows, and rows of fewer experts (empty slots)
        m = torch.zeros(T, E, dtype=torch.bool, device="cuda")
        m.scatter_(1, torch.rand(T, E, device="cuda", generator=gen).topk(K, 1).indices, True)
        keep = torch.rand(T, E, device="cuda", generator=gen) < 0.7
        return m & keep

    static_map = fresh_map()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather._gather_compact(static_map)  # allocates the reused storage outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, sent = gather._gather_compact(static_map)
    assert sent == 0  # one rank sends nothing to others
    for _ in range(4):
        m = fresh_map()
        with forbid_host_sync():
            static_map.copy_(m)
            graph.replay()
        assert torch.equal(out, m), "a replayed compact gather did not give back the map"
