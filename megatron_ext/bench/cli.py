"""`megatron-ext-bench`: every dispatch mode on the same Megatron MoE stack, checked and measured.

    megatron-ext-bench                        # one rank per GPU (NCCL); without a GPU, 4 CPU ranks (gloo)
    megatron-ext-bench --ranks-per-gpu 4      # 4 ranks sharing each GPU (gloo): expert parallelism rehearsed
    megatron-ext-bench --json out.json --plot out.png
    megatron-ext-bench --size mid --steps 10      # a named stack size (sizes.SIZES); a size flag overrides its field
    torchrun --nproc-per-node 8 -m megatron_ext.bench --size large

Exits 0 when every mode's outputs and gradients equal the blocking mode's (bitwise for
megatron-ext's torch modes; within a tolerance for stock Megatron and deep_ep, which sum in
another order); 1, naming the mode, when one differs or fails, and 1 when no mode besides blocking
ran (every other one skipped, saying why: nothing was compared); 2 on bad arguments.

The table shows the most used columns in 120 characters; `--wide` every column, `--explain` what
each means (docs/bench.md too), `--json` every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import textwrap
import time
import traceback
import warnings

import torch

import megatron_ext
from megatron_ext.bench.modes import BLOCKING, FP8_REFERENCE, REFERENCES, all_modes, mode_names, select
from megatron_ext.bench.report import WIDTH
from megatron_ext.bench.sizes import DEFAULT_SIZE, SIZES, SizedParser, Sizes, describe_size, least_bytes
from megatron_ext.bench.stack import DTYPES
from megatron_ext.logs import log_with_rank_prefix
from megatron_ext.options import FP8_RECIPES, STATIC_SPLITS_FP8_RECIPES, can_make_files_in, capacity_factor_argument
from megatron_ext.tooling.ranks import Placement, run_on_ranks, this_rank, under_torchrun


def parser() -> argparse.ArgumentParser:
    p = SizedParser(
        prog="megatron-ext-bench",
        description="Run every dispatch mode on one stack of Megatron-Core MoE layers: check the results "
        "against the blocking mode, count host syncs and bytes, time the steps.",
        epilog="Modes: " + ", ".join(m.name for m in all_modes(1.5)) + " (deep_ep ones where deep_ep imports, "
        "+te ones on a GPU with Transformer Engine, +graph ones on a GPU).",
    )
    size = p.add_argument_group("the MoE stack (the same in every mode)")
    size.add_argument(
        "--size",
        choices=tuple(SIZES),
        default=None,
        help="a named stack: "
        + "; ".join(f"{name}: {describe_size(fields)}" for name, fields in SIZES.items())
        + ". A size flag given with it overrides that field (default: the defaults below)",
    )
    d = DEFAULT_SIZE  # the defaults are filled in after parsing (SizedParser), so --size can set them
    size.add_argument("--layers", type=int, help=f"MoE layers, each on the same input (default {d['layers']})")
    size.add_argument("--tokens", type=int, help=f"tokens per rank (default {d['tokens']})")
    size.add_argument("--hidden", type=int, help=f"hidden size (default {d['hidden']})")
    size.add_argument("--ffn-hidden", type=int, help=f"each expert's FFN hidden size (default {d['ffn_hidden']})")
    size.add_argument("--experts", type=int, help=f"experts in all; divisible by the ranks (default {d['experts']})")
    size.add_argument("--topk", type=int, help=f"experts per token (default {d['topk']})")
    size.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on GPUs, fp32 on CPU (default)"
    )
    size.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="routing skew: add SKEW x a fixed +-1 vector to every token, so the router favours the experts "
        "aligned with it (0: balanced on average; 1: the shift is as large as the tokens' spread)",
    )
    size.add_argument(
        "--capacity-factor",
        type=capacity_factor_argument,
        default=1.5,
        help="--moe-hybridep-capacity-factor of capacity modes (1.5)",
    )
    size.add_argument(
        "--deep-ep-num-sms",
        type=int,
        default=None,
        help="--moe-flex-dispatcher-num-sms of every mode: the SMs deep_ep's dispatch and combine take "
        "(Megatron's manager and megatron-ext's alike; the torch implementation has no such setting). "
        "Default: deep_ep's own",
    )
    run = p.add_argument_group("the run")
    run.add_argument("--modes", default=None, help="comma-separated modes to run (blocking always runs); default all")
    run.add_argument(
        "--fp8-recipe",
        choices=STATIC_SPLITS_FP8_RECIPES,
        default=None,
        help=f"add the fp8 modes ({FP8_REFERENCE}, capacity+equal+te+fp8 with TE's op-fuser experts for "
        f"{' or '.join(FP8_RECIPES)}, capacity+equal+static+te+fp8 with TEGroupedMLP and static expert splits; "
        "e4m3, this recipe; GPU with Transformer Engine)",
    )
    run.add_argument("--steps", type=int, default=5, help="timed steps per mode (default 5)")
    run.add_argument("--check-steps", type=int, default=2, help="steps compared with blocking, per mode (default 2)")
    run.add_argument("--warmup", type=int, default=1, help="untimed steps per mode before counting (default 1)")
    run.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="forward and backward passes per step on the step's input, the gradients accumulated, as in "
        "gradient accumulation (the first marked as Megatron marks a step's first micro-batch, so TE's layers "
        "may keep their fp8 weight casts for the others); every count and time is per step (default 1)",
    )
    run.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds: run every mode in turn this many times and report the spread of the rounds' medians (default 1)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda where available")
    run.add_argument(
        "--world-size", type=int, default=None, help="ranks to spawn (default: GPUs x --ranks-per-gpu, or 4 on CPU)"
    )
    run.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="ranks sharing each GPU (default 1: one NCCL rank per GPU). More runs the ranks on gloo with CUDA "
        "tensors, staged through host memory: every GPU kernel and layout of that many expert-parallel ranks on "
        "fewer GPUs, its times not performance figures, no CUDA graph modes (gloo cannot be captured)",
    )
    run.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait (default 300)")
    run.add_argument("--runahead-sleep-ms", type=float, default=300.0, help="GPU sleep of the run-ahead probe")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every number (per rank too) as JSON")
    out.add_argument("--plot", metavar="PATH", help="write a PNG of step time and host syncs per mode (matplotlib)")
    out.add_argument(
        "--wide",
        action="store_true",
        help=f"every column (GPU ms, dispatch host time, bytes sent, ...), not just the most used ones that fit "
        f"{WIDTH} characters",
    )
    out.add_argument("--explain", action="store_true", help="print what each column means (docs/bench.md has it too)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--verbose", action="store_true", help="megatron-ext's log (patching, calibration) on stderr")
    return p


def parse(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    args.device = "cuda" if cuda else "cpu"
    if args.ranks_per_gpu < 1:
        p.error("--ranks-per-gpu must be at least 1")
    if args.ranks_per_gpu > 1 and not cuda:
        p.error(f"--ranks-per-gpu {args.ranks_per_gpu}: ranks share GPUs, and no CUDA device is in use (--device)")
    args.placement = Placement(args.device, args.ranks_per_gpu)
    if args.dtype == "auto":
        args.dtype = "bf16" if cuda else "fp32"
    if args.dtype == "fp16" and not cuda:
        p.error("--dtype fp16 needs a GPU; use fp32 or bf16 on CPU")
    torchrun = under_torchrun()
    if torchrun:
        args.world_size = int(os.environ["WORLD_SIZE"])
    elif args.world_size is None:
        args.world_size = torch.cuda.device_count() * args.ranks_per_gpu if cuda else 4
    problem = None if torchrun else args.placement.check(args.world_size, torch.cuda.device_count() if cuda else 0)
    if problem is not None:
        p.error(f"--world-size {args.world_size}: {problem}; raise --ranks-per-gpu or lower --world-size")
    for name in (
        "layers", "tokens", "hidden", "ffn_hidden", "experts", "steps", "check_steps", "world_size", "repeat",
        "micro_batches",
    ):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.deep_ep_num_sms is not None and args.deep_ep_num_sms < 1:
        p.error("--deep-ep-num-sms must be at least 1 (leave it out for deep_ep's default)")
    if not math.isfinite(args.skew):
        p.error(f"--skew {args.skew}: use a finite number (0 balances the routing, 1 skews it strongly)")
    if not 1 <= args.topk <= args.experts:
        p.error(f"--topk {args.topk} must be between 1 and --experts ({args.experts})")
    if args.experts % args.world_size:
        p.error(f"--experts {args.experts} must be divisible by the {args.world_size} ranks (one EP group)")
    names = mode_names(args.modes)
    if args.modes is not None and not names:
        p.error(f"--modes {args.modes!r} names no mode; give comma-separated names (--help lists them)")
    try:
        args.selected = select(names, args.capacity_factor, args.fp8_recipe)
    except ValueError as error:
        p.error(str(error))
    if names:  # a mode named that cannot run here: refused now, not skipped after the others ran
        from megatron_ext.bench.run import unavailable

        named = tuple(m for m in args.selected if m.name in names)
        gloo = args.world_size > 1 and args.placement.backend != "nccl"
        cannot = unavailable(named, args, args.world_size, cuda=cuda, gloo=gloo)
        if cannot:
            name, why = next(iter(cannot.items()))
            p.error(f"--modes {name}: cannot run here: {why}; leave it out (without --modes, such modes are skipped)")
        if all(m.name in REFERENCES for m in args.selected):
            p.error(
                f"--modes {args.modes}: {' and '.join(m.name for m in args.selected)} alone compares nothing (the "
                "other modes are checked against it); name a mode to check, such as capacity+equal"
            )
    if args.plot:
        _check_plot_format(p, args.plot)
    if not cuda:
        _check_host_memory(p, args)
    _check_outputs(p, args)
    return args


def _check_plot_format(p: argparse.ArgumentParser, path: str) -> None:
    """--plot: matplotlib importable, and a suffix it writes (it picks the format by the suffix, and
    adds .png to a name without one, so the file would not be where the run says it wrote it)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        p.error("--plot needs matplotlib: pip install 'megatron-ext[plot]'")
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in formats:
        what = f"a .{suffix} file" if suffix else "a file without a suffix"
        p.error(
            f"--plot {path}: matplotlib cannot write {what}; end the name in .png (or .{', .'.join(sorted(formats))})"
        )


