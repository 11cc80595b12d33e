"""Which shapes deep_ep.HybridEPBuffer's constructor takes, raises on, or aborts the process on
(one H200, one NCCL rank). Run from the repository root on the GPU machine:
`PYTHONPATH=$PWD:/tmp/site python3 docs/results/h200-2026-12-01/deep_ep_shapes.py` (CUDA_HOME,
HYBRID_EP_CACHE_DIR set); `--dry-run` tests the driver on a CPU machine with fake children.

Each shape runs in its own subprocess (its own NCCL rank: RANK=0, WORLD_SIZE=1, a MASTER_PORT of
its own), 8 at a time, 60 s each, under `stdbuf -o0 -e0` with stderr merged into stdout, so a
C/C++ message printed just before an abort() is kept. Only the constructor runs (no dispatch, so
no JIT compile). One line per shape: the shape, what the source reading predicts, the outcome
(ok, a Python exception, a signal, a timeout) and the last 3 non-empty lines of its output. A
`diag` child also reports the facts the prediction rests on: whether HybridEP's allocator can take
the fabric path and what cudaMalloc(0) returns. With $OUT set, each child's full output is kept
under $OUT/deep_ep_shapes/.

What the prediction reads from DeepEP's hybrid-ep source (commit 94a9f8f):
- config.cuh Configurer: T is raised to max(T, 512), rounded up to 64 (so T below 512 changes
  nothing); BufferConfig::is_valid throws std::runtime_error (a Python RuntimeError) for a hidden
  size not a multiple of 16 (512 with fp8) or local experts x ranks per node not a multiple of 4.
- intranode.cu allocate_dispatch_buffers: the fp8 scaling-factor buffer is always allocated, with
  max_tokens x (hidden / 128) floats, i.e. 0 bytes for hidden < 128; without fabric memory that is
  cudaMalloc(0) (a null pointer), and get_handle on it (allocator.cu, CU_CHECK of
  cuMemGetAddressRange, then cudaIpcGetMemHandle) calls abort().
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

JOBS = 8
TIMEOUT_S = 60

# (hidden, tokens per rank, local experts, enable_custom_allgather, use_fp8, extra env)
GRID = [
    (16, 32, 8, False, False, {}),  # the failing test's shape (tests/test_recovery.py: [32, 1, 16])
    (16, 32, 8, True, False, {}),  # the same with the persistent all-gather
    (16, 32, 8, False, False, {"USE_MNNVL": "0"}),  # allocator forced off the fabric path
    (16, 8, 8, False, False, {}),
    (16, 512, 8, False, False, {}),
    (32, 32, 8, False, False, {}),
    (64, 64, 8, False, False, {}),
    (96, 128, 8, False, False, {}),
    (112, 512, 8, False, False, {}),  # the largest multiple of 16 below 128
    (128, 1, 8, False, False, {}),  # the boundary: hidden / 128 == 1
    (128, 32, 8, False, False, {}),
    (128, 32, 8, True, False, {}),
    (128, 256, 8, False, False, {}),
    (144, 32, 8, False, False, {}),
    (512, 32, 8, False, False, {}),
    (512, 512, 16, False, False, {}),  # a shape known to work
    (2048, 4096, 32, True, False, {}),  # a shape known to work
    (8, 32, 8, False, False, {}),  # hidden not a multiple of 16
    (120, 32, 8, False, False, {}),  # hidden not a multiple of 16
    (128, 32, 6, False, False, {}),  # local experts x ranks not a multiple of 4
    (128, 32, 8, False, True, {}),  # fp8 wants hidden % 512 == 0
    (512, 32, 8, False, True, {}),
]


def predict(hidden: int, tokens: int, experts: int, fp8: bool) -> str:
    """What the source reading says, for one rank on one node on the non-fabric allocator."""
    if hidden % (512 if fp8 else 16) or experts % 4:
        return "exception"
    if hidden < 128:
        return "abort"
    return "ok"


def label(shape) -> str:
    hidden, tokens, experts, ag, fp8, env = shape
    text = f"h{hidden} T{tokens} E{experts} ag={int(ag)} fp8={int(fp8)}"
    return text + "".join(f" {k}={v}" for k, v in env.items())


# ----------------------------------------------------------------------------- child (one shape)
def child(spec: dict) -> int:
    if spec.get("fake"):  # --dry-run: act out the prediction without torch
        print(f"fake child for {spec}", flush=True)
        outcome = predict(spec["hidden"], spec["tokens"], spec["experts"], spec["fp8"])
        if outcome == "abort":
            sys.stderr.write("CU error encountered at: fake message before abort()\n")
            os.abort()
        if outcome == "exception":
            print("EXCEPTION RuntimeError: fake", flush=True)
            return 3
        if spec["hidden"] == 2048:
            time.sleep(spec["sleep"])  # long enough to test the timeout when asked
        print("OK fake", flush=True)
        return 0

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    import deep_ep
    import hybrid_ep_cpp

    try:
        conf = hybrid_ep_cpp.Configurer(
            hidden_dim=spec["hidden"],
            max_num_of_tokens_per_rank=spec["tokens"],
            num_local_experts=spec["experts"],
            num_of_ranks_per_node=1,
            num_of_nodes=1,
            use_fp8=spec["fp8"],
        ).buffer_config
        sf_bytes = conf.max_num_of_tokens_per_rank * (conf.hidden_dim // 128) * 4
        print(
            f"config T->{conf.max_num_of_tokens_per_rank} hidden={conf.hidden_dim} scaling-factor bytes={sf_bytes}",
            flush=True,
        )
    except Exception as error:  # the constructor below raises it again
        print(f"configurer {type(error).__name__}: {error}", flush=True)
    try:
        start = time.time()
        buffer = deep_ep.HybridEPBuffer(
            group=dist.group.WORLD,
            hidden_dim=spec["hidden"],
            max_num_of_tokens_per_rank=spec["tokens"],
            num_local_experts=spec["experts"],
            use_fp8=spec["fp8"],
            enable_custom_allgather=spec["ag"],
        )
        torch.cuda.synchronize()
        print(f"OK constructed in {time.time() - start:.1f} s", flush=True)
        del buffer
    except Exception as error:
        print(f"EXCEPTION {type(error).__name__}: {str(error).strip()[:200]}", flush=True)
        return 3
    finally:
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return 0


def diag() -> int:
    """The allocator's path (fabric or cudaMalloc) and what cudaMalloc(0) gives: three lines."""
    if os.environ.get("DEEP_EP_SHAPES_FAKE"):
        print("fake diag\nfabric: n/a\ncudaMalloc(0): n/a")
        return 0
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the primary context, current
    try:
        from cuda.bindings import driver, runtime
    except Exception as error:
        print(f"no cuda.bindings: {error}")
        return 0
    try:
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
        err, supported = driver.cuDeviceGetAttribute(attr, 0)
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        gerr, gran = driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        created = "skipped"
        if supported and gerr == driver.CUresult.CUDA_SUCCESS:
            cerr, handle = driver.cuMemCreate(gran, prop, 0)
            created = cerr.name
            if cerr == driver.CUresult.CUDA_SUCCESS:
                driver.cuMemRelease(handle)
        print(
            f"fabric attribute={supported} ({err.name}), granularity {gran} ({gerr.name}), "
            f"fabric cuMemCreate: {created}"
        )
    except Exception as error:
        print(f"fabric probe failed: {type(error).__name__}: {error}")
    try:
        merr, ptr = runtime.cudaMalloc(0)
        print(f"cudaMalloc(0): {merr.name}, ptr={int(ptr):#x}")
        rerr, _, size = driver.cuMemGetAddressRange(ptr)
        print(f"cuMemGetAddressRange(that ptr): {rerr.name}, size={int(size)}")
    except Exception as error:
        print(f"cudaMalloc(0) probe failed: {type(error).__name__}: {error}")
    return 0


