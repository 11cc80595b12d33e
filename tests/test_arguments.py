"""megatron-ext's flags in Megatron's own `parse_args`: with the patch, without it, and in the config.

Megatron is imported once for the module (it is slow to import). Each test that applies the patch
reverts it, so other test modules in the same process see stock Megatron.
"""

import logging
import re
import sys
import types

import pytest
import torch

import megatron_ext.patches as patches

BASE_ARGV = [
    "prog",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-experts",
    "8",
    "--moe-token-dispatcher-type",
    "flex",
    "--moe-flex-dispatcher-backend",
    "hybridep",
    "--bf16",  # capacity mode's own experts compute in bf16 on a GPU
]
ALL_FLAGS = [
    "--moe-hybridep-capacity-factor",
    "1.5",
    "--moe-hybridep-equal-token-counts",
    "--moe-hybridep-reuse-allgather-buffer",
    "--moe-hybridep-implementation",
    "torch",
    "--moe-hybridep-verify-equal-token-counts",
    "--moe-hybridep-overflow-policy",
    "fail",
    "--moe-hybridep-transport",
    "nvshmem",
    "--moe-hybridep-compact-routing",
]
ALL_VALUES = {
    "moe_hybridep_capacity_factor": 1.5,
    "moe_hybridep_equal_token_counts": True,
    "moe_hybridep_verify_equal_token_counts": True,
    "moe_hybridep_reuse_allgather_buffer": True,
    "moe_hybridep_implementation": "torch",
    "moe_hybridep_overflow_policy": "fail",
    "moe_hybridep_transport": "nvshmem",
    "moe_hybridep_compact_routing": True,
}
DEFAULTS = {
    "moe_hybridep_capacity_factor": None,
    "moe_hybridep_equal_token_counts": False,
    "moe_hybridep_verify_equal_token_counts": False,
    "moe_hybridep_reuse_allgather_buffer": False,
    "moe_hybridep_implementation": "auto",
    "moe_hybridep_overflow_policy": "rerun",
    "moe_hybridep_transport": "auto",
    "moe_hybridep_compact_routing": False,
}
# A phrase of each field's docstring, which is its --help text.
HELP_PHRASES = {
    "--moe-hybridep-capacity-factor": "calibration dispatch",
    "--moe-hybridep-equal-token-counts": "same number of tokens",
    "--moe-hybridep-verify-equal-token-counts": "fail loudly",
    "--moe-hybridep-reuse-allgather-buffer": "one buffer per process group",
    "--moe-hybridep-implementation": "implementation on torch.distributed",
    "--moe-hybridep-overflow-policy": "run again with blocking dispatches",
    "--moe-hybridep-transport": "all_to_all_vdev",
    "--moe-hybridep-compact-routing": "top-k expert indices",
    "--moe-hybridep-fp8-dispatch": "1 x 128 blocks",
    "--moe-hybridep-kernel-cache": "across jobs",
}
FP8 = ["--fp8-format", "e4m3", "--fp8-recipe"]
TINY = dict(num_layers=1, hidden_size=16, num_attention_heads=1, num_moe_experts=4)
HYBRIDEP = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


@pytest.fixture(scope="module")
def megatron_arguments():
    """`megatron.training.arguments`, imported once, with nothing patched."""
    patches.revert()
    import megatron.training.arguments as arguments

    yield arguments
    patches.revert()


@pytest.fixture(autouse=True)
def nothing_left_patched():
    yield
    patches.revert()
    assert patches.applied() == ()


@pytest.fixture
def patched(megatron_arguments):
    """The patch applied for one test."""
    patches.apply()
    yield megatron_arguments
    patches.revert()


