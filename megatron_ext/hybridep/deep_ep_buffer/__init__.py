"""deep_ep's HybridEPBuffer behind the same calls as ours. deep_ep is imported here, lazily, only.

deep_ep's buffer already has the API megatron-ext drives (`dispatch_with_permute`,
`combine_with_unpermute`, the overflow flag: see `hybridep/handle.py`), so this module only decides
how to construct it; deep_ep's compiled kernels are kept across jobs by `kernel_cache.py`, beside
it. Routing-map reuse maps to deep_ep's persistent all-gather buffer
(`enable_custom_allgather=True`), which deep_ep supports when every rank of the group is on one
node and each rank's map is a multiple of 16 bytes; elsewhere the plain all-gather is kept.
`buffers.get_buffer` checks the map's size again at every dispatch, since a buffer serves smaller
token counts than it was built for.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch.distributed as dist

from megatron_ext.hybridep.deep_ep_buffer.kernel_cache import activate
from megatron_ext.hybridep.protocol import HybridEPBuffer
from megatron_ext.logs import once_per_group
from megatron_ext.options import KERNEL_CACHE_FLAG, HybridEPConfigError, accepts_keyword, flag

logger = logging.getLogger(__name__)

# deep_ep's custom all-gather copies rows in 16-byte units.
CUSTOM_ALLGATHER_ALIGNMENT = 16


def group_on_one_node(group: dist.ProcessGroup) -> bool:
    """Whether every rank of `group` runs on this host (one object all-gather; call it rarely)."""
    hosts: list[Any] = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def map_alignment_reason(num_tokens: int, num_experts: int) -> str | None:
    """None when a rank's `[num_tokens, num_experts]` bool routing map suits deep_ep's persistent
    all-gather (a multiple of 16 bytes), else why not."""
    if (num_tokens * num_experts) % CUSTOM_ALLGATHER_ALIGNMENT:
        return (
            f"each rank's routing map is {num_tokens} x {num_experts} bytes, not a multiple of "
            f"{CUSTOM_ALLGATHER_ALIGNMENT}"
        )
    return None


def custom_allgather_reason(group: dist.ProcessGroup, num_tokens: int, num_experts: int) -> str | None:
    """None when deep_ep's persistent all-gather buffer can serve this group, else why not."""
    if not group_on_one_node(group):
        return "the expert-parallel group spans several nodes"
    return map_alignment_reason(num_tokens, num_experts)


# Megatron's deep_ep tuning flags (config fields) and their defaults in Megatron-Core 0.19.2.
MEGATRON_TUNING_DEFAULTS = {
    "moe_flex_dispatcher_num_sms": None,
    "moe_hybridep_num_blocks_permute": None,
    "moe_hybridep_num_blocks_unpermute": None,
    "moe_hybridep_num_sms_preprocessing": 108,
}
# deep_ep's constructor keyword -> the field whose value Megatron passes it (one SM count for
# dispatch and combine; the preprocessing default 108 passed as it is).
_FIELD_OF_KEYWORD = {
    "num_sms_dispatch_api": "moe_flex_dispatcher_num_sms",
    "num_sms_combine_api": "moe_flex_dispatcher_num_sms",
    "num_sms_preprocessing_api": "moe_hybridep_num_sms_preprocessing",
    "num_blocks_permute": "moe_hybridep_num_blocks_permute",
    "num_blocks_unpermute": "moe_hybridep_num_blocks_unpermute",
}


def tuning_flags_set(config: Any) -> list[str]:
    """The deep_ep tuning flags set away from Megatron's defaults on `config`, as flags."""
    defaults = MEGATRON_TUNING_DEFAULTS.items()
    return [flag(name) for name, default in defaults if getattr(config, name, default) != default]