# ----------------------------------------------------------------------------- driver
def run_one(index: int, shape, port: int, fake: bool, timeout: float, sleep: float, out_dir: str | None):
    name = "diag" if shape == "diag" else label(shape)
    if shape == "diag":
        argv, extra = ["--diag"], {}
    else:
        hidden, tokens, experts, ag, fp8, extra = shape
        spec = dict(hidden=hidden, tokens=tokens, experts=experts, ag=ag, fp8=fp8, fake=fake, sleep=sleep)
        argv = ["--child", json.dumps(spec)]
    command = [sys.executable, "-u", os.path.abspath(__file__), *argv]
    if shutil.which("stdbuf"):
        command = ["stdbuf", "-o0", "-e0", *command]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHONFAULTHANDLER", None)  # a traceback would push the C++ message out of the tail
    env.update(extra)
    if fake:
        env["DEEP_EP_SHAPES_FAKE"] = "1"
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
        outcome = (
            "ok"
            if rc == 0
            else "exception"
            if rc == 3
            else (f"signal {signal.Signals(-rc).name}" if rc < 0 else f"rc {rc}")
        )
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc, outcome = None, f"timeout {timeout:.0f} s"
    text = output.decode(errors="replace")
    if out_dir:
        with open(os.path.join(out_dir, f"{index:02d}.log"), "w") as log:
            log.write(f"{name}\n{' '.join(command)}\nrc={rc}\n\n{text}")
    tail = [line.strip() for line in text.splitlines() if line.strip()][-3:]
    return name, outcome, time.time() - start, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--diag", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="fake children (no torch): tests this driver")
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--sleep", type=float, default=1.0, help="--dry-run: how long the h2048 fake child sleeps")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.diag:
        return diag()

    out_dir = os.path.join(os.environ["OUT"], "deep_ep_shapes") if os.environ.get("OUT") else None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    shapes = ["diag", *GRID]
    base = random.randrange(20000, 40000)
    start = time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [
            pool.submit(run_one, i, shape, base + i, args.dry_run, args.timeout, args.sleep, out_dir)
            for i, shape in enumerate(shapes)
        ]
        results = [future.result() for future in futures]
    print(
        f"deep_ep.HybridEPBuffer constructor, {len(GRID)} shapes, {args.jobs} at a time, "
        f"{time.time() - start:.0f} s in all{' (DRY RUN: fake children)' if args.dry_run else ''}"
    )
    for shape, (name, outcome, seconds, tail) in zip(shapes, results):
        expected = "" if shape == "diag" else predict(shape[0], shape[1], shape[2], shape[4])
        agrees = (
            ""
            if shape == "diag"
            else ("  " if outcome.startswith(expected) or (expected == "abort" and "SIGABRT" in outcome) else "!!")
        )
        print(
            f"{agrees}{name:<40} predicted {expected or '-':<9} got {outcome:<16} {seconds:5.1f} s | "
            + " | ".join(tail)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