@pytest.fixture
def unpatched(megatron_arguments):
    """Stock Megatron, checked."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    patches.revert()
    assert patches.applied() == ()
    assert megatron_arguments.TransformerConfig is TransformerConfig
    assert not hasattr(megatron_arguments.add_megatron_arguments, "__wrapped__")
    return megatron_arguments


def parse(arguments, monkeypatch, *extra, provider=None):
    monkeypatch.setattr(sys, "argv", [*BASE_ARGV, *extra])
    return arguments.parse_args(extra_args_provider=provider)


def parse_error(arguments, monkeypatch, capsys, *extra, provider=None, usage=False):
    """stderr of a parse that must stop with argparse's error (exit status 2).

    megatron-ext's refusals (and argparse's errors for its flags) are the one line
    `prog: error: <message>`, without the usage block (`usage=False`); Megatron's own errors keep
    argparse's usage (`usage=True`).
    """
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        parse(arguments, monkeypatch, *extra, provider=provider)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "prog: error:" in err
    if usage:
        assert err.startswith("usage: prog"), err[:200]
    else:
        assert "usage:" not in err, err[:600]
        assert err.startswith("prog: error: ") and err.count("\n") == 1, err[:600]
    return err


def escape_stray_percent(parser):
    """An extra_args_provider that lets `--help` print at all with megatron-core 0.19.2.

    A docstring of Megatron's own TransformerConfig (moe_paged_stash_buffer_size_factor_cuda:
    "... = 10%).") becomes argparse help with a bare '%', so stock `parse_args` crashes on
    `--help` with "ValueError: unsupported format character". Escape such '%'s, but never in
    megatron-ext's own help, which must print as it is.
    """
    from megatron_ext.options.config import FIELD_NAMES

    for action in parser._actions:
        if not isinstance(action.help, str):
            continue
        escaped = re.sub(r"%%|%\(|%", lambda m: m.group(0) if len(m.group(0)) == 2 else "%%", action.help)
        if escaped != action.help:
            assert action.dest not in FIELD_NAMES, f"megatron-ext's help for {action.dest} has a bare '%'"
            action.help = escaped
    return parser


def print_help(arguments, monkeypatch, capsys, provider):
    """`--help` output, whitespace normalised; the parse must exit with status 0."""
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping inside flag names or phrases
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        parse(arguments, monkeypatch, "--help", provider=provider)
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def hybridep_values(namespace_or_config):
    return {name: getattr(namespace_or_config, name) for name in DEFAULTS}


def test_field_names():
    from megatron_ext.options.config import FIELD_NAMES

    assert FIELD_NAMES == (
        "moe_hybridep_capacity_factor",
        "moe_hybridep_equal_token_counts",
        "moe_hybridep_verify_equal_token_counts",
        "moe_hybridep_reuse_allgather_buffer",
        "moe_hybridep_implementation",
        "moe_hybridep_overflow_policy",
        "moe_hybridep_transport",
        "moe_hybridep_static_expert_splits",
        "moe_hybridep_compact_routing",
        "moe_hybridep_fp8_dispatch",
        "moe_hybridep_warm_up",
        "moe_hybridep_kernel_cache",
    )
    # the options the dispatcher reads are exactly these fields (megatron_ext.options cannot import Megatron)
    from megatron_ext.options import CONFIG_PREFIX, OPTION_NAMES

    assert tuple(CONFIG_PREFIX + name for name in OPTION_NAMES) == FIELD_NAMES


# --- with the patch --------------------------------------------------------------------------


def test_patched_parse_args_accepts_the_flags(patched, monkeypatch):
    args = parse(patched, monkeypatch, *ALL_FLAGS)
    assert hybridep_values(args) == ALL_VALUES
    assert isinstance(args.moe_hybridep_capacity_factor, float)


def test_patched_parse_args_defaults(patched, monkeypatch):
    args = parse(patched, monkeypatch)
    assert hybridep_values(args) == DEFAULTS


def test_patched_config_from_args_carries_the_values(patched, monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_ext.options.config import HybridEPTransformerConfig

    args = parse(patched, monkeypatch, *ALL_FLAGS, "--no-rope-fusion")
    args.params_dtype = torch.float32  # set by validate_args in a real launch

    config = core_transformer_config_from_args(args)

    assert type(config) is HybridEPTransformerConfig
    assert hybridep_values(config) == ALL_VALUES
    assert config.num_moe_experts == 8 and config.moe_token_dispatcher_type == "flex"


def test_patched_config_from_args_after_validate_args(patched, monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args, validate_args

    from megatron_ext.options.config import HybridEPTransformerConfig

    args = parse(
        patched,
        monkeypatch,
        *ALL_FLAGS,
        "--no-rope-fusion",
        "--micro-batch-size",
        "1",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
    )
    validate_args(args)

    config = core_transformer_config_from_args(args)

    assert type(config) is HybridEPTransformerConfig
    assert hybridep_values(config) == ALL_VALUES


def test_patched_config_from_args_defaults(patched, monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    args = parse(patched, monkeypatch, "--no-rope-fusion")
    args.params_dtype = torch.float32

    config = core_transformer_config_from_args(args)

    assert hybridep_values(config) == DEFAULTS


def test_patched_help_lists_flags_and_docstrings(patched, monkeypatch, capsys):
    out = print_help(patched, monkeypatch, capsys, escape_stray_percent)

    for flag_name, phrase in HELP_PHRASES.items():
        assert flag_name in out
        assert phrase in out, f"help for {flag_name} lacks {phrase!r}"
    assert "{auto,deep_ep,torch}" in out


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--moe-hybridep-capacity-factor", "0.8"],
            ["--moe-hybridep-capacity-factor 0.8 would drop tokens", ">= 1.0"],
        ),
        (
            ["--moe-hybridep-capacity-factor", "1.5", "--moe-token-dispatcher-type", "alltoall"],
            [
                "--moe-hybridep-capacity-factor",
                "got --moe-token-dispatcher-type alltoall",
                "Set --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep",
            ],
        ),
        (
            ["--moe-hybridep-equal-token-counts", "--moe-flex-dispatcher-backend", "deepep"],
            ["--moe-hybridep-equal-token-counts", "--moe-flex-dispatcher-backend hybridep"],
        ),
        (
            # Megatron's own parse accepts this flag (its requirements are checked when the config
            # is built), so megatron-ext's check is the one that refuses the combination.
            ["--moe-hybridep-capacity-factor", "1.5", "--moe-expert-rank-capacity-factor", "1.2"],
            ["--moe-hybridep-capacity-factor and --moe-expert-rank-capacity-factor", "use one"],
        ),
        (
            # Megatron's token-dropping MoE: its router drops tokens per expert beyond the capacity.
            ["--moe-hybridep-capacity-factor", "1.5", "--moe-expert-capacity-factor", "1.0"],
            [
                "--moe-hybridep-capacity-factor cannot be combined with --moe-expert-capacity-factor",
                "drop --moe-expert-capacity-factor: capacity mode sizes the dispatch itself and drops nothing; "
                "Megatron's factor drops tokens per expert in the router",
            ],
        ),
        (
            ["--moe-hybridep-capacity-factor", "1.5", "--moe-expert-capacity-factor", "1.0"]
            + ["--moe-pad-expert-input-to-capacity"],
            [
                "--moe-hybridep-capacity-factor cannot be combined with --moe-expert-capacity-factor and "
                "--moe-pad-expert-input-to-capacity",
                "drops nothing",
            ],
        ),
        (
            ["--moe-hybridep-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"],
            ["--moe-hybridep-capacity-factor cannot be combined with --moe-pad-expert-input-to-capacity"],
        ),
        (
            ["--moe-hybridep-equal-token-counts", "--moe-hybridep-pad-uneven-dispatch-inputs"],
            ["--moe-hybridep-equal-token-counts", "--moe-hybridep-pad-uneven-dispatch-inputs", "Use one"],
        ),
        (
            ["--moe-hybridep-verify-equal-token-counts"],
            ["--moe-hybridep-verify-equal-token-counts", "--moe-hybridep-equal-token-counts", "set that flag too"],
        ),
        (
            ["--moe-hybridep-overflow-policy", "fail"],
            ["--moe-hybridep-overflow-policy fail", "--moe-hybridep-capacity-factor too"],
        ),
        (
            ["--moe-hybridep-transport", "process_group"],
            ["--moe-hybridep-transport process_group", "--moe-hybridep-capacity-factor too"],
        ),
        (
            [
                "--moe-hybridep-transport",
                "nvshmem",
                "--moe-hybridep-capacity-factor",
                "1.5",
                "--moe-hybridep-implementation",
                "deep_ep",
                "--hidden-size",
                "256",
            ],
            ["--moe-hybridep-transport nvshmem", "deep_ep's kernels move their own bytes", "implementation torch"],
        ),
        (
            ["--moe-hybridep-compact-routing", "--moe-hybridep-implementation", "deep_ep", "--hidden-size", "256"],
            [
                "--moe-hybridep-compact-routing with --moe-hybridep-implementation deep_ep",
                "nothing would be saved",
                "Use --moe-hybridep-implementation torch",
            ],
        ),
        (
            ["--moe-hybridep-compact-routing", "--moe-token-dispatcher-type", "alltoall"],
            ["--moe-hybridep-compact-routing: megatron-ext's options work with the HybridEP flex dispatcher only"],
        ),
        (
            ["--moe-hybridep-fp8-dispatch"],
            [
                "--moe-hybridep-fp8-dispatch quantizes tokens in 1 x 128 blocks",
                "with no --fp8-format (bf16 experts) it would change the layer's results",
                "Use --fp8-format e4m3 --fp8-recipe blockwise",
            ],
        ),
        (
            ["--moe-hybridep-fp8-dispatch", *FP8, "tensorwise"],
            ["with --fp8-format e4m3 --fp8-recipe tensorwise it would change the layer's results"],
        ),
        (
            ["--moe-hybridep-fp8-dispatch", *FP8, "blockwise", "--hidden-size", "200"],
            ["--moe-hybridep-fp8-dispatch with --hidden-size 200", "a multiple of 128"],
        ),
        (
            ["--moe-hybridep-fp8-dispatch", *FP8, "blockwise", "--hidden-size", "640"]
            + ["--moe-hybridep-implementation", "deep_ep"],
            [
                "--moe-hybridep-implementation deep_ep: hidden size 640 is not a multiple of 512, as deep_ep's fp8 "
                "dispatch (--moe-hybridep-fp8-dispatch) needs",
                "Use --moe-hybridep-implementation torch (or auto, which picks torch for this size)",
            ],
        ),
        (
            ["--moe-hybridep-kernel-cache", __file__ + "/kernels"],
            ["--moe-hybridep-kernel-cache", "not a folder this process can write", "Give a writable folder"],
        ),
    ],
    ids=[
        "factor-below-1",
        "factor-alltoall",
        "equal-deepep-backend",
        "factor-and-expert-rank-factor",
        "factor-and-expert-capacity-factor",
        "factor-and-drop-and-pad",
        "factor-and-pad-to-capacity",
        "equal-and-pad-uneven",
        "verify-without-equal",
        "policy-without-factor",
        "transport-without-factor",
        "transport-with-deep_ep",
        "compact-routing-with-deep_ep",
        "compact-routing-alltoall",
        "fp8-dispatch-in-bf16",
        "fp8-dispatch-tensorwise",
        "fp8-dispatch-hidden-200",
        "fp8-dispatch-deep_ep-hidden-640",
        "kernel-cache-under-a-file",
    ],
)
def test_patched_parse_args_refuses_invalid_combinations(patched, monkeypatch, capsys, extra, expected):
    err = parse_error(patched, monkeypatch, capsys, *extra)
    for text in expected:
        assert text in err, f"{text!r} not in {err[-600:]!r}"


CAPACITY = ["--moe-hybridep-capacity-factor", "1.5"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--moe-router-topk", "0"],
            ["--moe-router-topk 0: each token goes to between 1 and --num-experts (8) experts", "use a top-k"],
        ),
        (
            ["--moe-router-topk", "9"],
            ["--moe-router-topk 9: each token goes to between 1 and --num-experts (8) experts", "use a top-k"],
        ),
        (
            [*CAPACITY, "--expert-tensor-parallel-size", "2"],
            [
                "--moe-hybridep-capacity-factor with --expert-tensor-parallel-size 2: capacity mode's experts are not "
                "split by tensor parallelism",
                "Pass --expert-tensor-parallel-size 1",
            ],
        ),
        (
            # Megatron gives the experts the tensor-parallel size unless told otherwise: the message says so.
            [*CAPACITY, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            [
                "--expert-tensor-parallel-size 2 (Megatron's default: --tensor-model-parallel-size 2)",
                "Pass --expert-tensor-parallel-size 1",
            ],
        ),
        (
            [*CAPACITY, "--context-parallel-size", "2"],
            [
                "--moe-hybridep-capacity-factor with --context-parallel-size 2: megatron-ext has not run or tested",
                "Use --context-parallel-size 1, or drop --moe-hybridep-capacity-factor",
            ],
        ),
    ],
    ids=["topk-0", "topk-above-experts", "etp-2", "tp-2-default-etp", "cp-2"],
)
def test_patched_parse_args_refuses_parallelism_and_routing_a_run_cannot_take(
    patched, monkeypatch, capsys, extra, expected
):
    err = parse_error(patched, monkeypatch, capsys, *extra)  # exit status 2, one line
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", *CAPACITY],
        ["--context-parallel-size", "2"],  # the blocking dispatch, as stock Megatron
        ["--expert-tensor-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2", *CAPACITY],  # not refused: see docs/support.md
        ["--moe-router-topk", "8"],
    ],
    ids=["tp-2-etp-1-capacity", "cp-2-blocking", "etp-2-blocking", "pp-2-capacity", "topk-all-experts"],
)
def test_patched_parse_args_accepts_the_parallelism_it_supports(patched, monkeypatch, extra):
    parse(patched, monkeypatch, *extra)


def test_patched_parse_args_refuses_deep_ep_when_it_does_not_import(patched, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` now raises ImportError

    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-implementation", "deep_ep", "--hidden-size", "256")

    assert "--moe-hybridep-implementation deep_ep" in err
    assert "deep_ep's HybridEPBuffer is not usable here (ModuleNotFoundError" in err and "(tested: 94a9f8f)" in err
    assert "--moe-hybridep-implementation torch" in err


@pytest.mark.parametrize(
    "hidden, reason",
    [
        ("64", "hidden size 64 is below 128, where deep_ep's HybridEPBuffer constructor aborts"),
        ("200", "not a multiple of 16"),
    ],
)
def test_patched_parse_args_refuses_deep_ep_at_a_hidden_size_it_cannot_take(
    patched, monkeypatch, capsys, hidden, reason
):
    # Refused whether or not deep_ep imports here: the size is what is wrong.
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-implementation", "deep_ep", "--hidden-size", hidden)

    assert "--moe-hybridep-implementation deep_ep" in err
    assert reason in err
    assert "--moe-hybridep-implementation torch" in err


def test_auto_picks_torch_at_a_hidden_size_deep_ep_cannot_take(monkeypatch, caplog):
    from megatron_ext import options
    from megatron_ext.options import implementation

    monkeypatch.setattr(implementation, "deep_ep_import_error", lambda: None)  # as where deep_ep imports
    monkeypatch.setattr(implementation, "_AUTO_FALLBACKS_LOGGED", set())
    assert options.resolve_implementation("auto", 4096) == "deep_ep"
    assert options.resolve_implementation("auto", None) == "deep_ep"
    with caplog.at_level(logging.WARNING, logger="megatron_ext.options"):
        assert options.resolve_implementation("auto", 64) == "torch"
        assert options.resolve_implementation("auto", 64) == "torch"
    fallbacks = [r.getMessage() for r in caplog.records if "auto uses the torch implementation" in r.getMessage()]
    assert len(fallbacks) == 1 and "hidden size 64 is below 128" in fallbacks[0], fallbacks
    assert options.resolve_implementation("deep_ep", 64) == "deep_ep"  # explicit: validate() refuses it
    # --moe-hybridep-fp8-dispatch: deep_ep's fp8 kernels take multiples of 512 only.
    assert options.resolve_implementation("auto", 1024, fp8_dispatch=True) == "deep_ep"
    assert options.resolve_implementation("auto", 384) == "deep_ep"
    assert options.resolve_implementation("auto", 384, fp8_dispatch=True) == "torch"
    monkeypatch.setattr(implementation, "deep_ep_import_error", lambda: "ImportError: no deep_ep")
    assert options.resolve_implementation("auto", 4096) == "torch"


def test_compact_routing_makes_auto_pick_torch(monkeypatch, caplog):
    """deep_ep's dispatch gathers the dense map whatever it is given: with compact routing, auto
    takes the torch implementation where it would take deep_ep, and says so once."""
    from megatron_ext import dispatcher, options
    from megatron_ext.options import implementation

    monkeypatch.setattr(implementation, "deep_ep_import_error", lambda: None)  # as where deep_ep imports
    monkeypatch.setattr(implementation, "_AUTO_FALLBACKS_LOGGED", set())
    compact = options.HybridEPOptions(compact_routing=True)
    assert dispatcher.agreed_implementation(options.HybridEPOptions(), 4096, None) == "deep_ep"
    with caplog.at_level(logging.INFO, logger="megatron_ext.options"):
        assert dispatcher.agreed_implementation(compact, 4096, None) == "torch"
        assert dispatcher.agreed_implementation(compact, 4096, None) == "torch"
    said = [r.getMessage() for r in caplog.records if "--moe-hybridep-compact-routing" in r.getMessage()]
    assert len(said) == 1 and "auto uses the torch implementation" in said[0], said
    assert options.HybridEPOptions(compact_routing=True).changes_dispatch


def test_a_deep_ep_build_without_non_blocking_dispatch_is_not_used(patched, monkeypatch, capsys):
    """hybrid-ep builds before the non-blocking dispatch import, then fail at the first dispatch
    with a TypeError: explicit deep_ep is refused when parsed, and auto picks torch."""
    from megatron_ext import options

    class OldBuffer:
        def dispatch_with_permute(self, *, hidden, routing_map=None, probs=None, handle=None):
            pass

    class KeywordsBuffer:  # a signature that takes any keyword is trusted
        def dispatch_with_permute(self, **kwargs):
            pass

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=OldBuffer))
    reason = options.deep_ep_import_error()
    assert reason is not None and "takes no num_permuted_tokens, non_blocking, pad_multiple" in reason
    assert options.resolve_implementation("auto", 4096) == "torch"
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-implementation", "deep_ep", "--hidden-size", "256")
    assert "is not usable here (its dispatch_with_permute takes no num_permuted_tokens" in err, err[-600:]
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=KeywordsBuffer))
    assert options.deep_ep_import_error() is None


def test_deep_ep_tuning_flags_reach_deep_eps_constructor_as_megatron_passes_them(patched, monkeypatch):
    """Megatron's tuning flags, parsed, become deep_ep's constructor keywords as Megatron-Core
    0.19.2 maps them (one SM count for dispatch and combine; the preprocessing default 108 passed
    as it is), and the torch implementation's note names the real flags."""
    from megatron_ext.hybridep.deep_ep_buffer import DeepEPTuning, tuning_flags_set

    assert tuning_flags_set(parse(patched, monkeypatch)) == []
    assert DeepEPTuning.from_config(parse(patched, monkeypatch)).keywords() == {"num_sms_preprocessing_api": 108}
    tuning = ["--moe-flex-dispatcher-num-sms", "24", "--moe-hybridep-num-blocks-permute", "8"]
    tuning += ["--moe-hybridep-num-blocks-unpermute", "6", "--moe-hybridep-num-sms-preprocessing", "64"]
    config = parse(patched, monkeypatch, *tuning)
    assert tuning_flags_set(config) == tuning[::2]
    assert DeepEPTuning.from_config(config).keywords() == {
        "num_sms_dispatch_api": 24,
        "num_sms_combine_api": 24,
        "num_sms_preprocessing_api": 64,
        "num_blocks_permute": 8,
        "num_blocks_unpermute": 6,
    }


