#!/usr/bin/env python3
"""Train the same example twice, MODE=blocking and MODE=capacity, and compare what Megatron logged.

    python examples/compare_modes.py -- --train-iters 300             # smoke_1gpu.sh, one GPU
    python examples/compare_modes.py --script examples/ep8_single_node.sh --repeat 2 -- --train-iters 200
    python examples/compare_modes.py --skewed 50 -- --train-iters 100   # routing shifted at iteration 50

Each run's log goes to --log-dir. Per iteration, the lm loss, load-balancing loss and grad norm
must be identical as printed in both modes (capacity mode computes what blocking computes);
the step time is Megatron's "elapsed time per iteration", median over the iterations after
--skip-iters. With --repeat N the modes alternate (blocking, capacity, blocking, ...), so drift in
the machine's speed reaches both, and every run must log the same values.

Exits 0 when every run finished and every logged value matches; 1 otherwise, naming the first
iteration and value that differ; 2 on bad arguments.

With --skewed ITER both modes push every router towards expert 0 from iteration ITER on, as a
drifting router would after capacity mode learned its capacities: where an expert-parallel rank
then receives more rows than its capacity, Megatron's training loop re-runs the step blocking
(`--moe-hybridep-overflow-policy rerun`) and the log must still match blocking's at every
iteration. (On one GPU a rank receives every row whatever the routing: nothing overflows.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_ext.tooling.train_logs import COMPARED, first_difference, parse_log, step_ms, tokens_per_step_and_gpus

HERE = Path(__file__).resolve().parent
MODES = ("blocking", "capacity")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--script", default=str(HERE / "smoke_1gpu.sh"), help="the launch script (default smoke_1gpu.sh)")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode, alternating (default 1)")
    p.add_argument("--skip-iters", type=int, default=10, help="iterations left out of the step time (default 10)")
    p.add_argument("--log-dir", default="compare-logs", help="where each run's log goes (default ./compare-logs)")
    p.add_argument(
        "--skewed",
        type=int,
        default=None,
        metavar="ITER",
        help="the skewed variant: both modes shift every router towards expert 0 from iteration ITER on "
        "(pretrain_moe.py --example-shift-routing-at ITER), after capacity mode learned its capacities; "
        "the logged values must still match",
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: arguments for the script")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.repeat < 1 or args.skip_iters < 0:
        p.error("--repeat must be at least 1 and --skip-iters at least 0")
    if args.skewed is not None:
        if args.skewed < 2:
            p.error(f"--skewed {args.skewed}: shift after the first iteration (which learns the capacities): 2 or more")
        extra = [*extra, "--example-shift-routing-at", str(args.skewed)]
    if not os.path.isfile(args.script):
        p.error(f"--script {args.script}: no such file")
    os.makedirs(args.log_dir, exist_ok=True)

    runs = []  # (mode, parsed log)
    shape = None  # (tokens per step, GPUs) from the first run's argument listing
    for attempt in range(args.repeat):
        for mode in MODES:
            log = Path(args.log_dir) / f"{mode}-{attempt + 1}.log"
            print(f"MODE={mode} bash {args.script} {' '.join(extra)}  > {log}", flush=True)
            with open(log, "w") as out:
                command = ["bash", args.script, *extra]
                code = subprocess.call(command, env={**os.environ, "MODE": mode}, stdout=out, stderr=subprocess.STDOUT)
            parsed = parse_log(log.read_text())
            if code != 0 or not parsed:
                print(f"FAILED: MODE={mode} exited {code} after {len(parsed)} logged iterations; see {log}")
                return 1
            runs.append((mode, parsed))
            shape = shape or tokens_per_step_and_gpus(log.read_text())

    reference = runs[0][1]
    print(f"\n{len(reference)} iterations, {args.repeat} run(s) per mode; compared: {', '.join(COMPARED)}")
    problems = []
    for i, (mode, log) in enumerate(runs):
        if diff := first_difference(reference, log):
            problems.append(f"{mode} run {i // 2 + 1}: {diff}")
    medians = {mode: [] for mode in MODES}
    for mode, log in runs:
        medians[mode].append(statistics.median(step_ms(log, args.skip_iters) or [float("nan")]))
    for mode in MODES:
        values = medians[mode]
        spread = f" (runs: {', '.join(f'{v:.1f}' for v in values)})" if len(values) > 1 else ""
        median = statistics.median(values)
        rate = f", {shape[0] / (median / 1e3) / shape[1]:,.0f} tokens/s/GPU" if shape else ""
        print(f"{mode:>9}: {median:.1f} ms per iteration{rate}, median after iteration {args.skip_iters}{spread}")
    ratio = statistics.median(medians["capacity"]) / statistics.median(medians["blocking"])
    print(f"capacity / blocking step time: {ratio:.3f}")
    last = reference[max(reference)]
    print("last iteration: " + ", ".join(f"{k} {last.get(k)}" for k in COMPARED))
    if problems:
        for problem in problems:
            print(f"DIFFERS: {problem}")
        return 1
    print("IDENTICAL: every logged " + ", ".join(COMPARED) + " matches in every run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
