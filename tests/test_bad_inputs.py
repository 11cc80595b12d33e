"""Bad inputs, as a user gives them, on every surface megatron-ext has: each refused before any work
starts, in one line naming the argument and the fix, without a traceback, leaving files as they were.

The table `CASES` holds them all. A case is run in a process shared with the others of its kind,
as the user's command would run it (`parse` of the bench, `main` of the launcher, Megatron's
`parse_args` patched, the config, the Python calls); its stdout and stderr captured, an exception
that escapes a command written out as the interpreter would (a traceback). `python -m
tests.test_bad_inputs GROUP OUT FOLDER` runs one group; the test runs them at once, one process
each, and checks every case's outcome:
- a command: its exit status, exactly one non-empty line on stderr holding every `says` fragment,
  nothing on stdout, no traceback;
- a Python call: the exception's type, its message one line holding every `says` fragment;
- both: each file of `keep` (written before the case) unchanged, and no file made.
The "fresh" cases run a real command in a process of its own: there, what importing Megatron
warns and logs is part of what the user sees, and the refusal must still be the only line.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests import slots

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Case:
    """One bad input. `call(folder)` gives it (a command's entry point, or a Python call); `expect`:
    the exit status (int) or the exception type's name (str); `says`: fragments of the one line (the
    argument, the fix); `group`: "light" (no Megatron import), "megatron", or "fresh" (`call`
    returns a command line, run in a process of its own); `keep`: files made before, compared after;
    `env`: names of ENVIRONMENTS it runs in."""

    id: str
    call: Callable[[Path], Any]
    expect: int | str
    says: tuple[str, ...]
    group: str = "light"
    keep: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------- entry points


def bench(*argv: str, gpu: bool = False) -> Callable[[Path], Any]:
    """`megatron-ext-bench ARGV` run in `folder`, up to the end of its parsing (a case the parse
    accepts returns there: exit status 0, not a run of the bench). Without a GPU unless `gpu` (its
    environment then says what there is), so that a GPU machine gives the same refusals."""

    def call(folder: Path):
        from megatron_ext.bench.cli import parse

        with _cwd(folder), contextlib.nullcontext() if gpu else _no_gpu():
            parse(list(argv))

    return call


def launch(*argv: str) -> Callable[[Path], Any]:
    """`python -m megatron_ext.launch ARGV` in `folder`, where train.py (`TRAIN_SCRIPT`) is; a script
    that runs writes ran.txt, which `keep`-less cases then find as a new file."""

    def call(folder: Path):
        from megatron_ext.launch import main

        with _cwd(folder), mock.patch.object(sys, "argv", list(sys.argv)), mock.patch.object(sys, "path", sys.path[:]):
            main(list(argv))

    call.script = True  # `_prepare` writes train.py first
    return call


TRAIN_SCRIPT = (
    "from megatron.training.arguments import parse_args\nparse_args()\nopen('ran.txt', 'w').write('the script ran')\n"
)
# Megatron's flags of a small MoE model on the HybridEP flex dispatcher (hidden 256: a size deep_ep takes).
MEGATRON = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --num-experts 8 --moe-token-dispatcher-type flex "
    "--moe-flex-dispatcher-backend hybridep --bf16"
).split()


def megatron(*extra: str) -> Callable[[Path], Any]:
    """Megatron's `parse_args` (megatron-ext's patch applied) of MEGATRON + `extra`, as a training
    script named pretrain_gpt.py would call it."""

    def call(folder: Path):
        from megatron.training.arguments import parse_args

        argv = ["pretrain_gpt.py", *MEGATRON, *[a.replace("{folder}", str(folder)) for a in extra]]
        with _cwd(folder), mock.patch.object(sys, "argv", argv):
            parse_args()

    return call


def config(**fields: Any) -> Callable[[Path], Any]:
    """`HybridEPTransformerConfig(**fields)` of a small MoE model."""

    def call(folder: Path):
        from megatron_ext.options.config import HybridEPTransformerConfig

        HybridEPTransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, num_moe_experts=4, **fields)

    return call


FLEX = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


def python(text: str) -> Callable[[Path], Any]:
    """Python statements, run with `patches` (megatron_ext.patches), `group` (a one-rank gloo group)
    and `folder` in scope."""

    def call(folder: Path):
        import megatron_ext.patches as patches

        exec(text, dict(patches=patches, group=_GROUP.get("group"), folder=folder))

    return call


def fresh_launch(*argv: str) -> Callable[[Path], list[str]]:
    """The command line `python -m megatron_ext.launch train.py ARGV`, for a process of its own."""

    def command(folder: Path) -> list[str]:
        return [sys.executable, "-m", "megatron_ext.launch", "train.py", *argv]

    command.script = True
    return command


def _import_auto_after_parse(folder: Path) -> None:
    """`import megatron_ext.patches.auto` in a process where Megatron has parsed its arguments."""
    from megatron.training import global_vars

    sys.modules.pop("megatron_ext.patches.auto", None)
    with mock.patch.object(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(num_layers=2)):
        importlib.import_module("megatron_ext.patches.auto")


# ---------------------------------------------------------------------------------- environments


@contextlib.contextmanager
def _no_gpu() -> Iterator[None]:
    with (
        mock.patch("torch.cuda.is_available", return_value=False),
        mock.patch("torch.cuda.device_count", return_value=0),
    ):
        yield


# What the bench's TE check imports: None in sys.modules makes each import fail, even where TE is installed.
TE_MODULES = ("transformer_engine.pytorch", "transformer_engine.pytorch.ops")


@contextlib.contextmanager
def _gpu_without_te() -> Iterator[None]:
    """One GPU visible (said so to the parse only), Transformer Engine not importable."""
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.device_count", return_value=1),
        mock.patch.dict(sys.modules, dict.fromkeys(("transformer_engine", *TE_MODULES))),
    ):
        yield


class _OldHybridEPBuffer:
    """deep_ep's HybridEPBuffer of a hybrid-ep build before the non-blocking dispatch."""

    def dispatch_with_permute(self, *, hidden, routing_map, probs):
        raise AssertionError("never called: refused before")


ENVIRONMENTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "no GPU": _no_gpu,
    "no deep_ep": lambda: mock.patch.dict(sys.modules, {"deep_ep": None}),
    "old deep_ep": lambda: mock.patch.dict(
        sys.modules, {"deep_ep": types.SimpleNamespace(HybridEPBuffer=_OldHybridEPBuffer)}
    ),
    "GPU without TE": _gpu_without_te,
    "megatron-core 0.18.3": lambda: mock.patch(
        "megatron_ext.patches._compat.megatron_core_version", return_value="0.18.3"
    ),
    "torch 2.7.1": lambda: mock.patch("torch.__version__", "2.7.1"),
    "4 GiB free": lambda: mock.patch("megatron_ext.bench.cli._available_bytes", return_value=4 * 2**30),
}

# ---------------------------------------------------------------------------------- the table

# The refusal the README shows, which must be the line itself.
README_REFUSAL = next(
    line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("pretrain_gpt.py: error: ")
)
B, M, FRESH = "light", "megatron", "fresh"
FACTOR = "--moe-hybridep-capacity-factor"
IMPL = "--moe-hybridep-implementation"
RANGE = "use a number from 1.0 to 100"
FEATURES = "name one of dispatcher, experts, arguments, training"

CASES: tuple[Case, ...] = (
    # The bench's flags, and its output files.
    Case("bench json and plot one file", bench("--json", "F.png", "--plot", "F.png"), 2,
         ("--plot F.png: --json F.png writes there too", "give each output its own file"), keep=("F.png",)),
    Case("bench plot .json", bench("--plot", "out.json"), 2,
         ("--plot out.json: matplotlib cannot write a .json file", "end the name in .png"), keep=("out.json",)),
    Case("bench plot without suffix", bench("--plot", "out"), 2, ("--plot out:", "without a suffix", ".png")),
    Case("bench json a folder", bench("--json", "results"), 2, ("--json results: is a folder", "give a file name"),
         keep=("results/earlier.json",)),
    Case("bench json folder missing", bench("--json", "no/such/out.json"), 2,
         ("--json no/such/out.json: cannot write there", "does not exist")),
    Case("bench json unwritable folder", bench("--json", "/proc/out.json"), 2,
         ("--json /proc/out.json: cannot write there",)),
    Case("bench plot unwritable folder", bench("--plot", "/proc/out.png"), 2, ("--plot /proc/out.png: cannot write",)),
    Case("bench capacity factor 1e300", bench("--capacity-factor", "1e300"), 2, ("--capacity-factor 1e+300", RANGE)),
    Case("bench capacity factor 101", bench("--capacity-factor", "101"), 2, ("--capacity-factor 101", RANGE)),
    Case("bench capacity factor 100 beyond memory", bench("--size", "small", "--capacity-factor", "100"), 2,
         ("--size small on 4 CPU ranks needs at least 7 GiB", "and 4 GiB is available", "a lower --capacity-factor"),
         env=("4 GiB free",)),
    Case("bench capacity factor nan", bench("--capacity-factor", "nan"), 2, ("--capacity-factor nan", RANGE)),
    Case("bench capacity factor inf", bench("--capacity-factor", "inf"), 2, ("--capacity-factor inf", RANGE)),
    Case("bench capacity factor 0.5", bench("--capacity-factor", "0.5"), 2,
         ("--capacity-factor 0.5 would drop tokens", "use >= 1.0")),
    Case("bench capacity factor text", bench("--capacity-factor", "lots"), 2,
         ("--capacity-factor 'lots' is not a number",)),
    Case("bench mode mistyped", bench("--modes", "blocking,capacty+equal"), 2,
         ("'capacty+equal' (did you mean capacity+equal?)", "choose from")),
    Case("bench modes only commas", bench("--modes", " , "), 2, ("--modes ' , ' names no mode", "comma-separated")),
    Case("bench blocking alone", bench("--modes", "blocking"), 2,
         ("--modes blocking: blocking alone compares nothing", "name a mode to check")),
    Case("bench fp8 mode without recipe", bench("--modes", "capacity+equal+te+fp8"), 2,
         ("'capacity+equal+te+fp8'", "the fp8 modes need --fp8-recipe")),
    Case("bench fp8 recipe unknown", bench("--fp8-recipe", "mxfp8"), 2, ("--fp8-recipe", "invalid choice: 'mxfp8'")),
    Case("bench topk above experts", bench("--topk", "9", "--experts", "8"), 2,
         ("--topk 9 must be between 1 and --experts (8)",)),
    Case("bench experts not divisible", bench("--experts", "6", "--world-size", "4"), 2,
         ("--experts 6 must be divisible by the 4 ranks",)),
    Case("bench steps 0", bench("--steps", "0"), 2, ("--steps must be at least 1",)),
    Case("bench warmup negative", bench("--warmup", "-1"), 2, ("--warmup must be at least 0",)),
    Case("bench repeat 0", bench("--repeat", "0"), 2, ("--repeat must be at least 1",)),
    Case("bench layers not a number", bench("--layers", "two"), 2, ("--layers", "invalid int value: 'two'")),
    Case("bench skew nan", bench("--skew", "nan"), 2, ("--skew nan: use a finite number",)),
    Case("bench ranks per gpu 0", bench("--ranks-per-gpu", "0"), 2, ("--ranks-per-gpu must be at least 1",)),
    Case("bench deep_ep SMs 0", bench("--deep-ep-num-sms", "0"), 2,
         ("--deep-ep-num-sms must be at least 1", "leave it out")),
    Case("bench flag mistyped", bench("--capcity-factor", "2"), 2, ("unrecognized arguments: --capcity-factor 2",)),
    Case("bench size unknown", bench("--size", "huge"), 2, ("--size", "invalid choice: 'huge'")),
    # The environment, as the bench meets it.
    Case("bench cuda without a GPU", bench("--device", "cuda"), 2, ("--device cuda: no CUDA device is visible",),
         env=("no GPU",)),
    Case("bench shared GPUs without a GPU", bench("--ranks-per-gpu", "2"), 2,
         ("--ranks-per-gpu 2: ranks share GPUs, and no CUDA device",), env=("no GPU",)),
    Case("bench fp16 without a GPU", bench("--dtype", "fp16"), 2, ("--dtype fp16 needs a GPU", "use fp32 or bf16"),
         env=("no GPU",)),
    Case("bench graph mode without a GPU", bench("--modes", "capacity+equal+graph"), 2,
         ("--modes capacity+equal+graph: cannot run here: CUDA graphs need a GPU", "leave it out"), env=("no GPU",)),
    Case("bench deep_ep mode without deep_ep", bench("--modes", "deep_ep"), 2,
         ("--modes deep_ep: cannot run here: deep_ep does not import", "leave it out"), env=("no deep_ep",)),
    Case("bench TE mode without TE", bench("--modes", "capacity+equal+te", "--world-size", "1", gpu=True), 2,
         ("--modes capacity+equal+te: cannot run here", "Transformer Engine", "leave it out"), group=M,
         env=("GPU without TE",)),
    # The launcher.
    Case("launch without a script", launch(), 2, ("no training script given", "SCRIPT [ARGS...]")),
    Case("launch flag before the script", launch("--bf16", "train.py"), 2,
         ("no training script given; got the flag --bf16 first", "the script comes first")),
    Case("launch script missing", launch("nope.py"), 2, ("nope.py: no such script", "Megatron training script")),
    Case("launch script a folder", launch("scripts"), 2, ("scripts: is a folder, not a script",),
         keep=("scripts/earlier.py",)),
    Case("launch capacity factor 0.5", launch("train.py", *MEGATRON, FACTOR, "0.5"), 2,
         ("train.py: error: --moe-hybridep-capacity-factor 0.5 would drop tokens", "use >= 1.0"), group=M),
    Case("launch flag mistyped", launch("train.py", *MEGATRON, "--moe-hybridep-capcity-factor", "2"), 2,
         ("unrecognized arguments: --moe-hybridep-capcity-factor", "did you mean --moe-hybridep-capacity-factor?"),
         group=M),
    Case("launch unsupported megatron-core", launch("train.py", *MEGATRON), 2,
         ("found megatron-core 0.18.3", "pip install 'megatron-core>=0.19,<0.21'"), group=M,
         env=("megatron-core 0.18.3",)),
    Case("launch unsupported torch", launch("train.py", *MEGATRON), 2,
         ("found torch 2.7.1", "pip install 'torch>=2.8,<2.15'"), group=M, env=("torch 2.7.1",)),
    Case("fresh launch capacity factor 1e300", fresh_launch(*MEGATRON, FACTOR, "1e300"), 2,
         ("train.py: error: --moe-hybridep-capacity-factor 1e+300", RANGE), group=FRESH),
    Case("fresh launch verify without equal counts",
         fresh_launch(*MEGATRON, "--moe-hybridep-verify-equal-token-counts"), 2,
         ("--moe-hybridep-verify-equal-token-counts checks the declaration", "set that flag too"), group=FRESH),
    # Megatron's flags that megatron-ext adds or constrains, through Megatron's own parser.
    Case("megatron capacity factor 0.5", megatron(FACTOR, "0.5"), 2, (f"{FACTOR} 0.5 would drop tokens",), group=M),
    Case("megatron capacity factor 0.8, as the README shows it", megatron(FACTOR, "0.8"), 2, (README_REFUSAL,),
         group=M),
    Case("megatron capacity factor 1e300", megatron(FACTOR, "1e300"), 2, (f"{FACTOR} 1e+300", RANGE), group=M),
    Case("megatron capacity factor nan", megatron(FACTOR, "nan"), 2, (f"{FACTOR} nan is not a finite number", RANGE),
         group=M),
    Case("megatron capacity factor text", megatron(FACTOR, "lots"), 2, (FACTOR, "invalid", "'lots'"), group=M),
    Case("megatron implementation unknown", megatron(IMPL, "foo"), 2, (IMPL, "invalid choice: 'foo'"), group=M),
    Case("megatron overflow policy without capacity", megatron("--moe-hybridep-overflow-policy", "fail"), 2,
         ("--moe-hybridep-overflow-policy fail", f"set {FACTOR} too"), group=M),
    Case("megatron transport without capacity", megatron("--moe-hybridep-transport", "nvshmem"), 2,
         ("--moe-hybridep-transport nvshmem", f"set {FACTOR} too"), group=M),
    Case("megatron verify without equal counts", megatron("--moe-hybridep-verify-equal-token-counts"), 2,
         ("--moe-hybridep-verify-equal-token-counts", "set that flag too"), group=M),
    Case("megatron static splits without capacity", megatron("--moe-hybridep-static-expert-splits"), 2,
         ("--moe-hybridep-static-expert-splits", f"set {FACTOR} too"), group=M),
    Case("megatron compact routing with deep_ep", megatron("--moe-hybridep-compact-routing", IMPL, "deep_ep"), 2,
         ("--moe-hybridep-compact-routing with --moe-hybridep-implementation deep_ep", "torch"), group=M),
    Case("megatron equal and uneven padding",
         megatron("--moe-hybridep-equal-token-counts", "--moe-hybridep-pad-uneven-dispatch-inputs"), 2,
         ("--moe-hybridep-equal-token-counts declares", "Use one"), group=M),
    Case("megatron capacity with Megatron's expert capacity",
         megatron(FACTOR, "1.5", "--moe-expert-capacity-factor", "1.0"), 2,
         (f"{FACTOR} cannot be combined with --moe-expert-capacity-factor",), group=M),
    Case("megatron router top-k 0", megatron("--moe-router-topk", "0"), 2,
         ("--moe-router-topk 0", "use a top-k in that range"), group=M),
    Case("megatron capacity without flex", megatron(FACTOR, "1.5", "--moe-token-dispatcher-type", "alltoall"), 2,
         ("HybridEP flex dispatcher only", "--moe-token-dispatcher-type flex"), group=M),
    Case("megatron fp8 dispatch without fp8", megatron("--moe-hybridep-fp8-dispatch"), 2,
         ("--moe-hybridep-fp8-dispatch", "--fp8-recipe blockwise"), group=M),
    Case("megatron kernel cache unwritable", megatron("--moe-hybridep-kernel-cache", "/proc/kernels"), 2,
         ("--moe-hybridep-kernel-cache '/proc/kernels'", "Give a writable folder"), group=M),
    Case("megatron kernel cache a file", megatron("--moe-hybridep-kernel-cache", "{folder}/cache"), 2,
         ("--moe-hybridep-kernel-cache", "not a folder", "Give a writable folder"), group=M, keep=("cache",)),
    Case("megatron flag mistyped", megatron("--moe-hybridep-equal-token-count"), 2,
         ("unrecognized arguments", "did you mean --moe-hybridep-equal-token-counts?"), group=M),
    Case("megatron own flag not a number", megatron("--num-layers", "abc"), 2,
         ("--num-layers", "invalid int value: 'abc'"), group=M),
    Case("megatron deep_ep not installed", megatron(IMPL, "deep_ep"), 2,
         (f"{IMPL} deep_ep: deep_ep's HybridEPBuffer is not usable here", "or use"), group=M, env=("no deep_ep",)),
    Case("megatron deep_ep too old", megatron(IMPL, "deep_ep"), 2,
         ("takes no num_permuted_tokens", "Install DeepEP's hybrid-ep branch"), group=M, env=("old deep_ep",)),
    # The config fields, set in Python.
    Case("config capacity factor 0.5", config(**FLEX, moe_hybridep_capacity_factor=0.5), "HybridEPConfigError",
         (f"{FACTOR} 0.5 would drop tokens",), group=M),
    Case("config capacity factor 1e300", config(**FLEX, moe_hybridep_capacity_factor=1e300), "HybridEPConfigError",
         (f"{FACTOR} 1e+300", RANGE), group=M),
    Case("config capacity factor a string", config(**FLEX, moe_hybridep_capacity_factor="1.5"), "HybridEPConfigError",
         (f"{FACTOR} '1.5' is not a finite number",), group=M),
    Case("config capacity factor a bool", config(**FLEX, moe_hybridep_capacity_factor=True), "HybridEPConfigError",
         (f"{FACTOR} True is not a finite number",), group=M),
    Case("config implementation unknown", config(**FLEX, moe_hybridep_implementation="foo"), "HybridEPConfigError",
         (f"{IMPL} 'foo' is not one of auto, deep_ep, torch",), group=M),
    Case("config overflow policy unknown", config(**FLEX, moe_hybridep_overflow_policy="never"),
         "HybridEPConfigError", ("--moe-hybridep-overflow-policy 'never' is not one of rerun, fail",), group=M),
    Case("config transport unknown", config(**FLEX, moe_hybridep_transport="smoke"), "HybridEPConfigError",
         ("--moe-hybridep-transport 'smoke' is not one of",), group=M),
    Case("config capacity without flex", config(moe_hybridep_capacity_factor=1.5), "HybridEPConfigError",
         ("HybridEP flex dispatcher only", "Set --moe-token-dispatcher-type flex"), group=M),
    # The Python API: the patch, the sizing rule, the buffer.
    Case("apply an unknown feature", python("patches.apply('moe')"), "ValueError",
         ("apply: no feature 'moe'", FEATURES), group=M),
    Case("apply a mistyped feature", python("patches.apply('dispatchr')"), "ValueError",
         ("did you mean 'dispatcher'?", FEATURES), group=M),
    Case("apply a bool by position", python("patches.apply(True)"), "TypeError",
         ("apply: give feature names", "as strings; got True"), group=M),
    Case("apply a flag that is not a bool", python("patches.apply(dispatcher='no')"), "TypeError",
         ("apply: dispatcher= takes True or False; got 'no'",), group=M),
    Case("apply a feature named and turned off", python("patches.apply('dispatcher', dispatcher=False)"), "ValueError",
         ("apply: 'dispatcher' named and dispatcher=False",), group=M),
    Case("apply a patched attribute's name",
         python("patches.apply('megatron.core.transformer.moe.moe_layer.MoEFlexTokenDispatcher')"), "ValueError",
         ("apply: name features (dispatcher, experts, arguments, training), not patched attributes",), group=M),
    Case("revert a mistyped feature", python("patches.revert('dispatchr')"), "ValueError",
         ("revert: no feature 'dispatchr'; did you mean 'dispatcher'?", "a dotted name that apply() returned"),
         group=M),
    Case("revert a number", python("patches.revert(3)"), "TypeError", ("revert: give feature names", "got 3"), group=M),
    Case("revert a list holding a number", python("patches.revert(['dispatcher', 7])"), "TypeError",
         ("revert: give feature names", "got 7"), group=M),
    Case("patched an unknown feature", python("with patches.patched('moe'):\n    pass"), "ValueError",
         ("apply: no feature 'moe'", FEATURES), group=M),
    Case("apply on an unsupported megatron-core", python("patches.apply()"), "UnsupportedMegatronError",
         ("found megatron-core 0.18.3", "Install a supported release"), group=M, env=("megatron-core 0.18.3",)),
    Case("apply on an unsupported torch", python("patches.apply()"), "UnsupportedTorchError",
         ("found torch 2.7.1", "pip install 'torch>=2.8,<2.15'"), group=M, env=("torch 2.7.1",)),
    Case("auto imported after Megatron parsed", _import_auto_after_parse, 2,
         ("imported after Megatron parsed its arguments", "import it before parse_args"), group=M),
    Case("capacity from rows with a factor of 1e300",
         python("from megatron_ext.capacity import capacity_from_rows\ncapacity_from_rows(100, 1e300)"),
         "HybridEPConfigError", ("capacity_from_rows: `factor` 1e+300", RANGE), group=M),
    Case("capacity from negative rows",
         python("from megatron_ext.capacity import capacity_from_rows\ncapacity_from_rows(-1, 1.5)"), "ValueError",
         ("capacity_from_rows: `rows` must be >= 0; got -1",), group=M),
    Case("buffer hidden size 0",
         python("from megatron_ext.hybridep import TorchHybridEPBuffer\nTorchHybridEPBuffer(group, 0, 6, 4)"),
         "ValueError", ("`hidden_dim` must be a positive int; got 0",), group=M),
    Case("buffer dispatch of integer tokens",
         python(
             "import torch\nfrom megatron_ext.hybridep import TorchHybridEPBuffer\n"
             "buffer = TorchHybridEPBuffer(group, 8, 6, 4)\n"
             "buffer.dispatch_with_permute(hidden=torch.zeros(6, 8, dtype=torch.long),"
             " routing_map=torch.ones(6, 4, dtype=torch.bool), probs=torch.ones(6, 4))"
         ),
         "ValueError", ("`hidden` must be", "bfloat16, float16 or float32"), group=M),
    Case("buffer non-blocking dispatch without a capacity",
         python(
             "import torch\nfrom megatron_ext.hybridep import TorchHybridEPBuffer\n"
             "buffer = TorchHybridEPBuffer(group, 8, 6, 4)\n"
             "buffer.dispatch_with_permute(hidden=torch.zeros(6, 8), routing_map=torch.ones(6, 4, dtype=torch.bool),"
             " probs=torch.ones(6, 4), non_blocking=True)"
         ),
         "ValueError", ("`num_permuted_tokens` must be", "non_blocking=True"), group=M),
)  # fmt: skip