def test_patched_parse_args_takes_a_kernel_cache_folder_to_be_made(patched, monkeypatch, tmp_path):
    """A folder that does not exist yet, under a writable one, is taken as it is given (made when
    the first deep_ep buffer stores kernels)."""
    folder = str(tmp_path / "jobs" / "kernels")
    assert parse(patched, monkeypatch, "--moe-hybridep-kernel-cache", folder).moe_hybridep_kernel_cache == folder
    assert parse(patched, monkeypatch).moe_hybridep_kernel_cache is None


def test_a_deep_ep_build_without_a_tuning_keyword_is_refused_by_flag(monkeypatch):
    """A deep_ep whose constructor lacks a set tuning keyword: the flag is named, not a TypeError."""
    from megatron_ext.hybridep.deep_ep_buffer import DeepEPTuning, create_deep_ep_buffer
    from megatron_ext.options import HybridEPConfigError

    made = []

    class NoBlocks:
        def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, num_sms_dispatch_api=None):
            made.append(num_sms_dispatch_api)

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(HybridEPBuffer=NoBlocks))
    create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False, tuning=DeepEPTuning(num_sms_dispatch_api=16))
    assert made == [16]
    with pytest.raises(HybridEPConfigError, match="--moe-hybridep-num-blocks-permute: this deep_ep build"):
        create_deep_ep_buffer(None, 256, 64, 2, reuse_allgather_buffer=False, tuning=DeepEPTuning(num_blocks_permute=4))


