"""Pretrain a GPT model with MoE layers on mock data, with megatron-ext's HybridEP dispatcher.

A Megatron-Core 0.19 training entry point: it applies `megatron_ext.patches` itself, so Megatron's
own parser knows the `--moe-hybridep-...` flags (and refuses bad combinations), then runs
`megatron.training.pretrain` with a GPT model, a masked-mean language-model loss and Megatron's
mock GPT dataset (no data files). Run it with torchrun, one process per GPU:

    torchrun --nproc-per-node 8 examples/pretrain_moe.py --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 32000 <model and training flags> \\
        --num-experts 64 --moe-router-topk 8 --expert-model-parallel-size 8 \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep \\
        --moe-hybridep-capacity-factor 1.5 --moe-hybridep-equal-token-counts

or through the scripts beside it (smoke_1gpu.sh, ep8_single_node.sh, slurm_multinode.sbatch).

Needs: CUDA GPUs, torch, megatron-core 0.19.x and megatron-ext installed. Transformer Engine,
apex and deep_ep are optional: without TE, pass `--transformer-impl local` (and without apex
`--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm`: those
kernels are apex's or Megatron's own CUDA extensions, and torch's norm refuses the persistent
layer norm); without deep_ep, megatron-ext dispatches through its torch buffer.

Layers: Transformer Engine's layer spec with `--transformer-impl transformer_engine` where TE
imports, else Megatron's local spec. The local spec has no grouped-GEMM experts (it builds
SequentialMLP whatever `--moe-grouped-gemm` says), so with `--moe-grouped-gemm` this script builds
`megatron_ext.experts.GroupedMLP`: the experts capacity mode uses anyway, so a blocking run and a
capacity-mode run build the same weights and should report the same losses.

`--megatron-ext-dry-run` parses and validates the flags with Megatron's own `parse_args` and
`validate_args` (world size from WORLD_SIZE, default 1), builds the TransformerConfig and prints
what a run would build, then exits: no GPU, no process group, any machine. It leaves out the
warnings Megatron and torch give while they import (Transformer Engine or apex not installed, no
CUDA runtime...), which are about the machine the dry run happens to run on, not the flags.

`--fp16` and `--bf16` are two switches (a later one does not turn an earlier one off): given both,
the parse stops with a message naming them (the example scripts take PRECISION=bf16|fp16 instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import math
import os
import re
import sys
import traceback
import warnings
from typing import NoReturn
from unittest import mock

DRY_RUN = "--megatron-ext-dry-run"


@contextlib.contextmanager
def quiet_imports_in_a_dry_run():
    """In a dry run, leave out the warnings given while Megatron and torch import: they say what this
    machine lacks for training (Transformer Engine, apex, a CUDA runtime), which a dry run does not do;
    the same where no GPU is visible, where the example refuses to train in one line. A run that trains
    keeps them; megatron-ext's own warnings are kept either way."""
    if __name__ != "__main__" or (DRY_RUN not in sys.argv[1:] and _cuda_visible()):
        yield
        return
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found"
    level = cpp_extension.level
    cpp_extension.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"megatron_ext(\.|$)")
            yield
    finally:
        cpp_extension.setLevel(level)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


with quiet_imports_in_a_dry_run():
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.training import (
        get_args,
        get_timers,
        get_tokenizer,
        get_train_valid_test_num_samples,
        pretrain,
        print_rank_0,
    )
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_and_validate_args,
        parse_args,
        validate_args,
    )
    from megatron.training.global_vars import set_args

    import megatron_ext.options.arguments
    import megatron_ext.patches
    from megatron_ext.experts import GroupedMLP
    from megatron_ext.logs import first_rank
    from megatron_ext.options import (
        CONFIG_PREFIX,
        OPTION_NAMES,
        HybridEPOptions,
        deep_ep_import_error,
        flag,
        requested_implementation,
        resolve_implementation,
    )
    from megatron_ext.patches._moe_layer import check_experts, select_experts

