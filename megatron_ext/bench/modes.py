"""The dispatch modes the bench compares, each a set of Megatron config overrides.

Every mode runs the same MoE stack (same weights, same inputs, the same experts), so what
differs between two rows of the table is the dispatch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from megatron_ext.options import COMPACT_ROUTING_FLAG, FP8_RECIPES, STATIC_SPLITS_FLAG, near_miss

FLEX = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


@dataclass(frozen=True)
class Mode:
    """One row of the bench.

    name: what the table and `--modes` call it. summary: one line for the table's legend.
    flags: the launch flags a user would set for it. overrides: the TransformerConfig fields.
    equality: how its results must match the blocking mode's: 'bitwise' (the same numbers in the
    same order) or 'close' (another implementation sums in another order).
    needs_deep_ep: runs only where `deep_ep.HybridEPBuffer` imports.
    experts: 'grouped' (megatron-ext's GroupedMLP, the same in every torch mode, so those rows
    differ in dispatch alone), 'te' (Megatron's TEGroupedMLP, unfused: it reads the counts on the
    host), or 'te-op-fuser' (TEGroupedMLP through TE's op fuser, which takes the counts on the device).
    overflow_rerun: each step runs through `megatron_ext.training.recovery.OverflowRerun`, as Megatron's
    training loop does with `--moe-hybridep-overflow-policy rerun`: the step's end check (one
    all-reduce, one host read) and the headroom metrics are in the step.
    reference: the mode whose results this one's are checked against (`blocking`, or the fp8
    modes' own blocking twin: fp8 and bf16 results differ by more than any summation order).
    fp8_recipe: Megatron's `--fp8-recipe` of an fp8 mode (None: the stack's dtype throughout).
    host_free: after its first step (capacity mode's calibration), a step reads nothing on the host:
    no host sync, so the host runs ahead of a busy GPU. Capacity mode with equal token counts
    declared, without the overflow re-run policy's end-of-step read, and with experts that take
    their counts on the device or as host constants (not TEGroupedMLP without static splits).
    What the tests expect of each mode (syncs forbidden or counted, the run-ahead verdict) comes
    from here.
    graph: after two eager steps (capacity mode's blocking calibration, then the non-blocking path,
    which compiles its kernels), the bench captures one whole forward+backward step in a CUDA graph
    and replays it for every step it checks, counts and times (`megatron_ext.bench.graphed`): what
    a step costs once the host launches nothing but the replay. On a GPU only; skipped on CPU.
    """

    name: str
    summary: str
    flags: tuple[str, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    equality: str = "bitwise"
    needs_deep_ep: bool = False
    experts: str = "grouped"
    overflow_rerun: bool = False
    graph: bool = False
    reference: str = "blocking"
    fp8_recipe: str | None = None
    host_free: bool = False

    @property
    def needs_te(self) -> bool:
        return self.experts != "grouped"


BLOCKING = "blocking"
STOCK = "megatron"
STOCK_TE = "megatron+te"
TE_FLAGS = ("--transformer-impl transformer_engine", "--moe-grouped-gemm")
OP_FUSER_FLAGS = (*TE_FLAGS, "--use-transformer-engine-op-fuser")
FP8_REFERENCE = "blocking+te+fp8"
# The modes that others are checked against, run first in this order.
REFERENCES = (BLOCKING, FP8_REFERENCE)
# The modes that have a `+graph` twin, listed right after them: the same flags, overrides and check.
GRAPHED = (
    "capacity+equal",
    "deep_ep+capacity+equal+reuse",
    "capacity+equal+te",
    "capacity+equal+static+te",
    "capacity+equal+te+fp8",
    "capacity+equal+te+fp8+fp8-weights",
    "capacity+equal+te+fp8+fp8-dispatch",
    "capacity+equal+static+te+fp8",
)
GRAPH_SKIP_REASON = "CUDA graphs need a GPU"
GRAPH_GLOO_SKIP_REASON = "a gloo group's collectives (ranks sharing a GPU) cannot be captured in a CUDA graph"


def skip_reason(
    mode: Mode, *, cuda: bool, gloo: bool, deep_ep_error: str | None, te_error: str | None, fuser_error: str | None
) -> str | None:
    """Why `mode` cannot run here, or None: the one rule of the run (which skips such a mode, saying
    why) and of the parse (which refuses one named in --modes). `gloo`: ranks on gloo (several ranks
    share a GPU); the errors: why deep_ep, Transformer Engine or its op fuser's experts cannot run."""
    if mode.graph and not cuda:
        return GRAPH_SKIP_REASON
    if mode.graph and gloo:
        return GRAPH_GLOO_SKIP_REASON
    if mode.needs_deep_ep and deep_ep_error is not None:
        return deep_ep_error
    if mode.needs_te and te_error is not None:
        return te_error
    if mode.experts == "te-op-fuser" and fuser_error is not None:
        return fuser_error
    return None


def graphed(mode: Mode) -> Mode:
    """`mode` with its whole step captured in a CUDA graph: `+graph` after its name, nothing else changed."""
    summary = f"as {mode.name}, the whole step captured once in a CUDA graph and replayed (GPU only)"
    return replace(mode, name=f"{mode.name}+graph", summary=summary, graph=True)


def fp8_modes(capacity_factor: float, recipe: str) -> tuple[Mode, ...]:
    """The fp8 modes (`recipe`, e4m3): blocking with TE's op-fuser experts, checked against bf16
    `blocking` within fp8's tolerance; capacity mode with those experts (the recipes whose grouped
    GEMM takes device counts) and with TEGroupedMLP and static expert splits, both checked against it."""
    fp8 = dict(fp8="e4m3", fp8_recipe=recipe)
    fp8_flags = ("--fp8-format e4m3", f"--fp8-recipe {recipe}")
    flex = (
        "--moe-token-dispatcher-type flex",
        "--moe-flex-dispatcher-backend hybridep",
        "--moe-hybridep-implementation torch",
    )
    torch_impl = dict(FLEX, moe_hybridep_implementation="torch", use_transformer_engine_op_fuser=True, **fp8)
    capacity_flags = (*flex, f"--moe-hybridep-capacity-factor {capacity_factor}", "--moe-hybridep-equal-token-counts")
    capacity = dict(moe_hybridep_capacity_factor=capacity_factor, moe_hybridep_equal_token_counts=True)
    checked = dict(equality="close", reference=FP8_REFERENCE, fp8_recipe=recipe, host_free=True)
    # The reference runs the experts of the capacity modes checked against it: TE's op-fuser ones,
    # or for a recipe they cannot take in capacity mode, TEGroupedMLP, which static splits feed
    # (like against like: TE's op fuser quantizes such a recipe its own way).
    op_fuser_reference = recipe in FP8_RECIPES
    reference_of = "" if op_fuser_reference else " with TEGroupedMLP, the experts the static-splits mode runs"
    reference = Mode(
        FP8_REFERENCE,
        f"as blocking+te in fp8 ({recipe}){reference_of}: the reference of the fp8 modes",
        (*flex, *(OP_FUSER_FLAGS if op_fuser_reference else TE_FLAGS), *fp8_flags),
        dict(torch_impl, use_transformer_engine_op_fuser=op_fuser_reference),
        equality="close",
        experts="te-op-fuser" if op_fuser_reference else "te",
        fp8_recipe=recipe,
    )
    op_fuser = Mode(
        "capacity+equal+te+fp8",
        f"as capacity+equal+te in fp8 ({recipe}), checked against {FP8_REFERENCE}",
        (*capacity_flags, *OP_FUSER_FLAGS, *fp8_flags),
        dict(torch_impl, **capacity),
        experts="te-op-fuser",
        **checked,
    )
    # fp8 primary weights: TE's layers keep their weights in fp8 and cast nothing in the step.
    fp8_weights = Mode(
        "capacity+equal+te+fp8+fp8-weights",
        f"as capacity+equal+te+fp8, the expert weights kept in fp8 (--fp8-param-gather), "
        f"checked against {FP8_REFERENCE}",
        (*op_fuser.flags, "--fp8-param-gather", "--use-distributed-optimizer"),
        dict(op_fuser.overrides, fp8_param=True),
        experts="te-op-fuser",
        **checked,
    )
    # fp8 on the wire: tokens quantized before the dispatch in blockwise's 1 x 128 blocks, dequantized
    # after it; the forward as the reference's, the first GEMM's weight gradient close to it.
    fp8_dispatch = Mode(
        "capacity+equal+te+fp8+fp8-dispatch",
        f"as capacity+equal+te+fp8, tokens dispatched in fp8 (--moe-hybridep-fp8-dispatch), "
        f"checked against {FP8_REFERENCE}",
        (*op_fuser.flags, "--moe-hybridep-fp8-dispatch"),
        dict(op_fuser.overrides, moe_hybridep_fp8_dispatch=True),
        experts="te-op-fuser",
        **checked,
    )
    static = Mode(
        "capacity+equal+static+te+fp8",
        f"as capacity+equal+static+te in fp8 ({recipe}), checked against {FP8_REFERENCE}",
        (*capacity_flags, STATIC_SPLITS_FLAG, *TE_FLAGS, *fp8_flags),
        dict(torch_impl, **capacity, moe_hybridep_static_expert_splits=True, use_transformer_engine_op_fuser=False),
        experts="te",
        **checked,
    )
    # Other recipes: TE's op-fuser experts would read the counts on the host (refused in capacity mode).
    if recipe not in FP8_RECIPES:
        return (reference, static)
    return (reference, op_fuser, fp8_weights, *((fp8_dispatch,) if recipe == "blockwise" else ()), static)


def all_modes(capacity_factor: float, fp8_recipe: str | None = None) -> tuple[Mode, ...]:
    """Every mode, in the order the table shows them (the bench runs the references first); the fp8
    modes with `fp8_recipe` only."""
    factor = dict(moe_hybridep_capacity_factor=capacity_factor)
    equal = dict(moe_hybridep_equal_token_counts=True)
    torch_impl = dict(FLEX, moe_hybridep_implementation="torch")
    flex_flags = ("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend hybridep")
    factor_flag = f"--moe-hybridep-capacity-factor {capacity_factor}"

    def capacity_equal(name, summary, flags=(), overrides=None, implementation="torch", host_free=True, **mode):
        """Capacity mode with equal token counts declared on `implementation` (its flag listed for
        deep_ep only, as a torch mode's flags never listed it), plus `flags` and `overrides`:
        host-free unless said otherwise."""
        named = () if implementation == "torch" else (f"--moe-hybridep-implementation {implementation}",)
        return Mode(
            name,
            summary,
            (*flex_flags, *named, factor_flag, "--moe-hybridep-equal-token-counts", *flags),
            dict(FLEX, moe_hybridep_implementation=implementation, **factor, **equal, **(overrides or {})),
            host_free=host_free,
            **mode,
        )

    reuse = ("--moe-hybridep-reuse-allgather-buffer",), dict(moe_hybridep_reuse_allgather_buffer=True)
    rerun = ("--moe-hybridep-overflow-policy rerun",), dict(moe_hybridep_overflow_policy="rerun")
    modes = (
        Mode(
            STOCK,
            "stock Megatron-Core: the alltoall dispatcher",
            ("--moe-token-dispatcher-type alltoall",),
            dict(moe_token_dispatcher_type="alltoall"),
            equality="close",
        ),
        Mode(
            BLOCKING,
            "megatron-ext's dispatcher, every dispatch blocking (one host read of the counts each)",
            (*flex_flags, "--moe-hybridep-implementation torch"),
            torch_impl,
        ),
        Mode(
            "capacity+pad",
            "capacity mode, counts padded to the EP-group max (Megatron's uneven-input pad: all-reduce + host read)",
            (*flex_flags, factor_flag, "--moe-hybridep-pad-uneven-dispatch-inputs"),
            dict(torch_impl, **factor, moe_hybridep_pad_uneven_dispatch_inputs=True),
        ),
        capacity_equal("capacity+equal", "capacity mode, equal token counts declared (no all-reduce)"),
        capacity_equal(
            "capacity+equal+check",
            "as capacity+equal, the declaration checked on the device (one small all-reduce)",
            ("--moe-hybridep-verify-equal-token-counts",),
            dict(moe_hybridep_verify_equal_token_counts=True),
        ),
        capacity_equal("capacity+equal+reuse", "as capacity+equal, routing maps gathered into a reused buffer", *reuse),
        capacity_equal(
            "capacity+equal+rerun",
            "as capacity+equal, each step through the overflow re-run policy (Megatron's training loop)",
            *rerun,
            overflow_rerun=True,
            host_free=False,  # the policy's check at the step's end: one all-reduce, one host read
        ),
        Mode(
            "blocking+compact",
            "as blocking, routing maps gathered as top-k expert indices (compact routing)",
            (*flex_flags, "--moe-hybridep-implementation torch", COMPACT_ROUTING_FLAG),
            dict(torch_impl, moe_hybridep_compact_routing=True),
        ),
        capacity_equal(
            "capacity+equal+reuse+compact",
            "as capacity+equal+reuse, routing maps gathered as top-k expert indices (compact routing)",
            (*reuse[0], COMPACT_ROUTING_FLAG),
            dict(reuse[1], moe_hybridep_compact_routing=True),
        ),
        Mode(
            "deep_ep",
            "stock Megatron-Core's HybridEP dispatch on deep_ep's kernels",
            flex_flags,
            dict(FLEX),
            equality="close",
            needs_deep_ep=True,
        ),
        capacity_equal(
            "deep_ep+capacity+equal+reuse",
            "megatron-ext's capacity mode, equal counts and reuse on deep_ep's kernels",
            *reuse,
            implementation="deep_ep",
            equality="close",
            needs_deep_ep=True,
        ),
        capacity_equal(
            "deep_ep+capacity+equal+reuse+rerun",
            "as deep_ep+capacity+equal+reuse, each step through the overflow re-run policy",
            (*reuse[0], *rerun[0]),
            dict(reuse[1], **rerun[1]),
            implementation="deep_ep",
            equality="close",
            needs_deep_ep=True,
            overflow_rerun=True,
            host_free=False,
        ),
        # Transformer Engine's grouped experts (GPU, TE installed); 'close': TE's GEMMs round differently.
        Mode(
            STOCK_TE,
            "stock Megatron-Core with TE's grouped experts: the alltoall dispatcher, TEGroupedMLP (counts read on "
            "the host)",
            ("--moe-token-dispatcher-type alltoall", *TE_FLAGS),
            dict(moe_token_dispatcher_type="alltoall"),
            equality="close",
            experts="te",
        ),
        Mode(
            "blocking+te",
            "as blocking, experts TEGroupedMLP through TE's op fuser (counts on the device)",
            (*flex_flags, "--moe-hybridep-implementation torch", *OP_FUSER_FLAGS),
            dict(torch_impl, use_transformer_engine_op_fuser=True),
            equality="close",
            experts="te-op-fuser",
        ),
        capacity_equal(
            "capacity+equal+te",
            "as capacity+equal, experts TEGroupedMLP through TE's op fuser (counts on the device)",
            OP_FUSER_FLAGS,
            dict(use_transformer_engine_op_fuser=True),
            equality="close",
            experts="te-op-fuser",
        ),
        capacity_equal(
            "capacity+equal+static+te",
            "as capacity+equal, experts TEGroupedMLP without the op fuser, given a fixed row budget each "
            "(static expert splits: host-constant counts)",
            (STATIC_SPLITS_FLAG, *TE_FLAGS),
            dict(moe_hybridep_static_expert_splits=True),
            equality="close",
            experts="te",
        ),
    )
    if fp8_recipe is not None:
        modes += fp8_modes(capacity_factor, fp8_recipe)
    return tuple(m for mode in modes for m in ((mode, graphed(mode)) if mode.name in GRAPHED else (mode,)))


def mode_names(text: str | None) -> list[str] | None:
    """`--modes`' names: comma-separated, the spaces around each not part of it ("blocking,
    capacity+equal"); None where no names are given."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    return names or None


def select(names: list[str] | None, capacity_factor: float, fp8_recipe: str | None = None) -> tuple[Mode, ...]:
    """The modes named (with the modes they are checked against), in table order; ValueError on an
    unknown name."""
    modes = all_modes(capacity_factor, fp8_recipe)
    if not names:
        return modes
    known = {m.name for m in modes}
    unknown = [n for n in names if n not in known]
    if unknown:
        fp8 = {m.name for m in fp8_modes(capacity_factor, "tensorwise")}
        hint = " (the fp8 modes need --fp8-recipe)" if fp8_recipe is None and set(unknown) & fp8 else ""
        meant = {n: near_miss(n, known) for n in unknown if n not in fp8}
        said = [f"{n!r} (did you mean {meant[n]}?)" if meant.get(n) else repr(n) for n in unknown]
        raise ValueError(f"--modes: unknown mode(s) {', '.join(said)}{hint}; choose from {', '.join(sorted(known))}")
    wanted = set(names) | {BLOCKING}
    wanted |= {m.reference for m in modes if m.name in wanted}
    return tuple(m for m in modes if m.name in wanted)