def test_patched_parse_args_refuses_unknown_implementation(patched, monkeypatch, capsys):
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-implementation", "foo")

    assert "--moe-hybridep-implementation" in err
    assert "invalid choice: 'foo'" in err


def test_patched_parse_args_refuses_a_non_number_factor(patched, monkeypatch, capsys):
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-capacity-factor", "lots")

    assert "--moe-hybridep-capacity-factor" in err


def test_patched_parse_args_refuses_a_non_finite_factor(patched, monkeypatch, capsys):
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-capacity-factor", "inf")

    assert "--moe-hybridep-capacity-factor inf is not a finite number; use a number from 1.0 to 100" in err


def test_patched_parse_args_accepts_megatrons_negative_expert_capacity_factor(patched, monkeypatch):
    # Megatron reads a negative --moe-expert-capacity-factor as unset: nothing is dropped.
    args = parse(patched, monkeypatch, "--moe-hybridep-capacity-factor", "1.5", "--moe-expert-capacity-factor", "-1")
    assert args.moe_expert_capacity_factor == -1.0 and args.moe_hybridep_capacity_factor == 1.5


@pytest.mark.parametrize(
    "extra",
    [
        ["--moe-hybridep-capacity-factor", "0.8"],  # megatron-ext's check
        ["--moe-hybridep-implementation", "foo"],  # argparse's: not one of the choices
        ["--moe-hybridep-capacity-factor", "lots"],  # argparse's: not a number
    ],
    ids=["refused", "bad-choice", "not-a-number"],
)
def test_patched_parse_args_refusal_is_said_by_the_first_rank_only(patched, monkeypatch, capsys, extra):
    import torch.distributed as dist

    assert not dist.is_initialized()  # the rank comes from the launcher's RANK here
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        parse(patched, monkeypatch, *extra)
    assert exc.value.code == 2  # every rank stops
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("RANK", "0")
    err = parse_error(patched, monkeypatch, capsys, *extra)
    assert extra[0] in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--moe-hybridep-capcity-factor", "1.5"],
            "unrecognized arguments: --moe-hybridep-capcity-factor 1.5 (did you mean --moe-hybridep-capacity-factor?)",
        ),
        (
            ["--moe-hybridep-equal-token-count", "--num-layer", "4"],
            "unrecognized arguments: --moe-hybridep-equal-token-count --num-layer 4 (did you mean "
            "--moe-hybridep-equal-token-counts for --moe-hybridep-equal-token-count and --num-layers for --num-layer?)",
        ),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag; prog --help lists the flags"),
        (
            ["--cuda-graph-impl", "bogus"],
            "argument --cuda-graph-impl: invalid choice: 'bogus' (choose from 'none', 'local', 'transformer_engine', "
            "'full_iteration')",
        ),
        (["--moe-router-topk", "two"], "argument --moe-router-topk: invalid int value: 'two'"),
        (
            ["--moe-token-dispatcher-type", "nope"],
            "argument --moe-token-dispatcher-type: invalid choice: 'nope' (choose from 'allgather', 'alltoall', "
            "'flex')",
        ),
    ],
    ids=["typo-of-ours", "two-typos", "unknown", "megatron-choice", "megatron-type", "megatron-dispatcher"],
)
def test_patched_parse_errors_are_one_line_naming_the_flag_meant(patched, monkeypatch, capsys, extra, expected):
    # argparse would print the usage first: Megatron's is some 725 lines.
    err = parse_error(patched, monkeypatch, capsys, *extra)
    assert err == f"prog: error: {expected}\n"


