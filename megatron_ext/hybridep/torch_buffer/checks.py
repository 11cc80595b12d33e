"""The argument checks of the torch HybridEP buffer (`TorchHybridEPBuffer`): the dtypes its rows
may have, `_check` (a ValueError naming the argument and what it must be), and
`TorchBufferChecks`, the buffer's checks of a dispatch's or combine's arguments and its routing
given as a map or as top-k indices (`_resolve_routing`), which the buffer inherits.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.hybridep.torch_buffer.handle import HybridEPHandle

SUPPORTED_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# An fp8 dispatch's rows (`use_fp8=True`): quantized data, one byte per element (deep_ep takes uint8).
FP8_HIDDEN_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def _check(condition: bool, argument: str, requirement: str, got: object) -> None:
    """Raise naming `argument` unless `condition`; a tensor `got` is described only then."""
    if not condition:
        if isinstance(got, torch.Tensor):
            got = _describe(got)
        raise ValueError(f"HybridEP: `{argument}` must be {requirement}; got {got}.")


def _describe(t: Optional[torch.Tensor]) -> str:
    return "None" if t is None else f"{t.dtype} tensor of shape {tuple(t.shape)}"


class TorchBufferChecks:
    """The checks `TorchHybridEPBuffer` makes of its calls' arguments (it inherits them; they read
    its `world_size` and `num_local_experts`)."""

    def _resolve_routing(self, hidden, routing_map, probs, topk_idx, topk_weights, num_of_experts, num_local):
        if num_local is not None:
            _check(
                num_local == self.num_local_experts,
                "num_of_experts_per_rank",
                f"{self.num_local_experts} (the buffer's num_local_experts)",
                num_local,
            )
        num_tokens = hidden.shape[0]
        if routing_map is None:
            _check(topk_idx is not None, "routing_map", "a [T, E] bool tensor (or give topk_idx)", None)
            _check(isinstance(num_of_experts, int), "num_of_experts", "an int when routing by topk_idx", num_of_experts)
            _check(
                topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens and not topk_idx.is_floating_point(),
                "topk_idx",
                f"an integer tensor of shape [{num_tokens}, K]",
                topk_idx,
            )
            routing_map = torch.zeros(num_tokens, num_of_experts, dtype=torch.bool, device=hidden.device)
            routing_map.scatter_(1, topk_idx.long(), True)
            if topk_weights is not None:
                _check(
                    topk_weights.shape == topk_idx.shape,
                    "topk_weights",
                    f"of shape {tuple(topk_idx.shape)}",
                    topk_weights,
                )
                probs = torch.zeros(num_tokens, num_of_experts, dtype=torch.float32, device=hidden.device)
                probs.scatter_(1, topk_idx.long(), topk_weights.float())
        num_experts = self.world_size * self.num_local_experts
        _check(
            routing_map.dtype == torch.bool and routing_map.dim() == 2,
            "routing_map",
            "a 2-D bool tensor [T, E]",
            routing_map,
        )
        _check(
            routing_map.shape[0] == num_tokens,
            "routing_map",
            f"[{num_tokens}, E] (one row per token of `hidden`)",
            routing_map,
        )
        _check(
            routing_map.shape[1] == num_experts,
            "routing_map",
            f"[T, {num_experts}]: experts = num_local_experts ({self.num_local_experts}) x ranks "
            f"({self.world_size}); the number of experts must be divisible by the number of ranks",
            routing_map,
        )
        if num_of_experts is not None:
            _check(
                num_of_experts == num_experts,
                "num_of_experts",
                f"{num_experts} (routing_map's columns)",
                num_of_experts,
            )
        if probs is not None:
            self._check_probs(probs, num_tokens, num_experts)
        return routing_map, probs

    def _check_hidden(self, hidden, argument, fp8: bool = False):
        _check(
            isinstance(hidden, torch.Tensor) and hidden.dim() == 2,
            argument,
            "a 2-D tensor [T, H]",
            hidden if isinstance(hidden, torch.Tensor) else type(hidden).__name__,
        )
        if fp8:
            _check(
                hidden.dtype in FP8_HIDDEN_DTYPES,
                argument,
                "quantized data with use_fp8=True: float8_e4m3fn, float8_e5m2 or uint8",
                hidden.dtype,
            )
        else:
            _check(hidden.dtype in SUPPORTED_HIDDEN_DTYPES, argument, "bfloat16, float16 or float32", hidden.dtype)

    @staticmethod
    def _check_scaling_factor(scaling_factor, hidden):
        _check(
            isinstance(scaling_factor, torch.Tensor)
            and scaling_factor.dtype == torch.float32
            and scaling_factor.dim() == 2
            and scaling_factor.shape[0] == hidden.shape[0],
            "scaling_factor",
            f"with use_fp8=True, a float32 tensor [{hidden.shape[0]}, S] of each token's scales",
            scaling_factor,
        )

    def _check_probs(self, probs, num_tokens, num_experts):
        _check(
            probs.dtype == torch.float32 and tuple(probs.shape) == (num_tokens, num_experts),
            "probs",
            f"a float32 tensor of shape [{num_tokens}, {num_experts}]",
            probs,
        )

    @staticmethod
    def _check_handle(handle, argument):
        _check(
            isinstance(handle, HybridEPHandle),
            argument,
            "a handle returned by this buffer's dispatch",
            type(handle).__name__,
        )

    @staticmethod
    def _check_capacity(num_permuted_tokens, pad_multiple, non_blocking) -> Optional[int]:
        _check(
            pad_multiple is None or (isinstance(pad_multiple, int) and pad_multiple > 0),
            "pad_multiple",
            "None or a positive int",
            pad_multiple,
        )
        if num_permuted_tokens is None:
            _check(not non_blocking, "num_permuted_tokens", "a host int when non_blocking=True (the output size)", None)
            return None
        _check(
            isinstance(num_permuted_tokens, int)
            and not isinstance(num_permuted_tokens, bool)
            and num_permuted_tokens >= 0,
            "num_permuted_tokens",
            "None or a non-negative host int (a tensor would need a host read)",
            type(num_permuted_tokens).__name__ if not isinstance(num_permuted_tokens, int) else num_permuted_tokens,
        )
        if pad_multiple is not None:
            _check(
                num_permuted_tokens % pad_multiple == 0,
                "num_permuted_tokens",
                f"a multiple of pad_multiple ({pad_multiple})",
                num_permuted_tokens,
            )
        return num_permuted_tokens
