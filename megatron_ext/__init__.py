"""megatron-ext: host-sync-free HybridEP token dispatch for Megatron-Core MoE training.

Importing this package never imports Megatron-Core; `import megatron_ext.patches.auto` does.

The package from the top down, each layer importing only those below it: `launch.py`, `patches/`
(every change made to Megatron-Core), `training/` (what happens at the step), `dispatcher.py` (the
flex dispatcher subclass), `capacity/` (how large a dispatch is, what an overflow does), `experts/`
(the expert computation), `hybridep/` (the buffers behind the HybridEP API), `options/` (the flags,
their fields and their checks), `fused/` (Triton kernels) and `logs.py`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0.dev14"

# Modules that moved into the packages above, by their former names: importing a former name
# still works, warns with the new one (DeprecationWarning) and gives the same module object.
MOVED = {
    "megatron_ext.activation_recompute": "megatron_ext.experts.activation_recompute",
    "megatron_ext.arguments": "megatron_ext.options.arguments",
    "megatron_ext.budget": "megatron_ext.capacity.budget",
    "megatron_ext.capacity_policy": "megatron_ext.capacity.policy",
    "megatron_ext.config": "megatron_ext.options.config",
    "megatron_ext.experts_checkpoint": "megatron_ext.experts.checkpoint",
    "megatron_ext.graph_checks": "megatron_ext.options.graph_checks",
    "megatron_ext.host_constant": "megatron_ext.capacity.host_constant",
    "megatron_ext.hybridep.allgather": "megatron_ext.hybridep.torch_buffer.allgather",
    "megatron_ext.hybridep.exchange": "megatron_ext.hybridep.torch_buffer.exchange",
    "megatron_ext.hybridep.kernel_cache": "megatron_ext.hybridep.deep_ep_buffer.kernel_cache",
    "megatron_ext.hybridep.layout": "megatron_ext.hybridep.torch_buffer.layout",
    "megatron_ext.hybridep.torch_checks": "megatron_ext.hybridep.torch_buffer.checks",
    "megatron_ext.hybridep.torch_combine": "megatron_ext.hybridep.torch_buffer.combine",
    "megatron_ext.hybridep.torch_handle": "megatron_ext.hybridep.torch_buffer.handle",
    "megatron_ext.implementation": "megatron_ext.options.implementation",
    "megatron_ext.option_fields": "megatron_ext.options.fields",
    "megatron_ext.recovery": "megatron_ext.training.recovery",
    "megatron_ext.warmup": "megatron_ext.training.warmup",
}


class _FormerNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former name of `MOVED` and loads it as the module it moved to."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        # Attributed to the line that imports the former name, past the import machinery's frames.
        skip = ("<frozen importlib", __file__)
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}", DeprecationWarning, skip_file_prefixes=skip)
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import sets the module's `__spec__` to the former name's
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _FormerNames) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FormerNames())  # before any finder that could find a stale file by the name
