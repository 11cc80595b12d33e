"""HybridEP buffers behind deep_ep's `HybridEPBuffer` API, and autograd around them."""

from megatron_ext.hybridep.allgather import GatherStats, RoutingMapGather, release_shared_routing_map_buffers
from megatron_ext.hybridep.autograd import combine, dispatch
from megatron_ext.hybridep.torch_buffer import HybridEPHandle, TorchHybridEPBuffer, Traffic

# Position of the overflow flag in a HybridEP handle, ours and deep_ep's alike. deep_ep PR #744
# appended a field after it, so `handle[-1]` is not the flag.
OVERFLOW_FLAG_INDEX = 10

__all__ = [
    "OVERFLOW_FLAG_INDEX",
    "GatherStats",
    "HybridEPHandle",
    "RoutingMapGather",
    "TorchHybridEPBuffer",
    "Traffic",
    "combine",
    "dispatch",
    "release_shared_routing_map_buffers",
]