@dataclass(frozen=True)
class DeepEPTuning:
    """How many SMs and blocks deep_ep's HybridEP kernels take: Megatron's tuning flags, mapped onto
    `deep_ep.HybridEPBuffer`'s constructor as Megatron-Core 0.19.2 maps them for its own buffer
    (`init_hybrid_ep_buffer`). None leaves deep_ep's default."""

    num_sms_dispatch_api: Optional[int] = None
    num_sms_combine_api: Optional[int] = None
    num_sms_preprocessing_api: Optional[int] = None
    num_blocks_permute: Optional[int] = None
    num_blocks_unpermute: Optional[int] = None

    @classmethod
    def from_config(cls, config: Any) -> DeepEPTuning:
        return cls(**{keyword: getattr(config, name, None) for keyword, name in _FIELD_OF_KEYWORD.items()})

    def keywords(self) -> dict[str, int]:
        """The constructor keywords that are set."""
        return {name: value for name, value in asdict(self).items() if value is not None}


def _tuning_keywords(buffer_class: Any, tuning: DeepEPTuning) -> dict[str, int]:
    """`tuning`'s keywords, refused by flag where this deep_ep build's constructor lacks one."""
    keywords = tuning.keywords()
    missing = sorted(
        {flag(_FIELD_OF_KEYWORD[name]) for name in keywords if not accepts_keyword(buffer_class, "__init__", name)}
    )
    if missing:
        raise HybridEPConfigError(
            f"{' and '.join(missing)}: this deep_ep build's HybridEPBuffer takes no such setting; "
            "leave the flag unset or install a deep_ep build whose HybridEPBuffer takes it (hybrid-ep 1.2.1 does)."
        )
    return keywords


def create_deep_ep_buffer(
    group: dist.ProcessGroup,
    hidden_dim: int,
    num_tokens: int,
    num_local_experts: int,
    *,
    reuse_allgather_buffer: bool,
    tuning: DeepEPTuning = DeepEPTuning(),
    kernel_cache: Optional[str] = None,
) -> HybridEPBuffer:
    """A `deep_ep.HybridEPBuffer` for `group`, with the persistent all-gather where asked and
    allowed, the SM and block counts of `tuning`, and with `kernel_cache` (a folder,
    `--moe-hybridep-kernel-cache`) the kernels stored there loaded instead of compiled."""
    from deep_ep import HybridEPBuffer

    tuning_keywords = _tuning_keywords(HybridEPBuffer, tuning)
    if kernel_cache is not None:
        if not accepts_keyword(HybridEPBuffer, "__init__", "load_cached_kernels"):
            raise HybridEPConfigError(
                f"{KERNEL_CACHE_FLAG}: this deep_ep build's HybridEPBuffer cannot load compiled kernels "
                "(it has no load_cached_kernels); drop the flag or install hybrid-ep 1.2.1 or later."
            )
        activate(kernel_cache)
        tuning_keywords = {**tuning_keywords, "load_cached_kernels": True}
    custom_allgather = False
    if reuse_allgather_buffer:
        reason = custom_allgather_reason(group, num_tokens, num_local_experts * group.size())
        if reason is None and not accepts_keyword(HybridEPBuffer, "__init__", "enable_custom_allgather"):
            reason = "this deep_ep build has no enable_custom_allgather"
        custom_allgather = reason is None
        if custom_allgather:
            logger.log(
                once_per_group(logging.INFO, group),
                "megatron-ext: deep_ep HybridEP gathers routing maps into its persistent buffer.",
            )
        else:
            logger.log(
                once_per_group(logging.WARNING, group),
                "megatron-ext: --moe-hybridep-reuse-allgather-buffer: deep_ep's persistent all-gather "
                "buffer cannot serve this group (%s); using deep_ep's plain all-gather.",
                reason,
            )
    extra = {"enable_custom_allgather": True} if custom_allgather else {}  # builds before 2026-01 lack it
    return HybridEPBuffer(
        group=group,
        hidden_dim=hidden_dim,
        max_num_of_tokens_per_rank=num_tokens,
        num_local_experts=num_local_experts,
        **tuning_keywords,
        **extra,
    )