SHIFT_AT, SHIFT_BIAS = "--example-shift-routing-at", "--example-shift-routing-bias"
EXPERTS = "--example-experts"
# What the dry run tells validate_args when it asks the GPU (it never asks the real one).
ASSUMED_COMPUTE_CAPABILITY = (9, 0)


def add_arguments(parser):
    group = parser.add_argument_group("megatron-ext example")
    group.add_argument(
        DRY_RUN,
        action="store_true",
        help="Parse and validate the flags, print what would be built, and exit (no GPU needed).",
    )
    group.add_argument(
        SHIFT_AT,
        type=int,
        default=None,
        metavar="ITER",
        help="Fault injection (compare_modes.py --skewed): from iteration ITER on, every MoE router adds "
        f"{SHIFT_BIAS} to expert 0's logit, as a router drifting in training would, so that expert's load "
        "jumps after the capacity was learned. Capacity mode must re-run the overflowing step and log "
        "what blocking logs.",
    )
    group.add_argument(
        SHIFT_BIAS,
        type=float,
        default=0.3,
        help=f"The logit added by {SHIFT_AT} (default 0.3: an estimate that about doubles expert 0's share "
        "of top-2 of 8 at this example's start, router logits of std ~0.45; the logged load-balancing "
        "loss shows what it did).",
    )
    group.add_argument(
        EXPERTS,
        choices=("spec", "megatron-ext"),
        default="spec",
        help="The experts of every MoE layer with --moe-grouped-gemm: `spec` (default), those the layer spec "
        "names (Transformer Engine's TEGroupedMLP with TE's layers; megatron-ext's GroupedMLP with the local "
        "spec, which has no grouped experts); `megatron-ext`, megatron-ext's GroupedMLP in any spec, the "
        "experts capacity mode builds, so that a blocking run computes what a capacity-mode run computes, "
        "bit for bit.",
    )
    # Adds megatron-ext's flags only where the patch has not (it checks); always adds their checks.
    return refuse_two_precisions(escape_stray_percent(megatron_ext.options.arguments.extra_args_provider(parser)))


PRECISIONS = ("--fp16", "--bf16")


