"""megatron-ext: host-sync-free HybridEP token dispatch for Megatron-Core MoE training.

Importing this package never imports Megatron-Core; `import megatron_ext.patches.auto` does.
"""

__version__ = "0.1.0.dev14"
