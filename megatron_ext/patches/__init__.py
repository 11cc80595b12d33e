"""Every change megatron-ext makes to Megatron-Core's own modules, and nothing else.

Other modules import Megatron-Core too (the dispatcher and experts subclass its classes, the
config extends its TransformerConfig); only this package replaces attributes inside it. Importing
it does not import Megatron-Core; `apply()` does.

    import megatron_ext.patches
    megatron_ext.patches.apply()        # or: import megatron_ext.patches.auto
    ...
    megatron_ext.patches.revert()       # or: with megatron_ext.patches.patched(): ...

`apply()` checks the megatron-core version, resolves every target and every symbol megatron-ext
looks up at run time (`RUNTIME_SYMBOLS`), and checks the parameters of every callable it calls or
wraps (`SIGNATURES`), before changing any (so a moved or re-signatured symbol patches nothing and is
named), replaces each attribute below, and logs it by its dotted name.
Applying twice is harmless; `revert()` puts every original back.

Patched attributes, by feature:
* dispatcher: `megatron.core.transformer.moe.moe_layer.MoEFlexTokenDispatcher` ->
  `megatron_ext.dispatcher.HybridEPTokenDispatcher`.
* experts: `megatron.core.transformer.moe.moe_layer.MoELayer.__init__` -> a wrapper that gives
  capacity-mode layers experts which read token counts on the device.
* arguments: `TransformerConfig` in `megatron.training.arguments` and `.argument_utils` ->
  `megatron_ext.options.config.HybridEPTransformerConfig`; `megatron.core.transformer.MLATransformerConfig`
  -> `HybridEPMLATransformerConfig`; `megatron.training.arguments.add_megatron_arguments` -> the
  same, plus validation of megatron-ext's flags when the parser parses.
* training: `megatron.training.training.get_forward_backward_func` -> the same, its result wrapped
  in `megatron_ext.training.recovery.OverflowRerun` (a capacity-mode overflow re-runs the step; a
  pass-through without capacity mode); `megatron.training.training.FullCudaGraphWrapper` -> a
  subclass that, built around that wrapper, graphs the step function inside it and keeps the
  overflow policy outside the graph (`megatron_ext.training.recovery.full_iteration_graph`);
  `megatron.core.transformer.moe.moe_logging.MoEMetricsTracker.report` -> the same, also
  reporting megatron-ext's capacity use in capacity mode;
  `megatron.core.pipeline_parallel.schedules.create_cudagraphs` -> the same, skipped while an
  overflowed step re-runs eagerly under per-layer graphs (`megatron_ext.training.recovery.capture_paused`);
  `megatron.training.training.train` -> the same, after `megatron_ext.training.warmup.warm_up_before_training`
  (with `--moe-hybridep-warm-up`: every MoE layer's buffer built and kernels compiled first).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_ext.logs import once_per_job
from megatron_ext.options.fields import near_miss
from megatron_ext.patches._compat import (
    SUPPORTED_MEGATRON_CORE,
    ChangedSignatureError,
    MovedSymbolError,
    Takes,
    UnsupportedMegatronError,
    UnsupportedTorchError,
    check_megatron_version,
    check_signature,
    check_torch_version,
    megatron_core_version,
    resolve,
    supported_range,
)

logger = logging.getLogger(__name__)


def _dispatcher(original: Any) -> Any:
    from megatron_ext.dispatcher import HybridEPTokenDispatcher

    return HybridEPTokenDispatcher


def _moe_layer_init(original: Callable) -> Callable:
    from megatron_ext.patches._moe_layer import wrap_init

    return wrap_init(original)


def _transformer_config(original: Any) -> Any:
    from megatron_ext.options.config import HybridEPTransformerConfig

    return HybridEPTransformerConfig


def _mla_transformer_config(original: Any) -> Any:
    from megatron_ext.options.config import HybridEPMLATransformerConfig

    return HybridEPMLATransformerConfig


def _add_megatron_arguments(original: Callable) -> Callable:
    from megatron_ext.options.arguments import install_validation

    @functools.wraps(original)
    def add_megatron_arguments(parser):
        return install_validation(original(parser))

    return add_megatron_arguments


def _get_forward_backward_func(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        from megatron_ext.training.recovery import OverflowRerun

        return OverflowRerun(original(*args, **kwargs))

    return get_forward_backward_func


def _train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(forward_step_func, model, *args, **kwargs):
        from megatron_ext.training.warmup import warm_up_before_training

        warm_up_before_training(model)  # every stage at once, before the schedule's first send
        return original(forward_step_func, model, *args, **kwargs)

    return train


def _full_cuda_graph_wrapper(original: type) -> type:
    from megatron_ext.training.recovery import full_iteration_graph

    return full_iteration_graph(original)


def _moe_metrics_report(original: Callable) -> Callable:
    # Bound to the original's own signature, so a call by position or by name finds `track_names`
    # whatever parameters a release adds around it (0.20 put `num_moe_layers` after `num_layers`).
    signature = inspect.signature(original)

    @functools.wraps(original)
    def report(*args, **kwargs):
        from megatron_ext.training.recovery import capacity_metrics_on

        bound = signature.bind(*args, **kwargs)
        track_names = bound.arguments.get("track_names")
        if capacity_metrics_on() and track_names is not None:
            from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC

            names = [track_names] if isinstance(track_names, str) else list(track_names)
            bound.arguments["track_names"] = names + [
                m for m in (CAPACITY_USE_METRIC, CAPACITY_USE_MAX_METRIC) if m not in names
            ]
        return original(*bound.args, **bound.kwargs)

    return report


def _create_cudagraphs(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_cudagraphs(*args, **kwargs):
        from megatron_ext.training.recovery import capture_paused

        if capture_paused():  # a blocking re-run: nothing of it may be captured
            return None
        return original(*args, **kwargs)

    return create_cudagraphs


@dataclass(frozen=True)
class _Patch:
    target: str  # dotted name of the attribute replaced
    replacement: Callable[[Any], Any]  # original -> what replaces it
    feature: str


PATCHES: tuple[_Patch, ...] = (
    _Patch("megatron.core.transformer.moe.moe_layer.MoEFlexTokenDispatcher", _dispatcher, "dispatcher"),
    _Patch("megatron.core.transformer.moe.moe_layer.MoELayer.__init__", _moe_layer_init, "experts"),
    _Patch("megatron.training.arguments.TransformerConfig", _transformer_config, "arguments"),
    _Patch("megatron.training.argument_utils.TransformerConfig", _transformer_config, "arguments"),
    _Patch("megatron.core.transformer.MLATransformerConfig", _mla_transformer_config, "arguments"),
    _Patch("megatron.training.arguments.add_megatron_arguments", _add_megatron_arguments, "arguments"),
    _Patch("megatron.training.training.get_forward_backward_func", _get_forward_backward_func, "training"),
    _Patch("megatron.training.training.FullCudaGraphWrapper", _full_cuda_graph_wrapper, "training"),
    _Patch("megatron.core.transformer.moe.moe_logging.MoEMetricsTracker.report", _moe_metrics_report, "training"),
    _Patch("megatron.core.pipeline_parallel.schedules.create_cudagraphs", _create_cudagraphs, "training"),
    _Patch("megatron.training.training.train", _train, "training"),
)
FEATURES = ("dispatcher", "experts", "arguments", "training")

# The Megatron-Core symbols megatron-ext's modules look up while a model builds or trains, by the
# feature that needs them: `apply()` resolves them with the patch targets, before changing
# anything, so a release that moved one is refused with its name, never an AttributeError in a step.
RUNTIME_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher", "dispatcher"),
    ("megatron.core.transformer.moe.token_dispatcher.MoETokenDispatcher", "dispatcher"),
    ("megatron.core.transformer.moe.moe_utils.get_align_size_for_quantization", "dispatcher"),
    ("megatron.core.transformer.moe.moe_logging.get_moe_metrics_tracker", "dispatcher"),
    ("megatron.core.transformer.cuda_graphs.is_graph_warmup", "dispatcher"),
    ("megatron.core.transformer.cuda_graphs.is_graph_capturing", "dispatcher"),
    ("megatron.core.transformer.moe.experts.TEGroupedMLP", "experts"),
    ("megatron.core.transformer.moe.moe_utils.get_default_pg_collection", "experts"),
    ("megatron.core.fp8_utils.get_fp8_recipe", "experts"),
    ("megatron.core.transformer.utils.make_sharded_object_for_checkpoint", "experts"),
    ("megatron.core.tensor_parallel.random.get_cuda_rng_tracker", "experts"),
    ("megatron.core.tensor_parallel.random.get_expert_parallel_rng_tracker_name", "experts"),
    ("megatron.core.transformer.module.MegatronModule", "experts"),
    ("megatron.core.utils.get_pg_size", "experts"),
    ("megatron.core.utils.get_pg_rank", "experts"),
    ("megatron.core.dist_checkpointing.mapping.ShardedTensor", "experts"),
    ("megatron.core.transformer.transformer_config.TransformerConfig", "arguments"),
    ("megatron.core.transformer.transformer_config.MLATransformerConfig", "arguments"),
    ("megatron.core.transformer.enums.CudaGraphModule", "arguments"),
    ("megatron.training.argument_utils.ArgumentGroupFactory", "arguments"),
    ("megatron.training.arguments.add_megatron_arguments", "arguments"),
    ("megatron.core.models.gpt.gpt_layer_specs.LNImpl", "arguments"),
    ("megatron.core.transformer.torch_norm.WrappedTorchNorm", "arguments"),
    ("megatron.core.transformer.cuda_graphs.HAVE_TE_GRAPHS", "arguments"),
    ("megatron.core.utils.get_model_config", "training"),
    ("megatron.core.transformer.moe.moe_logging.get_moe_metrics_tracker", "training"),
    ("megatron.core.transformer.cuda_graphs.delete_cuda_graphs", "training"),
    ("megatron.core.transformer.cuda_graphs.CudaGraphManager", "training"),
    ("megatron.core.full_cuda_graph._shared_graph_pool", "training"),
    ("megatron.training.global_vars.get_args", "training"),
)

# What megatron-ext passes to the Megatron-Core callables it calls or wraps, by the feature that
# calls them: `apply()` checks each against the installed release's signature before changing
# anything, so a release that renamed, reordered or dropped a parameter is refused in one line naming
# the callable, never a wrong call in a step. A class is checked by its `__init__`.
_MOE = "megatron.core.transformer.moe"
SIGNATURES: tuple[tuple[str, str, Takes], ...] = (
    # Patch targets: how Megatron calls what replaces them, and how the replacement calls the original.
    (
        f"{_MOE}.moe_layer.MoEFlexTokenDispatcher",
        "dispatcher",
        Takes(("num_local_experts", "local_expert_indices"), ("config", "pg_collection")),
    ),
    (f"{_MOE}.moe_layer.MoELayer.__init__", "experts", Takes(("config", "submodules"))),
    ("megatron.training.arguments.add_megatron_arguments", "arguments", Takes(("parser",))),
    ("megatron.training.training.FullCudaGraphWrapper", "training", Takes(("forward_backward_func",))),
    (f"{_MOE}.moe_logging.MoEMetricsTracker.report", "training", Takes(keyword=("track_names",))),
    ("megatron.training.training.train", "training", Takes(("forward_step_func", "model"))),
    # Called while a model builds or trains.
    (f"{_MOE}.token_dispatcher.MoETokenDispatcher", "dispatcher", Takes(keyword=("config", "pg_collection"))),
    (f"{_MOE}.moe_utils.get_align_size_for_quantization", "dispatcher", Takes(("config",))),
    (
        f"{_MOE}.moe_logging.MoEMetricsTracker.record",
        "dispatcher",
        Takes(("name", "value", "layer_number", "num_layers")),
    ),
    ("megatron.core.fp8_utils.get_fp8_recipe", "experts", Takes(("config",))),
    ("megatron.core.transformer.module.MegatronModule", "experts", Takes(keyword=("config",))),
    (
        "megatron.core.transformer.utils.make_sharded_object_for_checkpoint",
        "experts",
        Takes(("obj", "key", "sharded_offsets"), ("replica_id",)),
    ),
    (
        "megatron.core.dist_checkpointing.mapping.ShardedTensor.from_rank_offsets",
        "experts",
        Takes(("key", "data"), ("replica_id", "prepend_axis_num")),
    ),
    ("megatron.core.utils.get_pg_size", "experts", Takes(("group",))),
    ("megatron.core.utils.get_pg_rank", "experts", Takes(("group",))),
    ("megatron.training.argument_utils.ArgumentGroupFactory", "arguments", Takes(("src_cfg_class",), ("exclude",))),
    ("megatron.training.argument_utils.ArgumentGroupFactory.build_group", "arguments", Takes(("parser", "title"))),
    ("megatron.core.utils.get_model_config", "training", Takes(("model",))),
    (f"{_MOE}.moe_logging.MoEMetricsTracker.clear", "training", Takes()),
)

# target -> (owner, attribute, original), for what is applied now
_applied: dict[str, tuple[Any, str, Any]] = {}


def applied() -> tuple[str, ...]:
    """The dotted names patched now."""
    return tuple(_applied)


def _feature_names(call: str, names: Any) -> list[str]:
    """`names` (one name or a collection of them) as a list of names of FEATURES or of PATCHES'
    targets; TypeError or ValueError naming `call`, the argument and the names it takes."""
    if isinstance(names, str):  # one name, not the collection of its letters
        names = [names]
    try:
        names = list(names)
    except TypeError:
        raise TypeError(f"{call}: give feature names ({', '.join(FEATURES)}) as strings; got {names!r}") from None
    targets = {p.target for p in PATCHES}
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{call}: give feature names ({', '.join(FEATURES)}) as strings; got {name!r}")
        if name not in FEATURES and name not in targets:
            meant = near_miss(name, FEATURES)
            hint = f"did you mean {meant!r}? " if meant else ""
            raise ValueError(
                f"{call}: no feature {name!r}; {hint}name one of {', '.join(FEATURES)}, or a dotted name that "
                "apply() returned."
            )
    return names


def _wanted(features: tuple, flags: dict[str, Any]) -> dict[str, bool]:
    """Which features `apply(*features, **flags)` patches: the named ones, or those whose flag is True."""
    for feature, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply: {feature}= takes True or False; got {value!r}")
    if not features:
        return flags
    named = _feature_names("apply", features)
    if not set(named) <= set(FEATURES):  # a dotted target: apply patches whole features
        raise ValueError(f"apply: name features ({', '.join(FEATURES)}), not patched attributes; got {named}")
    refused = [f for f in named if not flags[f]]
    if refused:
        raise ValueError(f"apply: {refused[0]!r} named and {refused[0]}=False; name it or turn it off, not both")
    return {feature: feature in named for feature in FEATURES}


def apply(
    *features: str, dispatcher: bool = True, experts: bool = True, arguments: bool = True, training: bool = True
) -> list[str]:
    """Patch Megatron-Core; return the dotted names this call patched (none when already applied).

    `apply()` patches every feature; `apply("dispatcher", "experts")` the features named (of
    FEATURES); `training=False` leaves Megatron's training loop alone (and does not import it): for
    code that runs MoE layers without `megatron.training.training.train`, as the bench and the tests do.

    Raises `UnsupportedMegatronError` for a megatron-core outside the supported range
    (`UnsupportedTorchError` for a torch),
    `MovedSymbolError` naming a target that is not where it should be and `ChangedSignatureError`
    (a `MovedSymbolError`) naming a callable whose parameters changed; in every case nothing is
    patched. A name not in FEATURES is a ValueError naming them, a flag that is not a bool a TypeError.
    """
    wanted = _wanted(features, dict(dispatcher=dispatcher, experts=experts, arguments=arguments, training=training))
    check_megatron_version()
    check_torch_version()
    for symbol, feature in RUNTIME_SYMBOLS:
        if wanted[feature]:
            resolve(symbol)  # MovedSymbolError naming it and the version
    for symbol, feature, takes in SIGNATURES:
        if wanted[feature]:
            check_signature(symbol, resolve(symbol), takes)  # ChangedSignatureError naming it
    todo = [p for p in PATCHES if wanted[p.feature] and p.target not in _applied]
    owners = []
    for patch in todo:
        owner_name, attribute = patch.target.rsplit(".", 1)
        try:
            owner = resolve(owner_name)
        except MovedSymbolError:
            owner = None
        if owner is None or attribute not in vars(owner):
            raise MovedSymbolError(
                f"megatron-ext needs `{patch.target}`, which megatron-core {megatron_core_version()} does not "
                f"define there (supported: megatron-core {supported_range()})."
            )
        owners.append((owner, attribute))
    # Every replacement is made (importing megatron-ext's modules) before the first is set: one
    # that raises leaves Megatron as it was.
    originals = [vars(owner)[attribute] for owner, attribute in owners]
    replacements = [patch.replacement(original) for patch, original in zip(todo, originals)]
    done = []
    for patch, (owner, attribute), original, replacement in zip(todo, owners, originals, replacements):
        setattr(owner, attribute, replacement)
        _applied[patch.target] = (owner, attribute, original)
        logger.debug("megatron-ext: patched %s", patch.target)
        done.append(patch.target)
    if done:  # one line per process; the attributes at DEBUG
        features = sorted({p.feature for p in todo})
        logger.log(
            once_per_job(logging.INFO),
            "megatron-ext: patched Megatron-Core (%s: %d attributes)",
            ", ".join(features),
            len(done),
        )
    return done


def revert(targets: Any = None) -> list[str]:
    """Restore the originals of `targets` (default: everything patched); return what was restored.

    `targets`: a feature's name (of FEATURES) or a dotted name `apply()` returned, or a collection
    of them (`apply()`'s list). A name of neither is a ValueError naming the features, never a
    silent no-op; a name not patched now restores nothing.
    """
    if targets is not None:
        wanted = set(_feature_names("revert", targets))
        targets = {p.target for p in PATCHES if p.target in wanted or p.feature in wanted}
    names = [t for t in reversed(list(_applied)) if targets is None or t in targets]
    for name in names:
        owner, attribute, original = _applied.pop(name)
        setattr(owner, attribute, original)
        logger.debug("megatron-ext: restored %s", name)
    if names:
        logger.log(once_per_job(logging.INFO), "megatron-ext: restored Megatron-Core (%d attributes)", len(names))
    return names


@contextlib.contextmanager
def patched(*names: str, **features: bool) -> Iterator[list[str]]:
    """Apply (with `apply`'s arguments) for the duration of a `with` block; revert only what this block applied."""
    done = apply(*names, **features)
    try:
        yield done
    finally:
        revert(done)


__all__ = [
    "FEATURES",
    "PATCHES",
    "RUNTIME_SYMBOLS",
    "SIGNATURES",
    "SUPPORTED_MEGATRON_CORE",
    "ChangedSignatureError",
    "MovedSymbolError",
    "Takes",
    "UnsupportedMegatronError",
    "UnsupportedTorchError",
    "applied",
    "apply",
    "check_megatron_version",
    "check_torch_version",
    "megatron_core_version",
    "patched",
    "resolve",
    "revert",
    "supported_range",
]