def refuse_two_precisions(parser):
    """Stop the parse, before validate_args' bare AssertionError, when both --fp16 and --bf16 are set.

    They are two store_true switches, so appending one to a script's command line does not turn the
    other off as a later value flag would. The message (once per job, exit status 2) names the two
    and the fix.
    """
    parse_known_args = parser.parse_known_args

    def parse_known_args_one_precision(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        if getattr(parsed, "fp16", False) and getattr(parsed, "bf16", False):
            argv = list(sys.argv[1:] if args is None else args)
            # The one given last is the one meant (as a later flag wins for values).
            first, last = sorted(PRECISIONS, key=lambda f: max((i for i, a in enumerate(argv) if a == f), default=-1))
            megatron_ext.options.arguments.refuse(
                parser,
                f"{first} and {last} are both set: they are two switches, so the later {last} does not turn {first} "
                f"off, and Megatron trains in one precision. Pass one of them; to an example script, which passes "
                f"{first}, give PRECISION={last[2:]} (or edit the script) instead of appending {last}.",
            )
        return parsed, extras

    parser.parse_known_args = parse_known_args_one_precision
    return parser


def escape_stray_percent(parser):
    """Let --help print: argparse formats help texts with %, and one of megatron-core 0.19.2's has a bare '%'."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = re.sub(r"%%|%\(|%", lambda m: m.group(0) if len(m.group(0)) == 2 else "%%", action.help)
    return parser


# Flags Megatron's parser leaves unset but a run needs; without them Megatron fails later with a
# bare AssertionError (--micro-batch-size) or a TypeError (--eval-interval, --train-iters).
REQUIRED = {
    "micro_batch_size": "--micro-batch-size N (sequences per GPU per micro-batch)",
    "train_iters": "--train-iters N",
    "eval_interval": "--eval-interval N (iterations between evaluations)",
    "seq_length": "--seq-length N",
}


def check_supported(args) -> None:
    """Refuse (one line, exit status 2) what this example does not do, a flag it needs and lacks, or
    parallel sizes the ranks cannot be laid out in: in the dry run and before a run starts alike."""
    missing = [text for name, text in REQUIRED.items() if getattr(args, name, None) is None]
    if missing:
        refuse(f"set {'; '.join(missing)}.")
    if not args.mock_data:
        refuse("this example trains on mock data only; pass --mock-data.")
    if args.context_parallel_size != 1:
        refuse(
            f"--context-parallel-size {args.context_parallel_size}: this example does not split sequences for "
            "context parallelism; use --context-parallel-size 1."
        )
    check_expert_grid(args)


def check_expert_grid(args) -> None:
    """Megatron lays the experts of each pipeline stage over expert-parallel x expert-tensor-parallel
    ranks: the world size must be a multiple of the three (its process-group setup fails otherwise,
    after the launch; validate_args does not check it)."""
    sizes = expert_grid_sizes(args)
    grid = expert_grid(args)
    if args.world_size % grid:
        product = " x ".join(f"{flag} {size}" for flag, size in sizes.items())
        refuse(
            f"{product} = {grid} ranks for each pipeline stage's experts, but the world size is {args.world_size} "
            f"(not a multiple of {grid}). Lower one of these sizes, or run on a multiple of {grid} ranks."
        )


def use_local_spec(args) -> bool:
    return args.transformer_impl != "transformer_engine" or not gpt_layer_specs.HAVE_TE


def layer_spec(args, config):
    """The spec of every layer: attention and a MoE MLP."""
    if not use_local_spec(args):
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
        ours = getattr(args, "example_experts", "spec") == "megatron-ext"
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        ours = True  # the local spec has no grouped experts
    if config.moe_grouped_gemm and ours:
        moe = spec.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
        submodules = dataclasses.replace(moe.keywords["submodules"], experts=GroupedMLP)
        spec.submodules.mlp = functools.partial(moe, submodules=submodules)
    return spec


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    print_rank_0(f"building GPT model with {config.num_moe_experts} experts ...")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    shift_routing(model, args)
    return model


def shift_routing(model, args) -> None:
    """--example-shift-routing-at: from that iteration on, each router's top-k sees expert 0's logit
    raised by --example-shift-routing-bias (a device-side add: no host read)."""
    if args.example_shift_routing_at is None:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        router.routing = _shifted(router.routing, args.example_shift_routing_at, args.example_shift_routing_bias)


def _shifted(routing, start: int, bias: float):
    def shifted_routing(logits, *rest, **kwargs):
        if get_args().curr_iteration >= start:
            raise_expert_0 = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            raise_expert_0[:1].fill_(bias)  # a kernel argument: no host-to-device copy
            logits = logits + raise_expert_0
        return routing(logits, *rest, **kwargs)

    return shifted_routing


def loss_func(loss_mask, output_tensor):
    """Sum of the unmasked token losses and their count: Megatron's schedule divides the one by
    the other (a masked mean) and logs sum/count over the global batch as 'lm loss'."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.to(loss.dtype)])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = {key: value.cuda(non_blocking=True) for key, value in next(data_iterator).items()}
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(train_valid_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        path_to_cache=args.data_cache_path,
    )
    # Every rank reads its own batches (mock data costs nothing), so no rank waits for a broadcast:
    # the ranks of one tensor-parallel group share a data-parallel rank and read the same samples.
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_valid_test_num_samples, lambda: True, config).build()


# Megatron builds a data loader on every rank, not only on tensor-parallel rank 0, when set.
train_valid_test_datasets_provider.is_distributed = True


def use_prebuilt_dataset_helpers() -> None:
    """Skip Megatron's start-up `make` of its dataset helpers where they come prebuilt.

    Rank 0 runs `make -C megatron/core/datasets` at start and exits when it fails; the
    megatron-core wheel ships the built `helpers_cpp` but no Makefile there, so it always fails.
    """
    import megatron.core.datasets.utils as dataset_utils

    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return  # a source checkout: let Megatron build them
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # nothing prebuilt: Megatron's own step reports it
    dataset_utils.compile_helpers = lambda: None