def test_extra_args_provider_parse_errors_are_one_line_too(unpatched, monkeypatch, capsys):
    from megatron_ext.options.arguments import extra_args_provider

    err = parse_error(
        unpatched, monkeypatch, capsys, "--moe-hybridep-capacity-factr", "2", provider=extra_args_provider
    )
    assert "(did you mean --moe-hybridep-capacity-factor?)" in err


# --- without the patch -----------------------------------------------------------------------


def test_unpatched_parse_args_rejects_the_flags(unpatched, monkeypatch, capsys):
    err = parse_error(unpatched, monkeypatch, capsys, "--moe-hybridep-capacity-factor", "1.5", usage=True)

    assert "unrecognized arguments: --moe-hybridep-capacity-factor 1.5" in err


def test_extra_args_provider_accepts_the_flags(unpatched, monkeypatch):
    from megatron_ext.options.arguments import extra_args_provider

    args = parse(unpatched, monkeypatch, *ALL_FLAGS, provider=extra_args_provider)
    assert hybridep_values(args) == ALL_VALUES

    args = parse(unpatched, monkeypatch, provider=extra_args_provider)
    assert hybridep_values(args) == DEFAULTS


def test_extra_args_provider_help(unpatched, monkeypatch, capsys):
    from megatron_ext.options.arguments import GROUP_TITLE, extra_args_provider

    out = print_help(unpatched, monkeypatch, capsys, lambda parser: escape_stray_percent(extra_args_provider(parser)))

    assert GROUP_TITLE in out
    for flag_name, phrase in HELP_PHRASES.items():
        assert flag_name in out
        assert phrase in out, f"help for {flag_name} lacks {phrase!r}"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--moe-hybridep-capacity-factor", "0.8"], ["would drop tokens", ">= 1.0"]),
        (["--moe-hybridep-verify-equal-token-counts"], ["set that flag too"]),
        (["--moe-hybridep-reuse-allgather-buffer", "--moe-token-dispatcher-type", "alltoall"], ["flex"]),
    ],
    ids=["factor-below-1", "verify-without-equal", "reuse-alltoall"],
)
def test_extra_args_provider_refuses_invalid_combinations(unpatched, monkeypatch, capsys, extra, expected):
    from megatron_ext.options.arguments import extra_args_provider

    err = parse_error(unpatched, monkeypatch, capsys, *extra, provider=extra_args_provider)
    for text in expected:
        assert text in err


