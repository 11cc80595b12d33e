"""The example launch scripts, on CPU: their flags through Megatron's own parser, and their command lines.

Each script's `DRY_RUN=1` runs `examples/pretrain_moe.py --megatron-ext-dry-run` with the arguments
it would train with, which parses and validates them with Megatron's `parse_args`/`validate_args`
and prints what it would build. A dry run spends about 5 s of CPU importing Megatron and holds
about 1 GB, so they run in one module fixture, `DRY_RUNS_AT_ONCE` (4) at a time (all 25 at once
loaded 2 cores some 90 deep and risked a small machine's memory). The real command lines are read
through a stand-in interpreter (and stand-in `srun`/`scontrol`) that records its arguments instead
of training.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import slots

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
PRETRAIN = EXAMPLES / "pretrain_moe.py"
DRY_RUN_FLAG = "--megatron-ext-dry-run"
# Variables the scripts read; the test sets each one it wants, and inherits none.
SCRIPT_VARS = (
    *("MODE", "PRECISION", "GPUS", "DRY_RUN", "PYTHON", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"),
    *("TOKENS", "HIDDEN", "EXPERTS", "TOPK"),
    *("RANKS", "RANKS_PER_GPU", "PP", "VPP", "CAPACITY_FACTOR", "KERNEL_CACHE", "LAYERS", "GRAPHS"),
)
SLURM = {"SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_JOB_ID": "42"}

# At most this many dry runs at once (each a Megatron-importing process).
DRY_RUNS_AT_ONCE = 4
# name: (script, environment, extra arguments); each runs with DRY_RUN=1 and no GPU tool on its PATH.
DRY_RUNS = {
    "smoke": ("smoke_1gpu.sh", {}, []),
    "smoke-blocking": ("smoke_1gpu.sh", {"MODE": "blocking"}, []),
    "smoke-stock": ("smoke_1gpu.sh", {"MODE": "stock"}, []),
    "smoke-stock-hybridep": ("smoke_1gpu.sh", {"MODE": "stock-hybridep"}, []),
    "smoke-no-kernel-cache": ("smoke_1gpu.sh", {"KERNEL_CACHE": ""}, []),
    "smoke-fp16": ("smoke_1gpu.sh", {"PRECISION": "fp16", "MODE": "blocking"}, []),
    # capacity mode's own experts compute in bf16 on a GPU: refused when parsed
    "smoke-fp16-capacity": ("smoke_1gpu.sh", {"PRECISION": "fp16"}, []),
    # refused by the layer build where TE is absent (the local spec's experts); by Megatron's validate_args
    "smoke-static-splits": ("smoke_1gpu.sh", {}, ["--moe-hybridep-static-expert-splits"]),
    "smoke-graphs-nan-check": ("smoke_1gpu.sh", {}, ["--cuda-graph-impl", "full_iteration"]),
    "smoke-graphs-full": ("smoke_1gpu.sh", {"GRAPHS": "full"}, []),
    "ep8": ("ep8_single_node.sh", {}, []),
    "small-ep": ("small_ep.sh", {}, []),
    # 4 ranks sharing a GPU: PP 2 x EP 2, and the interleaved schedule (2 virtual stages per rank)
    "small-ep-pp2": ("small_ep.sh", {"RANKS": "4", "RANKS_PER_GPU": "4", "PP": "2"}, []),
    "small-ep-vpp2": ("small_ep.sh", {"RANKS": "4", "PP": "2", "VPP": "2", "CAPACITY_FACTOR": "1.25"}, []),
    "slurm": ("slurm_multinode.sbatch", {**SLURM, "SLURM_SUBMIT_DIR": str(REPO)}, []),
    "roundtrip": ("roundtrip_torchrun.sh", {}, []),
    "smoke-fp16-appended": ("smoke_1gpu.sh", {}, ["--fp16"]),
    # What a run would refuse (the experts' build, Megatron's process groups, megatron-ext's parse).
    "ep8-etp-blocking": (
        "ep8_single_node.sh",
        {"MODE": "blocking"},
        ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "4"],
    ),
    "ep8-etp": ("ep8_single_node.sh", {}, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "4"]),
    "ep8-pp2": ("ep8_single_node.sh", {}, ["--pipeline-model-parallel-size", "2"]),
    "ep8-cp2": ("ep8_single_node.sh", {}, ["--context-parallel-size", "2"]),
    "smoke-topk0": ("smoke_1gpu.sh", {}, ["--moe-router-topk", "0"]),
    "smoke-typo": ("smoke_1gpu.sh", {}, ["--moe-hybridep-capcity-factor", "1.5"]),
    # docs/examples.md's fp8 line: TE's layers and op-fuser experts, tensorwise.
    "smoke-fp8": (
        "smoke_1gpu.sh",
        {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"},
        ["--transformer-impl", "transformer_engine", "--use-transformer-engine-op-fuser"]
        + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    ),
}
# The dry runs that must succeed: one for every example script, and then some.
# The launch scripts (a shebang; examples/modes.sh, sourced by them, is none).
SCRIPTS = sorted(
    p.name for p in EXAMPLES.iterdir() if p.suffix in (".sh", ".sbatch") and p.read_text().startswith("#!")
)
REFUSED_DRY_RUNS = (
    *("smoke-fp16-appended", "smoke-fp16-capacity", "smoke-static-splits", "smoke-graphs-nan-check"),
    *("ep8-etp-blocking", "ep8-etp", "ep8-pp2", "ep8-cp2", "smoke-topk0", "smoke-typo"),
)
PASSING_DRY_RUNS = [name for name in DRY_RUNS if name not in (*REFUSED_DRY_RUNS, "smoke-fp8")]
# The tools the scripts use outside bash, and no other (no nvidia-smi, no SLURM command).
SCRIPT_TOOLS = ("dirname",)
FACTOR, EQUAL, REUSE = (
    "--moe-hybridep-capacity-factor",
    "--moe-hybridep-equal-token-counts",
    "--moe-hybridep-reuse-allgather-buffer",
)


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS and not k.startswith("SLURM_")}
    return {**env, **extra}


def report(stdout: str) -> dict[str, str]:
    """The dry run's 'name: value' lines."""
    assert "megatron-ext dry run:" in stdout, stdout[-2000:]
    lines = stdout.split("megatron-ext dry run:", 1)[1].splitlines()[1:]
    return dict(line.split(": ", 1) for line in lines if ": " in line)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """A folder of stand-ins: `python` records its environment's WORLD_SIZE and its arguments to
    $RECORD, one a line; `srun` runs its command (options written `--x=y`); `scontrol` names two hosts."""
    folder = tmp_path_factory.mktemp("stubs")
    scripts = {
        "python": 'printf "WORLD_SIZE=%s\\n" "${WORLD_SIZE-}" > "$RECORD"; printf "%s\\n" "$@" >> "$RECORD"',
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "node01\\nnode02\\n"',
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def recorded_command(stubs: Path, tmp_path: Path, script: str, **env: str) -> tuple[str, list[str]]:
    """(WORLD_SIZE, arguments) that `script` passes to its interpreter."""
    record = tmp_path / "record"
    env = script_env(PYTHON=str(stubs / "python"), RECORD=str(record), **env)
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    world_size, *argv = record.read_text().splitlines()
    return world_size.removeprefix("WORLD_SIZE="), argv


@pytest.fixture(scope="module")
def smoke_args(stubs, tmp_path_factory) -> list[str]:
    """The arguments smoke_1gpu.sh trains with."""
    _, argv = recorded_command(stubs, tmp_path_factory.mktemp("smoke"), "smoke_1gpu.sh", DRY_RUN="1")
    assert Path(argv[0]).resolve() == PRETRAIN and argv[-1] == DRY_RUN_FLAG
    return argv[1:-1]


@pytest.fixture(scope="module")
def no_gpu_tools(tmp_path_factory) -> str:
    """A PATH with only the tools the scripts need (no nvidia-smi, srun or scontrol): any machine."""
    folder = tmp_path_factory.mktemp("no_gpu_tools")
    for tool in SCRIPT_TOOLS:
        (folder / tool).symlink_to(shutil.which(tool))
    return str(folder)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory, smoke_args, no_gpu_tools) -> dict[str, subprocess.CompletedProcess]:
    """Every dry run, `DRY_RUNS_AT_ONCE` side by side: the scripts', pretrain_moe.py's with the smoke
    arguments and a capacity factor below 1 ("invalid"), and pretrain_moe.py --help."""
    folder = tmp_path_factory.mktemp("dry_runs")
    bash = shutil.which("bash")
    commands = {
        name: (
            [bash, str(EXAMPLES / script), *extra],
            script_env(DRY_RUN="1", PYTHON=sys.executable, **env) | {"PATH": no_gpu_tools},
        )
        for name, (script, env, extra) in DRY_RUNS.items()
    }
    invalid = [sys.executable, str(PRETRAIN), *smoke_args, FACTOR, "0.5", DRY_RUN_FLAG]
    commands["invalid"] = (invalid, script_env())
    unset = {"--micro-batch-size": 2, "--eval-interval": 2}  # each flag with its value, removed
    incomplete = [a for i, a in enumerate(smoke_args) if not _is_removed(smoke_args, i, unset)]
    commands["incomplete"] = ([sys.executable, str(PRETRAIN), *incomplete, DRY_RUN_FLAG], script_env())
    commands["help"] = ([sys.executable, str(PRETRAIN), "--help"], script_env(COLUMNS="10000"))

    def run(name: str) -> subprocess.CompletedProcess:
        command, env = commands[name]
        with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
            code = subprocess.run(command, env=env, cwd=folder, stdout=out, stderr=err, timeout=600).returncode
        return subprocess.CompletedProcess(
            command, code, (folder / f"{name}.out").read_text(), (folder / f"{name}.err").read_text()
        )

    with slots.lend(DRY_RUNS_AT_ONCE), concurrent.futures.ThreadPoolExecutor(DRY_RUNS_AT_ONCE) as pool:
        return dict(zip(commands, pool.map(run, commands)))


