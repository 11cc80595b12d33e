"""The buffers behind deep_ep's `HybridEPBuffer` API, ours and deep_ep's, and autograd around them.

Ours, on torch.distributed: `torch_buffer/`. deep_ep's, adapted: `deep_ep_buffer/` (the only place
deep_ep is imported). What both share, here: the API as a protocol (`protocol.py`), dispatch and
combine as each other's backward (`autograd.py`), the handle's overflow flag (`handle.py`), fp8
tokens on the way (`fp8.py`), and the buffers shared between layers (`buffers.py`).
"""

from megatron_ext.hybridep.autograd import combine, dispatch
from megatron_ext.hybridep.handle import UnknownHandleLayoutError, overflow_flag
from megatron_ext.hybridep.torch_buffer import HybridEPHandle, TorchHybridEPBuffer, Traffic
from megatron_ext.hybridep.torch_buffer.allgather import (
    GatherStats,
    RoutingMapGather,
    release_shared_routing_map_buffers,
)

__all__ = [
    "GatherStats",
    "HybridEPHandle",
    "RoutingMapGather",
    "TorchHybridEPBuffer",
    "Traffic",
    "UnknownHandleLayoutError",
    "combine",
    "dispatch",
    "overflow_flag",
    "release_shared_routing_map_buffers",
]