def test_patch_and_extra_args_provider_together(patched, monkeypatch, capsys):
    from megatron_ext.options.arguments import extra_args_provider

    # Adding the flags a second time would raise argparse.ArgumentError (conflicting option string).
    args = parse(patched, monkeypatch, *ALL_FLAGS, provider=extra_args_provider)
    assert hybridep_values(args) == ALL_VALUES

    err = parse_error(
        patched, monkeypatch, capsys, "--moe-hybridep-capacity-factor", "0.8", provider=extra_args_provider
    )
    assert "would drop tokens" in err
    assert err.count("prog: error:") == 1


def test_the_launchers_check_leaves_help_and_the_scripts_own_flags_to_the_script(patched, capsys):
    from megatron_ext.options.arguments import check_script_arguments

    check_script_arguments("train.py", [*BASE_ARGV[1:], "--help"])  # no exit: the script's parse prints its help
    check_script_arguments("train.py", [*BASE_ARGV[1:], "--my-own-flag", "3"])  # an extra_args_provider's flag
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as stop:
        check_script_arguments("train.py", [*BASE_ARGV[1:], "--moe-hybridep-capcity-factor=2"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "train.py: error: unrecognized arguments: --moe-hybridep-capcity-factor "
        "(did you mean --moe-hybridep-capacity-factor?)\n"
    )


def test_install_validation_is_idempotent():
    import argparse

    from megatron_ext.options.arguments import install_validation

    parser = argparse.ArgumentParser()
    assert install_validation(parser) is parser
    wrapped = parser.parse_known_args
    assert install_validation(parser) is parser
    assert parser.parse_known_args is wrapped


# --- the config built in Python --------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(HYBRIDEP, moe_hybridep_capacity_factor=0.8), "--moe-hybridep-capacity-factor 0.8 would drop tokens"),
        (dict(moe_hybridep_capacity_factor=1.5), "Set --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend"),
        (dict(HYBRIDEP, moe_hybridep_verify_equal_token_counts=True), "set that flag too"),
        (
            dict(HYBRIDEP, moe_hybridep_equal_token_counts=True, moe_hybridep_pad_uneven_dispatch_inputs=True),
            "--moe-hybridep-pad-uneven-dispatch-inputs",
        ),
        (dict(HYBRIDEP, moe_hybridep_implementation="foo"), "'foo' is not one of auto, deep_ep, torch"),
        (dict(HYBRIDEP, moe_hybridep_implementation="deep_ep"), "deep_ep: hidden size 16 is below 128"),
        (
            dict(HYBRIDEP, moe_hybridep_capacity_factor=1.5, moe_hybridep_overflow_policy="skip"),
            "--moe-hybridep-overflow-policy 'skip' is not one of rerun, fail",
        ),
        (
            dict(HYBRIDEP, moe_hybridep_capacity_factor=1.5, moe_expert_capacity_factor=1.0),
            "--moe-hybridep-capacity-factor cannot be combined with --moe-expert-capacity-factor: drop "
            "--moe-expert-capacity-factor: capacity mode sizes the dispatch itself and drops nothing",
        ),
        (
            dict(
                HYBRIDEP,
                moe_hybridep_capacity_factor=1.5,
                moe_expert_capacity_factor=1.0,
                moe_pad_expert_input_to_capacity=True,
            ),
            "cannot be combined with --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity",
        ),
        (dict(moe_router_topk=0), "--moe-router-topk 0: each token goes to between 1 and --num-experts (4)"),
        (
            dict(HYBRIDEP, moe_hybridep_capacity_factor=1.5, context_parallel_size=2),
            "--moe-hybridep-capacity-factor with --context-parallel-size 2: megatron-ext has not run or tested",
        ),
        (
            dict(HYBRIDEP, moe_hybridep_capacity_factor=1.5, expert_tensor_parallel_size=2, add_bias_linear=False),
            "--moe-hybridep-capacity-factor with --expert-tensor-parallel-size 2: capacity mode's experts are not",
        ),
    ],
    ids=[
        "factor-below-1",
        "factor-default-dispatcher",
        "verify-without-equal",
        "equal-and-pad-uneven",
        "foo",
        "deep_ep-hidden-16",
        "unknown-policy",
        "factor-and-expert-capacity-factor",
        "factor-and-drop-and-pad",
        "topk-0",
        "factor-and-cp-2",
        "factor-and-etp-2",
    ],
)
def test_config_refuses_invalid_combinations(bad, message):
    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.options.config import HybridEPTransformerConfig

    assert issubclass(HybridEPConfigError, ValueError)
    with pytest.raises(ValueError) as err:
        HybridEPTransformerConfig(**TINY, **bad)
    assert type(err.value) is HybridEPConfigError
    assert message in str(err.value)


def test_config_keeps_valid_values():
    from megatron_ext.options.config import HybridEPTransformerConfig

    config = HybridEPTransformerConfig(**TINY, **HYBRIDEP, **ALL_VALUES)
    assert hybridep_values(config) == ALL_VALUES

    stock = HybridEPTransformerConfig(**TINY)
    assert hybridep_values(stock) == DEFAULTS


# --- CUDA graphs ------------------------------------------------------------------------------