# ---------------------------------------------------------------------------------- running a group


_GROUP: dict[str, Any] = {}  # the megatron group's one-rank gloo process group


@contextlib.contextmanager
def _cwd(folder: Path) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _prepare(case: Case, folder: Path) -> dict[str, bytes]:
    """The case's folder with its `keep` files written; the folder's files (launch's train.py too)."""
    folder.mkdir(parents=True)
    for name in case.keep:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"written before the case: {name}\n")
    if getattr(case.call, "script", False):
        (folder / "train.py").write_text(TRAIN_SCRIPT)
    return _files(folder)


def _outcome(case: Case, folder: Path, before: dict[str, bytes], **outcome: Any) -> dict[str, Any]:
    after = _files(folder)
    outcome["changed"] = sorted(name for name in before if after.get(name) != before[name])
    outcome["made"] = sorted(set(after) - set(before))
    return outcome


def run_case(case: Case, folder: Path) -> dict[str, Any]:
    """Give `case`'s input in this process, as its entry point would take it; what came of it."""
    before = _prepare(case, folder)
    out, err = io.StringIO(), io.StringIO()
    status: int | str = 0
    message = None
    with contextlib.ExitStack() as stack:
        for name in case.env:
            stack.enter_context(ENVIRONMENTS[name]())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                case.call(folder)
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)  # as the interpreter says it
            except Exception as error:
                if isinstance(case.expect, int):  # a command: the interpreter would print the traceback
                    traceback.print_exc()
                    status = 1
                else:
                    status, message = type(error).__name__, str(error)
    return _outcome(case, folder, before, status=status, stdout=out.getvalue(), stderr=err.getvalue(), message=message)


