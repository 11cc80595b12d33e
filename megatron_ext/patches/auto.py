"""`import megatron_ext.patches.auto` applies megatron-ext's patches to Megatron-Core (see `apply`)."""

from megatron_ext.patches import apply

PATCHED = apply()
