"""Which HybridEP implementation a layer runs: whether deep_ep's `HybridEPBuffer` is usable here
(it imports, its dispatch takes what megatron-ext passes, it takes the hidden size), and what
`--moe-hybridep-implementation auto` resolves to (`resolve_implementation`,
`requested_implementation`). deep_ep is imported lazily, in `deep_ep_import_error` only.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

from megatron_ext.options.fields import (
    AUTO,
    COMPACT_ROUTING_FLAG,
    CONFIG_PREFIX,
    FP8_DISPATCH_FLAG,
    HybridEPOptions,
    flag,
)

logger = logging.getLogger("megatron_ext.options")  # the name its lines had: users may filter by it


# What megatron-ext passes to `HybridEPBuffer.dispatch_with_permute` that hybrid-ep builds before
# non-blocking dispatch (late 2025) lack; megatron-core 0.19 passes them too.
DEEP_EP_DISPATCH_ARGUMENTS = ("num_permuted_tokens", "non_blocking", "pad_multiple")
DEEP_EP_TESTED_COMMIT = "94a9f8f"


def deep_ep_import_error() -> Optional[str]:
    """None when `deep_ep.HybridEPBuffer` imports and its dispatch takes what megatron-ext passes,
    else why not (imported lazily, here only)."""
    try:
        from deep_ep import HybridEPBuffer
    except Exception as exc:  # ImportError, or a CUDA/driver error raised at import
        return f"{type(exc).__name__}: {exc}"
    missing = [
        name
        for name in DEEP_EP_DISPATCH_ARGUMENTS
        if not accepts_keyword(HybridEPBuffer, "dispatch_with_permute", name)
    ]
    if missing:
        return (
            f"its dispatch_with_permute takes no {', '.join(missing)}: a hybrid-ep build older than megatron-ext "
            f"needs (tested: hybrid-ep {DEEP_EP_TESTED_COMMIT})"
        )
    return None


def accepts_keyword(cls: Any, method: str, argument: str) -> bool:
    """Whether `cls.method` accepts `argument` by keyword (True where its signature cannot be read)."""
    function = getattr(cls, method, None)
    if function is None:
        return False
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a C++ binding without a readable signature
        return True
    return argument in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


# deep_ep 1.2.1's HybridEPBuffer allocates, fp8 or not, a scaling-factor buffer of hidden // 128
# floats per token; at a hidden size below 128 that is zero bytes, and its constructor aborts the
# process (SIGABRT, no Python error; seen on an H200, 2026-12-01). Its config raises on a hidden
# size that is not a multiple of 16.
DEEP_EP_MIN_HIDDEN = 128
DEEP_EP_HIDDEN_MULTIPLE = 16
DEEP_EP_FP8_HIDDEN_MULTIPLE = 512  # deep_ep 1.2.1's fp8 dispatch kernels


def deep_ep_shape_error(hidden_size: Optional[int], fp8_dispatch: bool = False) -> Optional[str]:
    """None when deep_ep's HybridEPBuffer takes this hidden size (or it is not known), in fp8 where
    `fp8_dispatch` (--moe-hybridep-fp8-dispatch), else why not."""
    if hidden_size is None:
        return None
    if hidden_size < DEEP_EP_MIN_HIDDEN:
        return (
            f"hidden size {hidden_size} is below {DEEP_EP_MIN_HIDDEN}, where deep_ep's HybridEPBuffer "
            "constructor aborts the process"
        )
    if hidden_size % DEEP_EP_HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden_size} is not a multiple of {DEEP_EP_HIDDEN_MULTIPLE}, as deep_ep's "
            "HybridEPBuffer needs"
        )
    if fp8_dispatch and hidden_size % DEEP_EP_FP8_HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden_size} is not a multiple of {DEEP_EP_FP8_HIDDEN_MULTIPLE}, as deep_ep's fp8 "
            f"dispatch ({FP8_DISPATCH_FLAG}) needs"
        )
    return None


_AUTO_FALLBACKS_LOGGED: set[str] = set()


def resolve_implementation(requested: str, hidden_size: Optional[int] = None, fp8_dispatch: bool = False) -> str:
    """'deep_ep' or 'torch': 'auto' picks deep_ep where its HybridEPBuffer imports and takes
    `hidden_size` (in fp8 where `fp8_dispatch`); where it imports but cannot take the size,
    'torch', logged once per reason."""
    if requested != AUTO:
        return requested
    if deep_ep_import_error() is not None:
        return "torch"
    reason = deep_ep_shape_error(hidden_size, fp8_dispatch)
    if reason is None:
        return "deep_ep"
    if reason not in _AUTO_FALLBACKS_LOGGED:
        _AUTO_FALLBACKS_LOGGED.add(reason)
        logger.warning(
            "megatron-ext: %s auto uses the torch implementation: %s.", flag(CONFIG_PREFIX + "implementation"), reason
        )
    return "torch"


def requested_implementation(options: HybridEPOptions) -> str:
    """The implementation `options` ask for: `--moe-hybridep-implementation`, except that `auto`
    with compact routing is torch (logged once): deep_ep 1.2.1's dispatch turns top-k indices into
    the dense map before its own all-gather, so compact routing would save nothing there."""
    if options.implementation != AUTO or not options.compact_routing:
        return options.implementation
    if COMPACT_ROUTING_FLAG not in _AUTO_FALLBACKS_LOGGED:
        _AUTO_FALLBACKS_LOGGED.add(COMPACT_ROUTING_FLAG)
        logger.info(
            "megatron-ext: %s auto uses the torch implementation for %s (deep_ep's dispatch gathers the dense "
            "routing map).",
            flag(CONFIG_PREFIX + "implementation"),
            COMPACT_ROUTING_FLAG,
        )
    return "torch"