def _check_outputs(p: argparse.ArgumentParser, args) -> None:
    """--json and --plot, before the run, not after it: each a file that can be written, and not the same."""
    paths = {option: getattr(args, option) for option in ("json", "plot") if getattr(args, option) is not None}
    for option, path in paths.items():
        problem = _unwritable(path)
        if problem is not None:
            p.error(f"--{option} {path}: {problem}")
    if len(paths) == 2 and os.path.realpath(paths["json"]) == os.path.realpath(paths["plot"]):
        p.error(f"--plot {args.plot}: --json {args.json} writes there too; give each output its own file")


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at `path`, or None when it can (an existing file stays untouched)."""
    if os.path.isdir(path):
        return "is a folder; give a file name (in it, or anywhere writable)"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "cannot write there (the file is read-only)"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write there (its folder {folder} does not exist)"
    if not can_make_files_in(folder):
        return f"cannot write there (no file can be made in its folder {folder})"
    return None


def _available_bytes() -> int | None:
    """The memory this machine can still give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_host_memory(p: argparse.ArgumentParser, args) -> None:
    """Refuse before starting a stack the CPU ranks cannot hold (the kernel would kill a rank
    some way into the run, SIGKILL and nothing more)."""
    available = _available_bytes()
    dtype_bytes = 2 if args.dtype in ("bf16", "fp16") else 4
    capacity = any(m.overrides.get("moe_hybridep_capacity_factor") for m in args.selected)
    factor = args.capacity_factor if capacity else 1.0  # a capacity mode's layers hold factor x their rows
    needed = least_bytes(vars(args), args.world_size, dtype_bytes, factor)
    if available is None or needed <= available:
        return
    stack = f"--size {args.size}" if args.size else "this stack"
    factor_alone = least_bytes(vars(args), args.world_size, dtype_bytes) <= available  # fits at a factor of 1
    lower = ", or a lower --capacity-factor" if factor_alone else ""
    p.error(
        f"{stack} on {args.world_size} CPU ranks needs at least {needed / 2**30:.0f} GiB of memory (the expert "
        f"weights and gradients, each rank's activations), and {available / 2**30:.0f} GiB is available here; "
        f"run it on GPUs, or on CPU a smaller --size (small) or fewer --layers, --tokens or --world-size{lower}"
    )