def expert_grid_sizes(args) -> dict[str, int]:
    """The sizes that lay out each expert-data-parallel replica, by flag."""
    return {
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--expert-model-parallel-size": args.expert_model_parallel_size,
        # None until validate_args sets it to the tensor-parallel size
        "--expert-tensor-parallel-size": args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
    }


def expert_grid(args) -> int:
    """Ranks per expert-data-parallel replica: PP x EP x expert TP."""
    return math.prod(expert_grid_sizes(args).values())


def _qualname(builder) -> str:
    while isinstance(builder, functools.partial):
        builder = builder.func
    return f"{builder.__module__}.{builder.__qualname__}"


def moe_submodules(args, config):
    """The MoE layer's submodules in this example's layer spec (the experts it names among them)."""
    return layer_spec(args, config).submodules.mlp.keywords["submodules"]


def describe(args, config, spec_experts, built_experts) -> list[tuple[str, object]]:
    """What a run with these arguments would build, as (name, value) pairs."""
    options = HybridEPOptions.from_config(config)
    implementation = resolve_implementation(requested_implementation(options), config.hidden_size)
    deep_ep_missing = deep_ep_import_error()
    rows = [
        ("world size", args.world_size),
        ("distributed backend", args.distributed_backend),
        ("tensor parallel", args.tensor_model_parallel_size),
        ("pipeline parallel", args.pipeline_model_parallel_size),
        ("virtual pipeline stages per rank", args.virtual_pipeline_model_parallel_size or 1),
        ("expert parallel", args.expert_model_parallel_size),
        ("expert tensor parallel", args.expert_tensor_parallel_size),
        ("data parallel", args.data_parallel_size),
        ("expert data parallel", args.world_size // expert_grid(args)),
        ("layers", config.num_layers),
        ("hidden size", config.hidden_size),
        ("attention heads", config.num_attention_heads),
        ("ffn hidden size", config.ffn_hidden_size),
        ("sequence length", args.seq_length),
        ("micro batch size", args.micro_batch_size),
        ("global batch size", args.global_batch_size),
        ("experts", config.num_moe_experts),
        ("top-k", config.moe_router_topk),
        ("expert ffn hidden size", config.moe_ffn_hidden_size),
        ("params dtype", config.params_dtype),
        ("transformer impl", args.transformer_impl),
        ("layer spec", "local" if use_local_spec(args) else "transformer_engine"),
        ("dispatcher", config.moe_token_dispatcher_type),
        ("flex backend", config.moe_flex_dispatcher_backend),
        ("cuda graphs", args.cuda_graph_impl),
        ("attention mask from the data loader", args.create_attention_mask_in_dataloader),
    ]
    rows += [(flag(CONFIG_PREFIX + name), getattr(options, name)) for name in OPTION_NAMES]
    rows += [
        ("capacity mode", "on" if options.capacity_factor is not None else "off"),
        ("hybridep implementation", implementation + (f" (deep_ep: {deep_ep_missing})" if deep_ep_missing else "")),
        ("experts in the spec", _qualname(spec_experts)),
        ("experts built", _qualname(built_experts)),
        ("train iterations", args.train_iters),
        ("samples (train, valid, test)", get_train_valid_test_num_samples()),
        ("gpu checks", "skipped: validation assumed compute capability {}.{}".format(*ASSUMED_COMPUTE_CAPABILITY)),
    ]
    return rows


@contextlib.contextmanager
def no_gpu_queries():
    """Answer validate_args' questions to the GPU (with --moe-grouped-gemm, or TP/CP > 1) without one."""
    major, minor = ASSUMED_COMPUTE_CAPABILITY
    with (
        mock.patch("torch.cuda.get_device_capability", return_value=(major, minor)),
        mock.patch("megatron.training.arguments.get_device_arch_version", return_value=major),
    ):
        yield


@contextlib.contextmanager
def megatron_notes_in_one_line():
    """While the dry run checks the flags, show each warning Megatron gives about them (fp16's loss
    scaling, fp32 routing for many experts...) as one line, `<prog>: Megatron: <message>`, rather
    than Python's two with the file and source line; others' warnings as Python shows them."""
    megatron = os.path.dirname(os.path.dirname(sys.modules["megatron.core"].__file__)) + os.sep
    prog = os.path.basename(sys.argv[0])
    with warnings.catch_warnings():
        # Megatron asks for the rank before any process group exists (print_rank_0): a dry run is rank 0.
        warnings.filterwarnings("ignore", message="Could not determine rank", module=r"megatron\.core\._rank_utils")
        python_shows = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if filename.startswith(megatron):
                print(f"{prog}: Megatron: {message}", file=sys.stderr)
            else:
                python_shows(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def dry_run() -> None:
    with megatron_notes_in_one_line():
        _dry_run()


def _dry_run() -> None:
    args = parse_args(extra_args_provider=add_arguments)
    check_supported(args)
    # validate_args prints every argument (about 800 lines): kept for MEGATRON_EXT_DRY_RUN_ARGS=1.
    arguments = io.StringIO()
    try:
        with no_gpu_queries(), contextlib.redirect_stdout(arguments):
            validate_args(args)
    except AssertionError as exc:  # Megatron's checks of the flags, often a bare assert
        refuse(f"Megatron's validate_args refuses these flags: {_assertion(exc)}")
    if os.environ.get("MEGATRON_EXT_DRY_RUN_ARGS") == "1":
        print(arguments.getvalue(), end="")
    try:
        config = core_transformer_config_from_args(args)
    except (ValueError, AssertionError) as exc:  # Megatron's own checks of the config, on this machine
        refuse(f"Megatron's TransformerConfig refuses these flags here: {_assertion(exc)}")
    set_args(args)  # what get_train_valid_test_num_samples reads
    spec = moe_submodules(args, config)
    try:  # what the layer build would refuse, by the checks it runs: the experts it selects, then theirs
        built = select_experts(config, spec)
        check_experts(config, built)
    except ValueError as exc:  # HybridEPConfigError, or the experts' own refusal
        refuse(str(exc))
    rows = describe(args, config, spec.experts, built.experts)
    print("megatron-ext dry run: nothing built, no GPU or process group used")
    for name, value in rows:
        print(f"{name}: {value}")


def refuse(message: str) -> NoReturn:
    """One line, `<prog>: error: <message>`, exit status 2: as a refused flag at parse time (said
    by the job's first rank only, as megatron-ext's parse-time refusals are)."""
    if first_rank():
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _assertion(exc: BaseException) -> str:
    """An exception's message, or for a bare assert the source line that failed, with its place."""
    if str(exc):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{(frame.line or 'assert').strip()} ({os.path.basename(frame.filename)}:{frame.lineno})"


def main() -> None:
    megatron_ext.patches.apply()  # before Megatron parses: the flags come from the patched config
    if DRY_RUN in sys.argv[1:]:
        dry_run()
        return
    if not torch.cuda.is_available():  # validate_args would ask the GPU first, in a traceback
        parse_args(extra_args_provider=add_arguments)  # --help, and a bad flag's one line, still work here
        refuse(f"training needs a CUDA GPU and none is visible here; {DRY_RUN} checks the flags on any machine.")
    args = parse_and_validate_args(extra_args_provider=add_arguments)
    check_supported(args)
    use_prebuilt_dataset_helpers()
    pretrain(
        pretrain_cfg_container_from_args(args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
    report_peak_memory()


def report_peak_memory() -> None:
    """One line per rank with the job's peak GPU memory (what `.ci/gpu-suite train-shapes` compares):
    Megatron reports memory after the first iteration only, which capacity mode spends calibrating."""
    mib = 2**20
    print(
        f"megatron-ext example: rank {torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}: "
        f"peak GPU memory allocated {torch.cuda.max_memory_allocated() / mib:.0f} MiB, "
        f"reserved {torch.cuda.max_memory_reserved() / mib:.0f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
