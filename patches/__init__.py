"""Everything in megatron-ext that reaches into Megatron-Core, and nothing else.

Installed as `megatron_ext.patches`. Importing it does not import Megatron-Core; the functions
here do, when called.
"""

from megatron_ext.patches._compat import (
    SUPPORTED_MEGATRON_CORE,
    MovedSymbolError,
    UnsupportedMegatronError,
    check_megatron_version,
    megatron_core_version,
    resolve,
)

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "MovedSymbolError",
    "UnsupportedMegatronError",
    "check_megatron_version",
    "megatron_core_version",
    "resolve",
]