def sizes_of(args) -> Sizes:
    return Sizes(
        layers=args.layers,
        tokens=args.tokens,
        hidden=args.hidden,
        ffn_hidden=args.ffn_hidden,
        experts=args.experts,
        topk=args.topk,
        dtype=args.dtype,
        skew=args.skew,
        capacity_factor=args.capacity_factor,
        steps=args.steps,
        check_steps=args.check_steps,
        warmup=args.warmup,
        seed=args.seed,
        runahead_sleep_ms=args.runahead_sleep_ms,
        repeat=args.repeat,
        deep_ep_num_sms=args.deep_ep_num_sms,
        micro_batches=getattr(args, "micro_batches", 1),
        size=getattr(args, "size", None),
    )


def _machine(args, world_size: int) -> str:
    return args.placement.describe(world_size)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"megatron-ext": megatron_ext.__version__}
    for package in ("megatron-core", "torch"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


# ---------------------------------------------------------------------------------- one rank


def _quiet(verbose: bool, rank: int) -> None:
    """Megatron's import-time warnings (no TE, no apex; no CUDA toolkit on CPU) say nothing about the
    bench. With --verbose, megatron-ext's log on stderr, each line prefixed with its rank (lines
    that every rank would say alike come from the first rank only: `megatron_ext.logs`)."""
    if verbose:
        log_with_rank_prefix(rank)
        return
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # The package's logger: every megatron_ext module logs to a child of it (`getLogger(__name__)`).
    logging.getLogger(megatron_ext.__name__).setLevel(logging.WARNING)


def _rank_main(rank: int, world_size: int, args, failure_dir: str) -> bool:
    """Everything one rank does once its process group is up; True when every mode passed."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_ext.patches
    from megatron_ext.bench import report
    from megatron_ext.bench.run import run_modes

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        from megatron_ext.tooling.cpu_ranks import use_cpu_ranks

        use_cpu_ranks()
        torch.set_num_threads(1)  # one thread per rank: ranks share the cores
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(args.seed)
    applied = megatron_ext.patches.apply(training=False)  # no training loop here
    sizes = sizes_of(args)
    show = rank == 0 and not args.no_progress
    # On a terminal a progress bar; into a log one line per mode, so a run stopped from outside
    # still says which mode it had reached.
    bar = _progress(show and sys.stderr.isatty(), sizes.steps_per_mode * len(args.selected) * sizes.repeat)
    current = {"mode": None}
    started = time.monotonic()

    def starting(mode_name: str) -> None:
        current["mode"] = mode_name
        bar.set_description(mode_name)
        if show and not sys.stderr.isatty():
            print(
                f"megatron-ext-bench: {mode_name} (at {time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True
            )

    try:
        results, facts = run_modes(sizes, args.selected, device, progress=lambda: bar.update(1), starting=starting)
        results = {r.name: r for r in results}
    except Exception as error:  # a failing rank leaves the others in a collective: say why, then stop
        with open(os.path.join(failure_dir, f"rank{rank}"), "w") as f:
            json.dump(dict(rank=rank, mode=current["mode"], error=f"{type(error).__name__}: {error}"), f)
        traceback.print_exc()
        raise
    finally:
        bar.close()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {name: r.to_dict() for name, r in results.items()})
    rows = [report.aggregate(mode, [ranks[mode.name] for ranks in gathered]) for mode in args.selected]
    report.add_ratios(rows)
    problems = report.failures(rows)
    nothing = report.nothing_compared(rows)  # every other mode skipped: the run checked nothing
    if nothing is not None:
        problems.append(nothing)
    if rank == 0:
        _print_report(args, sizes, world_size, rows, facts, problems)
    megatron_ext.patches.revert(applied)
    parallel_state.destroy_model_parallel()
    return not problems


def _progress(enabled: bool, total: int):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit="step", leave=False)


def _print_report(args, sizes, world_size, rows, facts, problems) -> None:
    from megatron_ext.bench import report

    cuda = args.device == "cuda"
    load = facts.get("expert_load_max_over_mean")
    named = f"size {sizes.size}: " if sizes.size else ""
    title = (
        f"megatron-ext-bench: {_machine(args, world_size)}; {named}{sizes.layers} MoE layers (summed), "
        f"T {sizes.tokens}/rank, "
        f"H {sizes.hidden}, FFN {sizes.ffn_hidden}, E {sizes.experts}, top-{sizes.topk}, {sizes.dtype}, "
        f"skew {sizes.skew:g}, capacity factor {sizes.capacity_factor:g}"
    )
    _say(title)
    if load is not None:
        print(f"routing: busiest expert holds {load:.2f}x the mean (layer 1, first step)")
    rounds = f", in each of {sizes.repeat} rounds" if sizes.repeat > 1 else ""
    if sizes.micro_batches > 1:
        rounds = f", each step {sizes.micro_batches} micro-batches{rounds}"
    _say(
        f"per mode: {sizes.check_steps} checked + {sizes.warmup} warm-up + 1 counted + {sizes.steps} timed "
        f"steps on the same inputs and weights{rounds}"
    )
    print()
    note = report.speed_note(args.placement)
    if note:
        print(note)
    print(report.table(rows, cuda, wide=args.wide))
    for line in report.skipped_lines(rows):
        print(line)
    print()
    print(report.legend(rows, cuda, sizes) if args.explain else report.hint(rows, cuda, wide=args.wide))
    print()
    nothing = report.nothing_compared(rows)
    if problems:
        for problem in problems:
            print(f"FAILED: {problem}" if problem == nothing else f"FAILED {problem}")
    else:
        kinds = {r["name"]: r["equal_to_blocking"] for r in rows if r["status"] == "ok"}
        bitwise = [n for n, k in kinds.items() if k == "bitwise" and n != "blocking"]
        close = [n for n, k in kinds.items() if k == "close"]
        said = [f"bitwise for {', '.join(bitwise)}"] if bitwise else []
        said += [f"within tolerance for {', '.join(close)}"] if close else []
        against = sorted(
            f"{r['name']} against {r['checked_against']}"
            for r in rows
            if r.get("checked_against", BLOCKING) != BLOCKING and r["name"] in kinds
        )
        also = f" ({'; '.join(against)})" if against else ""
        _say("OK: outputs and gradients equal blocking's: " + "; ".join(said) + also)
    if args.json:
        report.write_json(
            args.json,
            dict(
                machine=_machine(args, world_size),
                world_size=world_size,
                device=args.device,
                ranks_per_gpu=args.ranks_per_gpu,
                backend=args.placement.backend,
                speed_figures=not report.speed_note(args.placement),
                versions=_versions(),
                sizes=sizes.__dict__,
                facts=facts,
                modes=rows,
                ok=not problems,
                failures=problems,
            ),
        )
        print(f"wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, rows, title, note=report.speed_note(args.placement))
        print(f"wrote {args.plot}")


def _say(text: str) -> None:
    """`text` wrapped to the table's width (mode names kept whole)."""
    print(textwrap.fill(text, WIDTH, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False))


# ---------------------------------------------------------------------------------- launching


def _rank(rank: int, world_size: int, args, failure_dir: str, status_file: str) -> None:
    _quiet(args.verbose, rank)
    ok = _rank_main(rank, world_size, args, failure_dir)
    if rank == this_rank():  # the rank that answers for this process: rank 0, or each under torchrun
        with open(status_file, "w") as f:
            f.write("ok" if ok else "failed")


def _failure_summary(failure_dir: str) -> list[str]:
    lines = []
    for name in sorted(os.listdir(failure_dir)):
        with open(os.path.join(failure_dir, name)) as f:
            failure = json.load(f)
        lines.append(f"FAILED mode {failure['mode']} on rank {failure['rank']}: {failure['error']}")
    return lines


def _killed(error: Exception) -> str:
    """What a rank that died of SIGKILL (no Python error of its own) most likely met."""
    if "SIGKILL" not in str(error):
        return ""
    return " (most likely the system's out-of-memory killer: a rank ran out of memory; try a smaller stack)"


def main(argv=None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        failure_dir = os.path.join(tmp, "failures")
        os.mkdir(failure_dir)
        status = os.path.join(tmp, "status")
        try:
            run_on_ranks(
                _rank, args.world_size, args, failure_dir, status, where=args.placement, timeout_s=args.timeout
            )
        except Exception as error:  # a rank failed (spawned: the others were stopped)
            lines = _failure_summary(failure_dir) or [f"FAILED: a rank stopped: {error}{_killed(error)}"]
            print("\n".join(lines), file=sys.stderr)
            return 1
        ok = os.path.exists(status) and open(status).read() == "ok"
    return 0 if ok else 1