@pytest.fixture(scope="module")
def example():
    """examples/pretrain_moe.py as a module (it imports Megatron)."""
    spec = importlib.util.spec_from_file_location("pretrain_moe_example", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_removed(argv: list[str], index: int, flags: dict[str, int]) -> bool:
    """Whether argv[index] is one of `flags` or one of the values that follow it."""
    for flag, width in flags.items():
        for start in (i for i, a in enumerate(argv) if a == flag):
            if start <= index < start + width:
                return True
    return False


def dry_run_report(dry_runs, name: str) -> dict[str, str]:
    result = dry_runs[name]
    assert result.returncode == 0, result.stderr[-3000:]
    return report(result.stdout)


def test_smoke_dry_run(dry_runs):
    got = dry_run_report(dry_runs, "smoke")

    assert got["world size"] == "1" and got["expert parallel"] == "1"
    assert (got["layers"], got["hidden size"], got["experts"], got["top-k"]) == ("4", "512", "8", "2")
    assert (got["dispatcher"], got["flex backend"]) == ("flex", "hybridep")
    assert (got[FACTOR], got[EQUAL], got[REUSE]) == ("1.5", "True", "True")
    assert got["capacity mode"] == "on"
    assert got["params dtype"] == "torch.bfloat16"
    # No TE or apex needed: the local spec, with megatron-ext's grouped-GEMM experts.
    assert got["transformer impl"] == "local" and got["layer spec"] == "local"
    assert got["experts built"] == "megatron_ext.experts.GroupedMLP"
    assert got["samples (train, valid, test)"] == "(20, 0, 0)"
    assert got["attention mask from the data loader"] == "False"  # causal attention makes its own
    # deep_ep's compiled kernels kept for the next job, under the user's cache folder by default
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
    assert got["--moe-hybridep-kernel-cache"] == os.path.join(cache_home, "megatron-ext", "hybrid-ep-kernels")
    assert dry_run_report(dry_runs, "smoke-no-kernel-cache")["--moe-hybridep-kernel-cache"] == "None"


def test_smoke_blocking_dry_run_differs_only_in_capacity_mode(dry_runs):
    capacity = dry_run_report(dry_runs, "smoke")
    blocking = dry_run_report(dry_runs, "smoke-blocking")

    assert (blocking[FACTOR], blocking[EQUAL], blocking["capacity mode"]) == ("None", "False", "off")
    # Everything else is the same run, experts included, so the losses can be compared.
    differing = {name for name in capacity.keys() | blocking.keys() if capacity.get(name) != blocking.get(name)}
    assert differing == {FACTOR, EQUAL, "capacity mode"}


def test_smoke_stock_dry_run_is_megatrons_all_to_all_with_the_same_model(dry_runs):
    capacity = dry_run_report(dry_runs, "smoke")
    stock = dry_run_report(dry_runs, "smoke-stock")

    assert stock["dispatcher"] == "alltoall"
    assert (stock[FACTOR], stock[EQUAL], stock[REUSE], stock["capacity mode"]) == ("None", "False", "False", "off")
    assert stock["--moe-hybridep-kernel-cache"] == "None"  # no deep_ep kernels to keep
    # The same model and experts otherwise, so the loop's figures compare like for like.
    for name in ("layers", "hidden size", "experts", "top-k", "experts built", "params dtype", "layer spec"):
        assert stock[name] == capacity[name], name
    # Megatron's own HybridEP flex dispatcher: none of megatron-ext's flags set.
    hybridep = dry_run_report(dry_runs, "smoke-stock-hybridep")
    assert (hybridep["dispatcher"], hybridep["flex backend"]) == ("flex", "hybridep")
    assert (hybridep[FACTOR], hybridep[EQUAL], hybridep[REUSE]) == ("None", "False", "False")


def test_ep8_dry_run(dry_runs):
    got = dry_run_report(dry_runs, "ep8")

    assert (got["world size"], got["expert parallel"], got["data parallel"]) == ("8", "8", "8")
    assert got["expert data parallel"] == "1"
    assert (got["layers"], got["hidden size"], got["experts"], got["top-k"]) == ("16", "2048", "64", "8")
    assert (got["dispatcher"], got["flex backend"]) == ("flex", "hybridep")
    assert (got[FACTOR], got[EQUAL], got[REUSE]) == ("1.5", "True", "True")


def test_small_ep_dry_runs_split_the_ranks_into_stages_and_expert_parallel(dry_runs):
    names = ("small-ep", "small-ep-pp2", "small-ep-vpp2")
    one_per_gpu, shared, interleaved = (dry_run_report(dry_runs, name) for name in names)

    layout = (one_per_gpu["world size"], one_per_gpu["expert parallel"], one_per_gpu["pipeline parallel"])
    assert layout == ("2", "2", "1")
    assert one_per_gpu["distributed backend"] == "nccl" and one_per_gpu[FACTOR] == "1.5"
    assert (shared["world size"], shared["pipeline parallel"], shared["expert parallel"]) == ("4", "2", "2")
    assert shared["distributed backend"] == "gloo"  # 4 ranks share a GPU: NCCL refuses that
    assert (interleaved["pipeline parallel"], interleaved["virtual pipeline stages per rank"]) == ("2", "2")
    assert interleaved[FACTOR] == "1.25" and interleaved["distributed backend"] == "nccl"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANKS": "3", "PP": "2"}, "RANKS=3 is not a multiple of PP=2"),
        ({"RANKS": "4", "PP": "2", "VPP": "4"}, "PP=2 x VPP=4 must divide the model's 4 layers"),
        ({"RANKS": "two"}, "RANKS must be a positive integer, not 'two'"),
    ],
)
def test_small_ep_refuses_a_layout_it_cannot_split_in_one_line(env, message):
    result = subprocess.run(
        ["bash", str(EXAMPLES / "small_ep.sh")], env=script_env(DRY_RUN="1", **env), capture_output=True, text=True
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("ranks_per_gpu", ["1", "4"])
def test_small_ep_shares_gpus_through_the_launcher_over_gloo(stubs, tmp_path, ranks_per_gpu):
    env = dict(RANKS="4", RANKS_PER_GPU=ranks_per_gpu, PP="2")
    _, train = recorded_command(stubs, tmp_path, "small_ep.sh", **env)
    _, dry = recorded_command(stubs, tmp_path, "small_ep.sh", DRY_RUN="1", **env)

    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    if ranks_per_gpu != "1":
        launcher += ["-m", "megatron_ext.tooling.shared_gpu", "--ranks-per-gpu", ranks_per_gpu]
    assert train[: len(launcher)] == launcher
    pretrain, *args = train[len(launcher) :]
    assert Path(pretrain).resolve() == PRETRAIN and dry == [pretrain, *args, DRY_RUN_FLAG]
    backend = args[args.index("--distributed-backend") + 1]
    assert backend == ("nccl" if ranks_per_gpu == "1" else "gloo")


def test_slurm_dry_run_takes_the_node_count_from_slurm(dry_runs):
    got = dry_run_report(dry_runs, "slurm")

    # 3 nodes of 8: experts over the 8 GPUs of a node, data parallel across the nodes.
    assert (got["world size"], got["expert parallel"], got["expert data parallel"]) == ("24", "8", "3")
    assert (got["experts"], got["top-k"]) == ("64", "8")
    assert (got["dispatcher"], got["flex backend"]) == ("flex", "hybridep")
    assert (got[FACTOR], got[EQUAL], got[REUSE]) == ("1.5", "True", "True")


def test_slurm_dry_run_outside_slurm_assumes_two_nodes(stubs, tmp_path):
    world_size, argv = recorded_command(stubs, tmp_path, "slurm_multinode.sbatch", DRY_RUN="1")

    assert world_size == "16"
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "8"
    assert argv[argv.index("--global-batch-size") + 1] == "64"


TORCH_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")  # torch's C++-style log: "W1202 07:38:36..."


def test_every_example_script_has_a_dry_run():
    assert sorted({DRY_RUNS[name][0] for name in PASSING_DRY_RUNS}) == SCRIPTS


@pytest.mark.parametrize("name", PASSING_DRY_RUNS)
def test_dry_run_needs_no_gpu_tools_and_prints_no_warnings(dry_runs, name):
    result = dry_runs[name]

    assert result.returncode == 0, result.stderr[-3000:]
    assert "megatron-ext dry run:" in result.stdout
    # Megatron's and torch's import-time warnings (no TE, no apex, no CUDA runtime) are left out.
    noise = [line for line in result.stderr.splitlines() if "warn" in line.lower() or TORCH_LOG_LINE.match(line)]
    assert not noise, "\n".join(noise[:20])
    # What stays: Megatron's remarks on the flags themselves, one line each.
    notes = [line for line in result.stderr.splitlines() if not line.startswith("pretrain_moe.py: Megatron: ")]
    assert not notes, result.stderr[-3000:]


def test_dry_run_keeps_megatrons_remarks_on_the_flags(dry_runs):
    # 64 experts without fp32 routing (ep8, slurm); dynamic loss scaling (fp16).
    fp32_routing = "pretrain_moe.py: Megatron: Using a large number of experts (e.g. >=32) without fp32 routing."
    assert fp32_routing in dry_runs["ep8"].stderr and fp32_routing in dry_runs["slurm"].stderr
    loss_scaling = "pretrain_moe.py: Megatron: Setting args.check_for_nan_in_loss_and_grad to False since dynamic"
    assert loss_scaling in dry_runs["smoke-fp16"].stderr
    assert dry_runs["smoke"].stderr == "" and dry_runs["roundtrip"].stderr == ""


def test_precision_fp16_dry_run_differs_only_in_the_dtype(dry_runs):
    bf16 = dry_run_report(dry_runs, "smoke-blocking")
    fp16 = dry_run_report(dry_runs, "smoke-fp16")

    assert fp16["params dtype"] == "torch.float16"
    assert {name for name in bf16.keys() | fp16.keys() if bf16.get(name) != fp16.get(name)} == {"params dtype"}


def test_dry_run_refuses_fp16_in_capacity_mode_with_its_own_experts(dry_runs):
    """It passed the dry run and stopped at the model build on a GPU (GroupedMLP computes in bf16 there)."""
    result = dry_runs["smoke-fp16-capacity"]

    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("pretrain_moe.py: error: --moe-hybridep-capacity-factor with --fp16: "), (
        result.stderr[-3000:]
    )
    assert "Train with --bf16" in result.stderr and "--use-transformer-engine-op-fuser" in result.stderr
    assert result.stderr.count("\n") == 1 and "megatron-ext dry run:" not in result.stdout


@pytest.mark.parametrize(
    "name, message",
    [
        ("smoke-static-splits", "--moe-hybridep-static-expert-splits "),
        ("smoke-graphs-nan-check", "Megatron's validate_args refuses these flags: --no-check-for-nan-in-loss-and-grad"),
    ],
)
def test_dry_run_says_what_the_build_or_megatron_would_refuse_in_one_line(dry_runs, name, message):
    """What the layer build refuses (the experts the spec gives), and Megatron's own asserts on the
    flags, are the dry run's one-line refusal with exit status 2, not a traceback."""
    result = dry_runs[name]

    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"pretrain_moe.py: error: {message}"), result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_bare_assert_is_named_by_its_source_line(example):
    def megatron_check():  # what a bare assert raises outside pytest's rewriting: no message
        raise AssertionError

    with pytest.raises(AssertionError) as bare:
        megatron_check()
    line = bare.tb.tb_next.tb_lineno
    assert example._assertion(bare.value) == f"raise AssertionError (test_examples.py:{line})"
    assert example._assertion(AssertionError("experts should divide")) == "experts should divide"


