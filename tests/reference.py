"""A dense, single-process reference of HybridEP dispatch and combine over W simulated ranks.

Written from the layout description alone (not from megatron_ext): plain loops over experts and
tokens, differentiable through indexing and stacking, so autograd gives reference gradients.

Layout: rank r owns experts [r * L, (r + 1) * L). Its output rows are, for each local expert in
order, the tokens g (= source_rank * T + t) routed to it in ascending g, then zero rows up to a
multiple of pad_multiple. tokens_per_expert holds the padded segment lengths. Combine gives each
token the unweighted sum of its rows over every expert and rank it went to.
"""

from __future__ import annotations

import torch


def _segments(routing_maps, world_size, rank, pad_multiple):
    """For each local expert of `rank`: (global expert, routed global token indices, pad rows)."""
    routing = torch.cat(routing_maps)  # [W * T, E]
    num_local = routing.shape[1] // world_size
    for local in range(num_local):
        expert = rank * num_local + local
        tokens = [g for g in range(routing.shape[0]) if bool(routing[g, expert])]
        pad = (-len(tokens)) % pad_multiple if pad_multiple else 0
        yield expert, tokens, pad


def dispatch(hidden, routing_maps, probs, world_size, pad_multiple=None):
    """Per receiving rank: (rows [P, H], row_probs [P] or None, tokens_per_expert [L] int64).

    hidden, routing_maps, probs: lists over source ranks of [T, H], [T, E] bool, [T, E] float32.
    """
    all_hidden = torch.cat(hidden)
    all_probs = None if probs is None else torch.cat(probs)
    out = []
    for rank in range(world_size):
        rows, row_probs, counts = [], [], []
        for expert, tokens, pad in _segments(routing_maps, world_size, rank, pad_multiple):
            rows += [all_hidden[g] for g in tokens] + [all_hidden.new_zeros(all_hidden.shape[1])] * pad
            if all_probs is not None:
                row_probs += [all_probs[g, expert] for g in tokens] + [all_probs.new_zeros(())] * pad
            counts.append(len(tokens) + pad)
        rows = torch.stack(rows) if rows else all_hidden.new_zeros(0, all_hidden.shape[1])
        if all_probs is None:
            row_probs = None
        else:
            row_probs = torch.stack(row_probs) if row_probs else all_probs.new_zeros(0)
        out.append((rows, row_probs, torch.tensor(counts, dtype=torch.int64)))
    return out


def combine(rows_per_rank, routing_maps, world_size, pad_multiple=None):
    """Per source rank: [T, H] tokens, each the sum of its rows (float64 accumulation)."""
    num_tokens = routing_maps[0].shape[0]
    width = rows_per_rank[0].shape[1]
    sums = [[None] * num_tokens for _ in range(world_size)]
    for rank, rows in enumerate(rows_per_rank):
        position = 0
        for _, tokens, pad in _segments(routing_maps, world_size, rank, pad_multiple):
            for g in tokens:
                source, t = divmod(g, num_tokens)
                row = rows[position].double()
                sums[source][t] = row if sums[source][t] is None else sums[source][t] + row
                position += 1
            position += pad
    zero = rows_per_rank[0].new_zeros(width, dtype=torch.float64)
    return [torch.stack([s if s is not None else zero for s in per_rank]) for per_rank in sums]


def random_routing(generator, world_size, num_tokens, num_experts, topk, hidden_dim, dtype):
    """Fresh inputs for every rank: hidden [T, H], routing map [T, E] with topk experts per token
    (some tokens routed nowhere), float32 probs [T, E] nonzero only where routed."""
    hidden, maps, probs = [], [], []
    for _ in range(world_size):
        hidden.append(torch.randn(num_tokens, hidden_dim, generator=generator).to(dtype))
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        chosen = scores.topk(topk, dim=1).indices
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True)
        routing[torch.rand(num_tokens, generator=generator) < 0.1] = False  # tokens routed nowhere
        maps.append(routing)
        probs.append(torch.rand(num_tokens, num_experts, generator=generator) * routing)
    return hidden, maps, probs