CAPACITY_EQUAL = ["--moe-hybridep-capacity-factor", "1.5", "--moe-hybridep-equal-token-counts"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe", "moe_router", *CAPACITY_EQUAL]
            + ["--moe-hybridep-overflow-policy", "fail"],
            ["--cuda-graph-modules moe and moe_router", "name one of them"],
        ),
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"],
            ["--cuda-graph-modules moe graphs the whole MoE layer", "--moe-hybridep-equal-token-counts"],
        ),
        (
            ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"]
            + ["--moe-hybridep-capacity-factor", "1.5"],
            ["--cuda-graph-modules moe graphs the whole MoE layer", "drop-and-pad"],
        ),
        (
            ["--cuda-graph-impl", "full_iteration", "--moe-hybridep-capacity-factor", "1.5"],
            ["--cuda-graph-impl full_iteration captures the HybridEP dispatch", "--moe-hybridep-equal-token-counts"],
        ),
        (
            ["--cuda-graph-impl", "full_iteration", "--moe-hybridep-reuse-allgather-buffer"],
            ["captures the HybridEP dispatch", "a blocking dispatch reads its row count"],
        ),
        (
            ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "0", *CAPACITY_EQUAL],
            ["--cuda-graph-warmup-steps 0 would capture the first step", "--cuda-graph-warmup-steps 1 or more"],
        ),
        (
            ["--cuda-graph-impl", "full_iteration", "--timing-log-level", "1", *CAPACITY_EQUAL],
            ["--cuda-graph-impl full_iteration with --timing-log-level 1", "--timing-log-level 0"],
        ),
        (
            ["--cuda-graph-impl", "transformer_engine", *CAPACITY_EQUAL],
            ["--cuda-graph-impl transformer_engine with", "--cuda-graph-impl local or full_iteration"],
        ),
        (
            ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe", *CAPACITY_EQUAL],
            ["--cuda-graph-impl transformer_engine --cuda-graph-modules moe", "--moe-hybridep-overflow-policy fail"],
        ),
    ],
    ids=[
        "moe-and-router",
        "moe-module-stock",
        "moe-module-without-equal",
        "full-iteration-without-equal",
        "full-iteration-blocking",
        "no-warmup",
        "full-iteration-timers",
        "te-whole-layer-rerun",
        "te-moe-rerun",
    ],
)
def test_patched_parse_args_refuses_graphs_that_cannot_hold_the_dispatch(patched, monkeypatch, capsys, extra, expected):
    test_patched_parse_args_refuses_invalid_combinations(patched, monkeypatch, capsys, extra, expected)


@pytest.mark.parametrize(
    "extra, modules",
    [
        (["--cuda-graph-impl", "full_iteration", *CAPACITY_EQUAL], set()),
        (["--cuda-graph-impl", "full_iteration", "--timing-log-level", "0", *CAPACITY_EQUAL], set()),
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe", *CAPACITY_EQUAL]
            + ["--moe-hybridep-overflow-policy", "fail", "--timing-log-level", "2"],  # timers outside the graphs
            {"moe"},
        ),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe", *CAPACITY_EQUAL], {"moe"}),  # re-run policy
        (["--cuda-graph-impl", "local", *CAPACITY_EQUAL], set()),  # the whole layer, re-run policy
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe_router", "moe_preprocess", *CAPACITY_EQUAL],
            {"moe_router", "moe_preprocess"},
        ),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], {"attn"}),  # no MoE graph: nothing to check
    ],
    ids=[
        "full-iteration",
        "full-iteration-no-timers",
        "local-moe-fail-policy-timers",
        "local-moe-rerun-policy",
        "local-whole-layer-rerun-policy",
        "local-router-preprocess",
        "attn-only",
    ],
)
def test_patched_parse_args_accepts_graphs_of_capacity_mode(patched, monkeypatch, extra, modules):
    from megatron.training.arguments import core_transformer_config_from_args

    args = parse(patched, monkeypatch, *extra, "--no-rope-fusion")
    args.params_dtype = torch.float32
    config = core_transformer_config_from_args(args)
    assert {m.name for m in config.cuda_graph_modules} == modules


def test_config_lifts_megatrons_moe_graph_refusal_for_capacity_mode_with_equal_counts():
    from megatron.core.transformer.enums import CudaGraphModule

    from megatron_ext.options.config import HybridEPTransformerConfig

    graphed = dict(TINY, **HYBRIDEP, cuda_graph_impl="local", cuda_graph_modules=["moe"])
    config = HybridEPTransformerConfig(
        **graphed,
        moe_hybridep_capacity_factor=1.5,
        moe_hybridep_equal_token_counts=True,
        moe_hybridep_overflow_policy="fail",
    )
    assert config.cuda_graph_modules == [CudaGraphModule.moe]
    # Everywhere else Megatron's own refusal stands.
    with pytest.raises(AssertionError, match="drop-padding"):
        HybridEPTransformerConfig(**graphed)


# --- fp8 / fp4 ----------------------------------------------------------------------------------

TE_OP_FUSER = ["--transformer-impl", "transformer_engine", "--use-transformer-engine-op-fuser", "--moe-grouped-gemm"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--fp8-format", "e4m3"],
            ["--fp8-recipe delayed (Megatron's default recipe)", "grouped quantization", "tensorwise or blockwise"]
            + ["--moe-hybridep-static-expert-splits with --transformer-impl transformer_engine"],
        ),
        (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], ["--fp8-recipe mxfp8", "Blackwell only"]),
        (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], ["op-fuser experts", TE_OP_FUSER[1]]),
        (["--fp4-format", "e2m1", *TE_OP_FUSER], ["with --fp4-format", "NVFP4 on Blackwell only"]),
    ],
    ids=["fp8-delayed", "fp8-mxfp8", "fp8-without-te-op-fuser", "fp4"],
)
def test_patched_parse_args_refuses_quantized_experts_that_read_counts_on_the_host(
    patched, monkeypatch, capsys, extra, expected
):
    err = parse_error(patched, monkeypatch, capsys, "--moe-hybridep-capacity-factor", "1.5", *extra)
    for text in expected:
        assert text in err, f"{text!r} not in {err[-600:]!r}"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_patched_parse_args_accepts_fp8_recipes_whose_grouped_gemm_takes_device_counts(patched, monkeypatch, recipe):
    extra = ["--moe-hybridep-capacity-factor", "1.5", "--fp8-format", "e4m3", "--fp8-recipe", recipe]
    args = parse(patched, monkeypatch, *extra, *TE_OP_FUSER)
    assert (args.fp8, args.fp8_recipe, args.use_transformer_engine_op_fuser) == ("e4m3", recipe, True)
    # Without capacity mode megatron-ext has nothing to say about fp8.
    assert parse(patched, monkeypatch, "--fp8-format", "e4m3").fp8 == "e4m3"