def start_fresh(case: Case, folder: Path) -> tuple[subprocess.Popen, dict[str, bytes]]:
    """`case`'s command started in a process of its own; the folder's files before it."""
    before = _prepare(case, folder)
    process = subprocess.Popen(
        case.call(folder), cwd=folder, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return process, before


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_group(group: str, folder: Path) -> dict[str, dict[str, Any]]:
    """Every case of `group`, one after the other in this process."""
    if group == M:
        _start_megatron(folder)
    return {case.id: run_case(case, folder / _slug(case.id)) for case in CASES if case.group == group}


def _start_megatron(folder: Path) -> None:
    """Megatron imported, megatron-ext's patch applied, a one-rank gloo group: what the cases share.
    What importing Megatron warns (no TE, no apex) is said here, before the cases (the fresh cases
    check what a user sees of it)."""
    import torch.distributed as dist

    import megatron_ext.patches

    megatron_ext.patches.apply()
    importlib.import_module("megatron.core.extensions.transformer_engine")  # before "GPU without TE" hides TE
    folder.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'gloo'}", rank=0, world_size=1)
    _GROUP["group"] = dist.group.WORLD


def _slug(case_id: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in case_id)


# ---------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every case's outcome: the two shared groups and the fresh cases, all at once (4 processes at most)."""
    folder = tmp_path_factory.mktemp("bad_inputs")
    with slots.lend(4):
        return _every_outcome(folder)