def test_dry_run_refuses_fp16_appended_to_the_scripts_bf16(dry_runs):
    result = dry_runs["smoke-fp16-appended"]

    assert result.returncode == 2, result.stderr[-3000:]
    # One line, before validate_args' bare AssertionError, naming both flags and the fix.
    assert result.stderr.startswith("pretrain_moe.py: error: --bf16 and --fp16 are both set"), result.stderr[-3000:]
    assert "give PRECISION=fp16 (or edit the script) instead of appending --fp16" in result.stderr
    assert result.stderr.count("\n") == 1 and "usage:" not in result.stderr
    assert "megatron-ext dry run:" not in result.stdout


def test_fp8_dry_run_builds_where_te_imports_and_says_why_not_elsewhere(dry_runs):
    """Megatron's config refuses MoE fp8 without Transformer Engine: one line, exit 2, no traceback."""
    result = dry_runs["smoke-fp8"]
    if importlib.util.find_spec("transformer_engine") is not None:
        assert dry_run_report(dry_runs, "smoke-fp8")["transformer impl"] == "transformer_engine"
        return
    assert result.returncode == 2, result.stderr[-3000:]
    # Megatron's remarks on the flags, one line each (a streaming-dequantize note for tensorwise), then the error.
    *remarks, error = result.stderr.splitlines()
    assert error.startswith("pretrain_moe.py: error: Megatron's TransformerConfig refuses"), result.stderr
    assert "transformer-engine" in error and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert all(line.startswith("pretrain_moe.py: Megatron: ") for line in remarks), remarks
    assert "megatron-ext dry run:" not in result.stdout