def test_patched_parse_args_refuses_capacity_mode_experts_outside_bf16_on_a_gpu(patched, monkeypatch, capsys):
    """Capacity mode builds megatron-ext's GroupedMLP unless TE's op-fuser experts or static splits'
    experts take the layer; on a GPU it runs bf16 only (torch's grouped GEMM reads the counts on the
    host otherwise). Refused when parsed, not at the model build on the GPU."""
    capacity = ["--moe-hybridep-capacity-factor", "1.5"]
    monkeypatch.setattr(sys, "argv", [a for a in [*BASE_ARGV, *capacity, "--fp16"] if a != "--bf16"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        patched.parse_args()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err[-600:]
    for text in ("--moe-hybridep-capacity-factor with --fp16", "GroupedMLP", "Train with --bf16", TE_OP_FUSER[2]):
        assert text in err, f"{text!r} not in {err[-600:]!r}"
    monkeypatch.setattr(sys, "argv", [a for a in [*BASE_ARGV, *capacity] if a != "--bf16"])
    with pytest.raises(SystemExit):
        patched.parse_args()
    assert "with fp32 (neither --bf16 nor --fp16)" in capsys.readouterr().err
    # What runs in fp16: the blocking dispatch, TE's op-fuser experts, CPU ranks.
    without_bf16 = [a for a in BASE_ARGV if a != "--bf16"]
    for extra in ([], [*capacity, *TE_OP_FUSER], [*capacity, "--use-cpu-initialization"]):
        monkeypatch.setattr(sys, "argv", [*without_bf16, "--fp16", *extra])
        assert patched.parse_args().fp16, extra


def test_patched_parse_args_refuses_static_splits_for_the_local_grouped_experts(patched, monkeypatch, capsys):
    """The local spec's grouped experts become megatron-ext's GroupedMLP in capacity mode, which takes
    device counts: static splits are refused when parsed, naming TE's experts as the way to them."""
    static = ["--moe-hybridep-capacity-factor", "1.5", "--moe-hybridep-static-expert-splits"]
    err = parse_error(patched, monkeypatch, capsys, *static, "--transformer-impl", "local", "--moe-grouped-gemm")
    for text in (
        "--moe-hybridep-static-expert-splits with --transformer-impl local --moe-grouped-gemm",
        "Drop the flag",
    ):
        assert text in err, f"{text!r} not in {err[-600:]!r}"
    assert "--transformer-impl transformer_engine without --use-transformer-engine-op-fuser" in err
    # SequentialMLP (no grouped GEMM) and TE's experts are what the flag is for.
    assert parse(patched, monkeypatch, *static, "--transformer-impl", "local").moe_hybridep_static_expert_splits
    te = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm"]
    assert parse(patched, monkeypatch, *static, *te).moe_hybridep_static_expert_splits


@pytest.mark.parametrize("activation", ["--swiglu", "--quick-geglu"])
def test_patched_parse_args_names_the_env_that_megatron_wants_for_gated_op_fuser_experts(
    patched, monkeypatch, capsys, activation
):
    """megatron-core 0.19.2 asserts at the layer build ("Fused GroupedMLP is not supported for this
    configuration") unless NVTE_CUTEDSL_FUSED_GROUPED_MLP asks for TE's fused grouped MLP."""
    extra = ["--moe-hybridep-capacity-factor", "1.5", *TE_OP_FUSER, activation]
    monkeypatch.delenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", raising=False)
    err = parse_error(patched, monkeypatch, capsys, *extra)
    for text in (activation, "NVTE_CUTEDSL_FUSED_GROUPED_MLP=1", "drop --use-transformer-engine-op-fuser"):
        assert text in err, f"{text!r} not in {err[-600:]!r}"
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
    assert parse(patched, monkeypatch, *extra).use_transformer_engine_op_fuser
    monkeypatch.delenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP")
    assert not parse(patched, monkeypatch, "--moe-hybridep-capacity-factor", "1.5", *TE_OP_FUSER).swiglu


@pytest.mark.parametrize("te_graphs", [True, False], ids=["te-installed", "no-te"])
def test_whole_layer_local_graphs_with_torch_norms_are_refused_where_megatron_releases_their_input(
    patched, monkeypatch, capsys, te_graphs
):
    """Megatron's per-layer graphs weak-reference graph inputs where TE imports; the local spec's
    torch norm saves the layer input in C++, unseen, and its weight's gradient came out wrong on an
    H200 (tests/test_gpu_graphs.py, the per-layer overflow test with torch norms)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    monkeypatch.setattr(cuda_graphs, "HAVE_TE_GRAPHS", te_graphs)
    monkeypatch.setattr(gpt_layer_specs, "LNImpl", WrappedTorchNorm)
    whole_layer = ["--cuda-graph-impl", "local", *CAPACITY_EQUAL]
    if te_graphs:
        err = parse_error(patched, monkeypatch, capsys, *whole_layer, "--transformer-impl", "local")
        for text in ("--cuda-graph-impl local with --transformer-impl local", "wrong gradient", "full_iteration"):
            assert text in err, f"{text!r} not in {err[-600:]!r}"
    else:
        assert parse(patched, monkeypatch, *whole_layer, "--transformer-impl", "local").cuda_graph_impl == "local"
    # The MoE layer alone: its input's readers (the router's gating, the experts) save it in Python.
    moe_only = [*whole_layer, "--cuda-graph-modules", "moe", "--transformer-impl", "local"]
    assert [m.name for m in parse(patched, monkeypatch, *moe_only).cuda_graph_modules] == ["moe"]


def test_fp8_dispatch_is_accepted_with_blockwise_and_auto_takes_torch_where_deep_ep_cannot():
    """The one combination it needs passes the checks; `auto` keeps deep_ep where its fp8 kernels
    take the hidden size (a multiple of 512) and picks torch elsewhere."""
    import argparse

    from megatron_ext.options import deep_ep_shape_error, validate

    config = argparse.Namespace(
        **HYBRIDEP, moe_hybridep_fp8_dispatch=True, fp8="e4m3", fp8_recipe="blockwise", hidden_size=384
    )
    assert validate(config).fp8_dispatch
    # What `auto` reads (options.resolve_implementation): deep_ep's fp8 dispatch takes 1024, not 384.
    assert deep_ep_shape_error(1024, fp8_dispatch=True) is None and deep_ep_shape_error(384) is None
    assert "not a multiple of 512, as deep_ep's fp8 dispatch" in deep_ep_shape_error(384, fp8_dispatch=True)


def test_fp8_dispatch_is_refused_where_te_quantizes_blockwise_with_float32_scales(monkeypatch):
    import argparse

    from megatron_ext.options import HybridEPConfigError, validate

    config = argparse.Namespace(
        **HYBRIDEP, moe_hybridep_fp8_dispatch=True, fp8="e4m3", fp8_recipe="blockwise", hidden_size=384
    )
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    with pytest.raises(HybridEPConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: the dispatch quantizes"):
        validate(config)
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    assert validate(config).fp8_dispatch