def _every_outcome(folder: Path) -> dict[str, dict[str, Any]]:
    groups = {
        group: subprocess.Popen(
            [sys.executable, "-m", "tests.test_bad_inputs", group, str(folder / f"{group}.json"), str(folder / group)],
            cwd=ROOT,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for group in (B, M)
    }
    fresh = [case for case in CASES if case.group == FRESH]
    started = [start_fresh(case, folder / FRESH / _slug(case.id)) for case in fresh]
    found: dict[str, dict[str, Any]] = {}
    for case, (process, before) in zip(fresh, started):
        stdout, stderr = process.communicate(timeout=600)
        found[case.id] = _outcome(
            case, folder / FRESH / _slug(case.id), before, status=process.returncode, stdout=stdout, stderr=stderr
        )
    for group, process in groups.items():
        log, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"the {group} group's process failed:\n{log[-4000:]}"
        found |= json.loads((folder / f"{group}.json").read_text())
    return found


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_refused_in_one_line(case, outcomes):
    outcome = outcomes[case.id]
    said = outcome["stderr"] + outcome["stdout"]
    assert outcome["status"] == case.expect, said[-3000:] or outcome["message"]
    assert TRACEBACK not in said, said[-3000:]
    if isinstance(case.expect, int):
        lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1, outcome["stderr"][-3000:]
        line = lines[0]
        assert outcome["stdout"] == "", outcome["stdout"][-2000:]
    else:
        line = outcome["message"]
        assert "\n" not in line, line
    missing = [fragment for fragment in case.says if fragment not in line]
    assert not missing, f"{missing} not in: {line}"
    assert outcome["changed"] == [], f"files changed by a refused input: {outcome['changed']}"
    assert outcome["made"] == [], f"files made by a refused input: {outcome['made']}"


def test_the_table_has_sixty_cases_or_more_and_the_docs_say_how_many():
    ids = [case.id for case in CASES]
    assert len(set(ids)) == len(ids), "two cases share an id"
    assert len(CASES) >= 60
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert f"{len(CASES)} bad inputs" in testing, "docs/testing.md states another count of bad inputs"
    assert {case.group for case in CASES} == {B, M, FRESH}
    assert set().union(*(case.env for case in CASES)) == set(ENVIRONMENTS), "an environment no case uses"


# What a refusal named in these cases once was: the inputs the fixes made acceptable.


def test_modes_take_spaces_around_their_names(monkeypatch):
    from megatron_ext.bench.cli import parse

    monkeypatch.delenv("RANK", raising=False)
    args = parse(["--modes", "blocking, capacity+equal ", "--device", "cpu"])
    assert [m.name for m in args.selected] == ["blocking", "capacity+equal"]


def test_the_largest_capacity_factor_is_accepted():
    from megatron_ext.options import MAX_CAPACITY_FACTOR, check_capacity_factor

    assert check_capacity_factor(MAX_CAPACITY_FACTOR) == MAX_CAPACITY_FACTOR
    assert check_capacity_factor(1.0) == 1.0


if __name__ == "__main__":  # python -m tests.test_bad_inputs GROUP OUT FOLDER
    group_name, out_path, base_folder = sys.argv[1:4]
    os.environ.pop("RANK", None)
    Path(out_path).write_text(json.dumps(run_group(group_name, Path(base_folder))))