def test_two_precisions_are_refused_naming_the_one_given_last(example, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="prog")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    example.refuse_two_precisions(parser)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)

    assert parser.parse_args(["--fp16"]).fp16
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--fp16", "--bf16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prog: error: --fp16 and --bf16 are both set: they are two switches, so the later --bf16")
    assert "give PRECISION=bf16 (or edit the script) instead of appending --bf16" in err


def test_scripts_refuse_an_unknown_precision(stubs, tmp_path):
    env = script_env(PYTHON=str(stubs / "python"), RECORD=str(tmp_path / "record"), PRECISION="fp8")
    result = subprocess.run(["bash", str(EXAMPLES / "smoke_1gpu.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "PRECISION must be bf16 or fp16, not 'fp8'" in result.stderr


def test_roundtrip_dry_run_without_nvidia_smi(dry_runs):
    got = dry_run_report(dry_runs, "roundtrip")

    assert got["ranks"] == "8 (nccl, one per GPU)"  # no nvidia-smi to count GPUs: a node of 8
    assert (
        "-m torch.distributed.run --standalone --nproc-per-node 8 -m megatron_ext.tooling.roundtrip" in got["command"]
    )
    assert (got["tokens"], got["hidden"], got["experts"], got["topk"]) == ("4096", "4096", "64", "8")


def test_roundtrip_command(stubs, tmp_path):
    _, argv = recorded_command(stubs, tmp_path, "roundtrip_torchrun.sh", GPUS="2", TOPK="2")

    assert argv == [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "megatron_ext.tooling.roundtrip", "--backend", "nccl"),
        *("--tokens", "4096", "--hidden", "4096", "--experts", "64", "--topk", "2"),
    ]


def test_roundtrip_without_nvidia_smi_asks_for_gpus(no_gpu_tools):
    env = script_env(PYTHON="/nonexistent/python") | {"PATH": no_gpu_tools}
    result = subprocess.run(
        [shutil.which("bash"), str(EXAMPLES / "roundtrip_torchrun.sh")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2 and "nvidia-smi not found: set GPUS" in result.stderr, result.stderr


def test_dry_run_refuses_a_capacity_factor_below_one(dry_runs):
    result = dry_runs["invalid"]

    assert result.returncode == 2, result.stderr[-3000:]
    # The one line, not Megatron's usage block of some 745 lines before it.
    assert result.stderr.startswith("pretrain_moe.py: error: --moe-hybridep-capacity-factor 0.5 would drop tokens")
    assert "usage:" not in result.stderr
    assert "megatron-ext dry run:" not in result.stdout


def test_dry_run_names_the_flags_a_run_needs(dry_runs):
    result = dry_runs["incomplete"]

    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("pretrain_moe.py: error: set --micro-batch-size N"), result.stderr[-3000:]
    assert "--eval-interval N" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "name, message, fix",
    [
        (
            # The run's layer build refuses it (GroupedMLP._check_config): the dry run calls that check.
            "ep8-etp-blocking",
            "megatron_ext GroupedMLP, the experts this layer spec names, does not support expert tensor "
            "parallelism (`--expert-tensor-parallel-size`)",
            "set it to 1",
        ),
        (
            "ep8-etp",
            "--moe-hybridep-capacity-factor with --expert-tensor-parallel-size 2: capacity mode's experts are not "
            "split by tensor parallelism",
            "Pass --expert-tensor-parallel-size 1",
        ),
        (
            # The script sets --expert-model-parallel-size 8; the user added the pipeline: both are named.
            "ep8-pp2",
            "--pipeline-model-parallel-size 2 x --expert-model-parallel-size 8 x --expert-tensor-parallel-size 1 = 16 "
            "ranks for each pipeline stage's experts, but the world size is 8",
            "Lower one of these sizes, or run on a multiple of 16 ranks",
        ),
        (
            "ep8-cp2",
            "--moe-hybridep-capacity-factor with --context-parallel-size 2: megatron-ext has not run or tested",
            "Use --context-parallel-size 1",
        ),
        ("smoke-topk0", "--moe-router-topk 0: each token goes to between 1 and --num-experts (8)", "use a top-k"),
        (
            # Megatron's parser would print its usage (some 725 lines) before argparse's error.
            "smoke-typo",
            "unrecognized arguments: --moe-hybridep-capcity-factor 1.5",
            "(did you mean --moe-hybridep-capacity-factor?)",
        ),
    ],
)
def test_dry_run_refuses_what_the_run_would_refuse(dry_runs, name, message, fix):
    result = dry_runs[name]

    assert result.returncode == 2, result.stderr[-3000:]
    *remarks, refusal = result.stderr.splitlines()
    assert refusal.startswith(f"pretrain_moe.py: error: {message}"), result.stderr[-3000:]
    assert fix in refusal
    # Before the refusal, at most Megatron's one-line remarks on the flags (64 experts without fp32 routing).
    assert all(line.startswith("pretrain_moe.py: Megatron: ") for line in remarks), result.stderr[-3000:]
    assert "megatron-ext dry run:" not in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("script", ["smoke_1gpu.sh", "ep8_single_node.sh", "pretrain_moe.py"])
def test_a_run_without_a_gpu_says_so_in_one_line(smoke_args, script):
    """Each rank failed in Megatron's first question to the GPU, two tracebacks inside torchrun's report."""
    if script == "pretrain_moe.py":
        command, name, dry_run = [sys.executable, str(PRETRAIN), *smoke_args], "pretrain_moe.py", DRY_RUN_FLAG
    else:
        command, name, dry_run = ["bash", str(EXAMPLES / script)], script, "DRY_RUN=1"
    result = subprocess.run(command, env=script_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=120)

    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"{name}: error: training needs a CUDA GPU and none is visible here; {dry_run}")
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]


def test_help_lists_the_dry_run_and_megatron_ext_flags(dry_runs):
    # Stock megatron-core 0.19.2 cannot print --help (a bare '%' in one of its help texts).
    result = dry_runs["help"]

    assert result.returncode == 0, result.stderr[-3000:]
    assert DRY_RUN_FLAG in result.stdout and FACTOR in result.stdout and EQUAL in result.stdout
    assert "--example-shift-routing-at" in result.stdout


@pytest.mark.parametrize(
    "script, env, launcher, world_size",
    [
        ("smoke_1gpu.sh", {}, ["--standalone", "--nproc-per-node", "1"], "1"),
        ("ep8_single_node.sh", {}, ["--standalone", "--nproc-per-node", "8"], "8"),
        ("ep8_single_node.sh", {"GPUS": "4"}, ["--standalone", "--nproc-per-node", "4"], "4"),
        (
            "slurm_multinode.sbatch",
            {**SLURM, "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(REPO)},
            ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-id", "42", "--rdzv-backend", "c10d"]
            + ["--rdzv-endpoint", "node01:29500"],
            "16",
        ),
    ],
    ids=["smoke", "ep8", "ep8-gpus4", "slurm"],
)
@pytest.mark.parametrize("mode", ["capacity", "blocking"])
def test_training_command_runs_the_dry_run_arguments(stubs, tmp_path, script, env, launcher, world_size, mode):
    _, train = recorded_command(stubs, tmp_path, script, MODE=mode, **env)
    dry_world_size, dry = recorded_command(stubs, tmp_path, script, MODE=mode, DRY_RUN="1", **env)

    assert train[: 2 + len(launcher)] == ["-m", "torch.distributed.run", *launcher]
    pretrain, *args = train[2 + len(launcher) :]
    # the sbatch script runs from the submission directory (REPO here), the others from anywhere
    assert (REPO / pretrain).resolve() == PRETRAIN
    assert dry == [pretrain, *args, DRY_RUN_FLAG]
    assert dry_world_size == world_size
    assert (FACTOR in args and EQUAL in args) == (mode == "capacity")
    assert REUSE in args


# ------------------------------------------------------------------ compare_modes.py

FAKE_TRAINING = r"""
# Prints Megatron's argument listing and iteration lines; capacity mode is 20 % faster; $DIFFER_AT
# changes one loss.
echo "------------------------ arguments ------------------------"
echo "  global_batch_size ............................... 2"
echo "  seq_length ...................................... 512"
echo "  world_size ...................................... 2"
echo "script arguments: $*"
for i in 1 2 3 4; do
  ms=100.0; [[ $MODE == capacity ]] && ms=80.0
  loss=5.12345${i}E+00; [[ $MODE == capacity && ${DIFFER_AT:-0} == $i ]] && loss=5.12346${i}E+00
  echo " [2026-11-29 10:00:0$i.000000] iteration        $i/       4 | consumed samples:            $((2*i)) |" \
    "elapsed time per iteration (ms): $ms | learning rate: 1.000000E-04 | global batch size:     2 |" \
    "lm loss: $loss | load_balancing_loss: 1.00${i}000E+00 | loss scale: 1.0 | grad norm: 3.14$i |" \
    "number of skipped iterations:   0 | number of nan iterations:   0 |"
done
exit ${EXIT_CODE:-0}
"""


def _compare(tmp_path, *options, **env):
    script = tmp_path / "fake.sh"
    script.write_text(FAKE_TRAINING)
    command = [sys.executable, str(EXAMPLES / "compare_modes.py"), "--script", str(script), "--skip-iters", "1"]
    command += ["--log-dir", str(tmp_path / "logs"), "--repeat", "2", *options, "--", "--train-iters", "4"]
    return subprocess.run(command, capture_output=True, text=True, env=script_env(**env), timeout=60)


def test_compare_modes_reports_identical_losses_and_the_step_time_ratio(tmp_path):
    result = _compare(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 iterations, 2 run(s) per mode" in result.stdout
    assert "capacity / blocking step time: 0.800" in result.stdout
    # 2 x 512 tokens per iteration over 2 GPUs: 512 per GPU in 100 and 80 ms
    assert "blocking: 100.0 ms per iteration, 5,120 tokens/s/GPU" in result.stdout
    assert "capacity: 80.0 ms per iteration, 6,400 tokens/s/GPU" in result.stdout
    assert "IDENTICAL" in result.stdout
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "blocking-1.log",
        "blocking-2.log",
        "capacity-1.log",
        "capacity-2.log",
    ]


def test_compare_modes_names_the_first_loss_that_differs(tmp_path):
    result = _compare(tmp_path, DIFFER_AT="3")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DIFFERS: capacity run 1: iteration 3: lm loss 5.123453E+00 against 5.123463E+00" in result.stdout


def test_compare_modes_fails_when_a_run_fails(tmp_path):
    result = _compare(tmp_path, EXIT_CODE="3")
    assert result.returncode == 1 and "FAILED: MODE=blocking exited 3" in result.stdout, result.stdout


def test_compare_modes_skewed_shifts_the_routing_in_both_modes(tmp_path):
    result = _compare(tmp_path, "--skewed", "3")
    assert result.returncode == 0 and "IDENTICAL" in result.stdout, result.stdout + result.stderr
    logs = sorted((tmp_path / "logs").iterdir())
    assert len(logs) == 4
    for log in logs:
        assert "script arguments: --train-iters 4 --example-shift-routing-at 3" in log.read_text(), log.name


def test_compare_modes_skewed_refuses_the_calibration_iteration(tmp_path):
    result = _compare(tmp_path, "--skewed", "1")
    assert result.returncode == 2 and "--skewed 1" in result.stderr, result.stderr


def test_the_routing_shift_raises_expert_0_from_its_iteration_on(example, monkeypatch):
    from types import SimpleNamespace

    args = SimpleNamespace(curr_iteration=0)
    monkeypatch.setattr(example, "get_args", lambda: args)
    seen = []
    routing = example._shifted(lambda logits, *rest: seen.append(logits.clone()) or logits, start=2, bias=0.3)
    logits = torch.randn(5, 4)
    for iteration in (1, 2, 3):
        args.curr_iteration = iteration
        routing(logits)
    assert torch.equal(seen[0], logits)
    for shifted in seen[1:]:
        assert torch.equal(shifted[:, 1:], logits[:, 1:])
        assert torch.equal(shifted[:, 0], logits[:, 0] + 0.3)


@pytest.mark.parametrize(
    "layers, present, absent",
    [
        ("te", ["transformer_engine"], ["--no-gradient-accumulation-fusion", "--no-rope-fusion"]),
        ("local", ["local", "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-persist-layer-norm"], []),
        # auto: the stand-in interpreter prints no "te" for TE's import, as a machine without TE.
        ("auto", ["local", "--no-gradient-accumulation-fusion"], ["transformer_engine"]),
    ],
)
def test_layers_choose_tes_layers_with_tes_fusions_or_local_ones_without(stubs, tmp_path, layers, present, absent):
    _, argv = recorded_command(stubs, tmp_path, "smoke_1gpu.sh", DRY_RUN="1", LAYERS=layers)
    impl = argv[argv.index("--transformer-impl") + 1]
    assert impl == present[0] and argv.count("--transformer-impl") == 1
    assert all(flag in argv for flag in present[1:]) and not any(flag in argv for flag in absent)


def test_graphs_full_passes_megatrons_parse(dry_runs):
    got = dry_run_report(dry_runs, "smoke-graphs-full")
    assert got["cuda graphs"] == "full_iteration" and got["capacity mode"] == "on"
    assert dry_run_report(dry_runs, "smoke")["cuda graphs"] == "none"  # GRAPHS=none by default


@pytest.mark.parametrize(
    "graphs, flags",
    [
        (None, []),
        ("none", []),
        ("te", ["--cuda-graph-impl", "transformer_engine", "--moe-hybridep-overflow-policy", "fail"]),
        ("full", ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]),
    ],
)
@pytest.mark.parametrize("script", ["smoke_1gpu.sh", "ep8_single_node.sh", "small_ep.sh"])
def test_graphs_adds_the_flags_of_capacity_modes_graphs(stubs, tmp_path, script, graphs, flags):
    env = {"GRAPHS": graphs} if graphs else {}
    _, argv = recorded_command(stubs, tmp_path, script, DRY_RUN="1", LAYERS="te", **env)
    graph_flags = [a for i, a in enumerate(argv) if a.startswith("--cuda-graph") or argv[i - 1] == "--cuda-graph-impl"]
    assert graph_flags == flags[:2], argv
    assert all(flag in argv for flag in flags)
    assert argv.count("--moe-hybridep-overflow-policy") == (graphs == "te")


@pytest.mark.parametrize(
    "script, env, message",
    [
        ("smoke_1gpu.sh", {"GRAPHS": "te", "LAYERS": "local"}, "GRAPHS=te needs Transformer Engine's layers"),
        ("smoke_1gpu.sh", {"GRAPHS": "full", "MODE": "blocking"}, "GRAPHS=full needs MODE=capacity"),
        ("smoke_1gpu.sh", {"GRAPHS": "te", "LAYERS": "te", "MODE": "stock"}, "GRAPHS=te needs MODE=capacity"),
        ("smoke_1gpu.sh", {"GRAPHS": "yes"}, "GRAPHS must be none, te or full, not 'yes'"),
        ("small_ep.sh", {"GRAPHS": "full", "RANKS_PER_GPU": "2"}, "GRAPHS=full needs one rank per GPU"),
    ],
)
def test_graphs_refuses_what_cannot_be_captured_in_one_line(stubs, tmp_path, script, env, message):
    env = script_env(PYTHON=str(stubs / "python"), RECORD=str(tmp_path / "r"), DRY_RUN="1", **env)
    result = subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert not (tmp_path / "r").exists() or "--megatron-ext-dry-run" not in (tmp_path / "r").read_text()


def test_layers_refuses_an_unknown_value_in_one_line(stubs, tmp_path):
    env = script_env(PYTHON=str(stubs / "python"), RECORD=str(tmp_path / "r"), DRY_RUN="1", LAYERS="apex")
    result = subprocess.run(["bash", str(EXAMPLES / "smoke_1gpu.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == "LAYERS must be te, local or auto, not 'apex'\n"


def test_example_experts_puts_megatron_ext_experts_in_tes_spec(example, monkeypatch):
    # TE's spec cannot be built without TE: the local spec with a stand-in for TE's experts takes its
    # place, as get_gpt_layer_with_transformer_engine_spec builds it (a partial of MoELayer).
    from types import SimpleNamespace

    from megatron.core.models.gpt import gpt_layer_specs

    class TEGroupedStandIn:
        pass

    def te_spec(**kwargs):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
        moe = spec.submodules.mlp
        spec.submodules.mlp = functools.partial(
            moe, submodules=dataclasses.replace(moe.keywords["submodules"], experts=TEGroupedStandIn)
        )
        return spec

    monkeypatch.setattr(example, "use_local_spec", lambda args: False)
    monkeypatch.setattr(example.gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    config = SimpleNamespace(num_moe_experts=8, moe_grouped_gemm=True, qk_layernorm=False)
    experts = {
        choice: example.layer_spec(SimpleNamespace(example_experts=choice), config)
        .submodules.mlp.keywords["submodules"]
        .experts
        for choice in ("spec", "megatron-ext")
    }
    assert experts["spec"] is TEGroupedStandIn and experts["megatron-ext"] is example.GroupedMLP
