"""HybridEP buffers behind deep_ep's `HybridEPBuffer` API, and autograd around them."""

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
