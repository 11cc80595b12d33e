"""Probe: torch's NVSHMEM all-to-all ops (splits on the GPU) on ONE H200.

Run from the repository root:  python3 docs/results/h200-2026-12-01/symm_one_gpu.py
It spawns its own child processes (plain subprocess, env RANK/WORLD_SIZE/MASTER_PORT), each under a
timeout, so nothing hangs; a stage that fails does not stop the next. Stages:
  a  world size 1, one process: set_backend("NVSHMEM"), symm_mem.empty + rendezvous, then
     all_to_all_vdev, all_to_all_vdev_2d (8 local experts, major_align 1/16/128),
     all_to_all_vdev_2d_offset (combine back), bf16 rows of hidden 4096 and 16, checked against a
     reference; 20-iteration CUDA-event timings at 65536 x 4096 bf16 next to a plain device copy.
     (torch 2.11's TeamManager refuses a group of one rank: expect "global_ranks.size() > 1".)
  b  world size 2 on the SAME GPU (cuda:0 for both; NVSHMEM "multiple PEs per GPU", no MPS),
     first over a gloo process group, then (only if gloo got no op through) over nccl: the same ops
     with seeded random splits; each rank rebuilds both ranks' inputs and checks what it received.
  c  host run-ahead: after torch.cuda._sleep(~200 ms), host time of 5 calls of each op.
  m  (only with PROBE_MPS=1; PROBE_STAGES=m runs it alone) b and c again under a private MPS daemon
     (CUDA_MPS_PIPE_DIRECTORY in a temp dir, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50), which NVSHMEM needs
     for "full" MPG; the daemon is told to quit at the end.
Semantics probed (torch 2.11, torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu):
  all_to_all_vdev(input, out, in_splits[W], out_splits_offsets[2, W], group_name)
  all_to_all_vdev_2d(input, out, in_splits[W*ne], out_splits_offsets[2, W*ne], group_name,
                     major_align=None)          in: rank-major (p*ne+e); out: expert-major (e*W+s)
  all_to_all_vdev_2d_offset(input, out, in_splits_offsets[2, ne*W], out_splits_offsets[2, W*ne],
                            group_name)         in: expert-major (e*W+s) + caller offsets; out: rank-major
All four tensors of every call are symmetric (symm_mem.empty, same shape on every rank); splits and
offsets are int64 and count rows (dim 0), not elements.

Seen on one H200 (torch 2.11.0+cu130, NVSHMEM 3.4.5), 2026-12-01:
  a  FAILED as expected: rendezvous itself raises "Expected global_ranks.size() > 1" (no op can run
     at W=1). Plain copy of 65536 x 4096 bf16 (512 MiB): 0.257 ms.
  b  FAILED over gloo and over nccl alike: NVSHMEM init works (uid bootstrap over the store), sees
     "MPG detected but MPS is not running. Hence limited MPG support", then rendezvous's
     nvshmem_team_split_strided exits the process (rc 255): "Called NVSHMEM API not supported with
     limited MPG (Multiple Processes Per GPU) runs" (team.cu:64).
  m  (PROBE_MPS=1) everything OK on both ranks: 1D, 2D with align None/16/128, 10 calls back to
     back, 2d_offset putting rows back; expected layouts matched (an empty expert still takes
     major_align rows, 1 when None). 256 MiB/rank, both ranks on the GPU at once: plain copy
     0.255 ms, vdev 0.386 ms, vdev_2d(align 128, ne 8) 1.05 ms, vdev_2d_offset 1.05 ms.
     Host run-ahead: 5 calls = 0.12-0.21 ms of host time behind a 200 ms GPU sleep (no host sync).
"""

import os

# NVLink multicast must stay off on this host: set before torch is imported, inherited by children.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("NVSHMEM_DISABLE_NCCL", "1")  # NVSHMEM must not bring NCCL in (MPG refuses it)
os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")  # everything is on this host
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "4G")  # the 65536 x 4096 buffers need > 1 GiB
os.environ.setdefault("NVSHMEM_DEBUG", "INFO")  # says whether MPG was detected / limited; filtered

import importlib.metadata
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
NE = 8  # local experts per rank for the 2d ops
BIG_ROWS, BIG_H = 65536, 4096  # timing shape (bf16), total over the ranks
ITERS = 20


# ----------------------------------------------------------------------------------------------
# child side
# ----------------------------------------------------------------------------------------------
class Reporter:
    def __init__(self, stage, rank):
        self.stage, self.rank, self.fails, self.oks = stage, rank, 0, 0

    def line(self, kind, name, detail=""):
        print(f"{kind} {self.stage}.{name} {detail}".rstrip(), flush=True)

    def run(self, name, fn, *args):
        """Run one check; print RESULT OK/FAILED; return fn's value or None."""
        self.line("RUN", name)
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 - a probe reports everything
            self.fails += 1
            msg = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            self.line("RESULT", name, f"FAILED {type(e).__name__}: {msg[-1][:300] if msg else ''}")
            return None
        ok, detail = out if isinstance(out, tuple) else (True, out)
        if ok:
            self.oks += 1
        else:
            self.fails += 1
        self.line("RESULT", name, ("OK " if ok else "FAILED ") + str(detail or ""))
        return out


def excl(xs):
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def child():
    import faulthandler

    stage, backend = os.environ["PROBE_STAGE"], os.environ["PROBE_BACKEND"]
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmo = float(os.environ.get("PROBE_CHILD_TIMEOUT", "40"))
    faulthandler.dump_traceback_later(max(tmo - 4, 5), exit=True)  # a hang prints where it was
    R = Reporter(stage, rank)

    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    ctx = {}

    def setup_cuda():
        torch.cuda.set_device(0)  # every rank on the SAME GPU
        ctx["dev"] = torch.device("cuda", 0)
        torch.zeros(1, device=ctx["dev"])
        return f"{torch.cuda.get_device_name(0)}, rank {rank}/{W} on cuda:0"

    if R.run("cuda", setup_cuda) is None:
        sys.exit(2)
    dev = ctx["dev"]

    def setup_pg():
        from datetime import timedelta

        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=W,
            timeout=timedelta(seconds=30),
        )
        ctx["store"] = dist.distributed_c10d._get_default_store()
        ctx["group"] = dist.group.WORLD.group_name
        return f"backend {dist.get_backend()}, group_name {ctx['group']!r}"

    if R.run(f"pg_init_{backend}", setup_pg) is None:
        sys.exit(2)
    store, group = ctx["store"], ctx["group"]
    bar_n = [0]

    def host_barrier(timeout=20.0):  # store-based: never triggers a NCCL communicator
        bar_n[0] += 1
        key = f"probe_bar_{bar_n[0]}"
        store.add(key, 1)
        t0 = time.time()
        while store.add(key, 0) < W:
            if time.time() - t0 > timeout:
                raise TimeoutError(f"host barrier {key}")
            time.sleep(0.001)

    def sync_all():
        # Peers write into our out_splits_offsets (exchange kernel, no leading barrier) and pull from
        # our input after our op has returned (no closing barrier), so buffers are only reset or
        # refilled between a device sync + host barrier on every rank.
        torch.cuda.synchronize()
        host_barrier()

    def setup_symm():
        symm_mem.set_backend("NVSHMEM")
        notes = [f"nvshmem_available={symm_mem.is_nvshmem_available()}"]
        try:  # torch 2.11 does not register group "0" for symm_mem by itself (checked on CPU)
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group)
            notes.append("group registered")
        except Exception as e:  # noqa: BLE001
            notes.append(f"group registration skipped ({type(e).__name__})")
        t = symm_mem.empty(16, dtype=torch.int64, device=dev)
        h = symm_mem.rendezvous(t, group)
        notes.append(f"backend {symm_mem.get_backend(dev)}, handle rank {h.rank} world {h.world_size}")
        notes.append(f"buffer_ptrs {len(h.buffer_ptrs)}")
        return "; ".join(notes)

    # W=1 fails here in torch 2.11 (TeamManager wants > 1 rank); go on so every op reports its own error
    R.run("nvshmem_init_alloc_rendezvous", setup_symm)

    def empty(*shape, dtype=torch.bfloat16):
        t = symm_mem.empty(*shape, dtype=dtype, device=dev)
        symm_mem.rendezvous(t, group)
        return t

    def cuda_alive():
        try:
            torch.cuda.synchronize()
            return True
        except Exception as e:  # noqa: BLE001
            R.line("RESULT", "cuda_context", f"FAILED {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
            return False

    def rows(seed, n, H):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(n, H, device=dev, dtype=torch.bfloat16, generator=g)

    def rand_splits(seed, n, hi, zero_every=None):
        g = torch.Generator().manual_seed(seed)
        s = torch.randint(0, hi + 1, (n,), generator=g).tolist()
        if zero_every:  # one local expert empty on every rank: shows how empty experts are laid out
            s = [0 if i % NE == zero_every else v for i, v in enumerate(s)]
        return s

    do_checks = stage in ("a", "b")  # correctness + timing; stage c only measures host run-ahead

    # -------------------------------------------------------------------- correctness, two sizes
    def checks_for(H):
        # 1D: in_splits[W] (rows to each peer), input packed by destination from row 0
        max1 = 300
        cap1 = max1 * W + 5  # input may be larger than the rows sent
        B = {}

        def alloc1():
            B["inp1"], B["out1"] = empty(cap1, H), empty(max1 * W + 5, H)
            B["sp1"], B["so1"] = empty(W, dtype=torch.int64), empty(2, W, dtype=torch.int64)
            return "input, out, in_splits, out_splits_offsets"

        if R.run(f"alloc_1d_h{H}", alloc1) is None:
            return
        inp1, out1, sp1, so1 = B["inp1"], B["out1"], B["sp1"], B["so1"]

        def vdev(repeat=1):
            seed = 100 + H + repeat
            splits = {s: rand_splits(seed * 10 + s, W, max1) for s in range(W)}
            inputs = {s: rows(seed * 10 + s, cap1, H) for s in range(W)}
            sync_all()
            inp1.copy_(inputs[rank])
            sp1.copy_(torch.tensor(splits[rank]))
            out1.zero_()
            so1.fill_(-1)
            sync_all()
            for _ in range(repeat):  # back to back, same buffers, no sync in between
                torch.ops.symm_mem.all_to_all_vdev(inp1, out1, sp1, so1, group)
            torch.cuda.synchronize()
            exp_split = [splits[s][rank] for s in range(W)]
            exp = torch.cat([inputs[s][excl(splits[s])[rank] :][: splits[s][rank]] for s in range(W)])
            got = so1.tolist()
            rows_ok = torch.equal(out1[: exp.shape[0]], exp)
            ok = got[0] == exp_split and got[1] == excl(exp_split) and rows_ok
            return ok, f"sent {splits[rank]} recv_splits {got[0]} recv_offsets {got[1]} rows_equal {rows_ok}"

        for repeat in (1, 10):
            R.run(f"vdev_h{H}" + ("" if repeat == 1 else f"_x{repeat}"), vdev, repeat)
            if not cuda_alive():
                sys.exit(3)

        # 2D dispatch: in_splits[W*NE] rank-major (p*NE+e); out expert-major (e*W+s), aligned per e
        max2 = 40
        cap2 = max2 * W * NE

        def alloc2():
            B["inp2"], B["out2"] = empty(cap2, H), empty(NE * (max2 * W + 128), H)
            B["sp2"], B["so2"] = empty(W * NE, dtype=torch.int64), empty(2, W * NE, dtype=torch.int64)
            B["back"], B["so3"] = empty(cap2, H), empty(2, W * NE, dtype=torch.int64)
            return "dispatch and combine buffers"

        if R.run(f"alloc_2d_h{H}", alloc2) is None:
            return
        inp2, out2, sp2, so2, back, so3 = (B[k] for k in ("inp2", "out2", "sp2", "so2", "back", "so3"))
        state = {}

        def vdev2d(align, repeat=1):
            seed = 200 + H + repeat
            splits = {s: rand_splits(seed * 10 + s, W * NE, max2, zero_every=3) for s in range(W)}
            inputs = {s: rows(seed * 10 + s, cap2, H) for s in range(W)}
            sync_all()
            inp2.copy_(inputs[rank])
            sp2.copy_(torch.tensor(splits[rank]))
            out2.zero_()
            so2.fill_(-1)
            sync_all()
            kw = {} if align is None else {"major_align": align}
            for _ in range(repeat):  # back to back, same buffers, no sync in between
                torch.ops.symm_mem.all_to_all_vdev_2d(inp2, out2, sp2, so2, group, **kw)
            torch.cuda.synchronize()
            a = 1 if align is None else align
            exp_sp, exp_off, chunks, pos = [], [], [], 0
            for e in range(NE):
                start, tot = pos, 0
                for s in range(W):
                    n = splits[s][rank * NE + e]
                    src0 = excl(splits[s])[rank * NE + e]
                    exp_sp.append(n)
                    exp_off.append(start + tot)
                    chunks.append((start + tot, inputs[s][src0 : src0 + n]))
                    tot += n
                pos = start + max((tot + a - 1) // a * a, a)  # empty expert still takes `a` rows
            got = so2.tolist()
            rows_ok = all(torch.equal(out2[o : o + c.shape[0]], c) for o, c in chunks)
            ok = got[0] == exp_sp and got[1] == exp_off and rows_ok
            state.update(splits=splits, inputs=inputs, ok=ok)
            return ok, (
                f"align {align}: sent {splits[rank]} | out row0 (splits, idx e*W+s) {got[0]} | "
                f"row1 (offsets) {got[1]} | expected offsets {exp_off} | rows_equal {rows_ok}"
            )

        for align, repeat in ((None, 1), (16, 1), (128, 10), (128, 1)):
            R.run(f"vdev2d_h{H}_align{align}" + ("" if repeat == 1 else f"_x{repeat}"), vdev2d, align, repeat)
            if not cuda_alive():
                sys.exit(3)

        def combine():
            if "splits" not in state:
                return False, "no 2d dispatch result to send back"
            # input = the dispatch output (expert-major, padded); in_splits_offsets = its out_splits_offsets
            sync_all()
            back.zero_()
            so3.fill_(-1)
            sync_all()
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(out2, back, so2, so3, group)
            torch.cuda.synchronize()
            mine = state["splits"][rank]
            n = sum(mine)
            got = so3.tolist()
            rows_ok = torch.equal(back[:n], state["inputs"][rank][:n])
            ok = got[0] == mine and got[1] == excl(mine) and rows_ok
            return ok, f"out row0 (idx p*NE+e) {got[0]} | row1 {got[1]} | rows back in original places {rows_ok}"

        R.run(f"vdev2d_offset_h{H}", combine)
        if not cuda_alive():
            sys.exit(3)

    for H in (4096, 16) if do_checks else ():
        checks_for(H)

    # -------------------------------------------------------------------- timing
    Rr = BIG_ROWS // W  # rows per rank; the ranks together move BIG_ROWS rows
    src = rows(7 + rank, Rr, BIG_H)  # plain (non-symmetric) tensors for the copy baseline
    dst = torch.empty_like(src)
    BB = {}

    def alloc_big():
        BB["in"], BB["out"], BB["back"] = empty(Rr, BIG_H), empty(Rr + NE * 128, BIG_H), empty(Rr, BIG_H)
        BB["sp1"], BB["so1"] = empty(W, dtype=torch.int64), empty(2, W, dtype=torch.int64)
        BB["sp2"], BB["so2"] = empty(W * NE, dtype=torch.int64), empty(2, W * NE, dtype=torch.int64)
        BB["so3"] = empty(2, W * NE, dtype=torch.int64)
        BB["in"].copy_(src)
        BB["sp1"].fill_(Rr // W)  # uniform splits: every rank receives Rr rows
        BB["sp2"].fill_(Rr // (W * NE))
        return f"{Rr} x {BIG_H} bf16 per rank"

    R.run("alloc_big", alloc_big)

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        host_barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(ITERS):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / ITERS

    nbytes = Rr * BIG_H * 2

    def copy_time():
        ms = timed(lambda: dst.copy_(src))
        return f"{Rr} x {BIG_H} bf16 = {nbytes / 2**20:.0f} MiB: {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s moved)"

    if do_checks:
        R.run("time_plain_copy", copy_time)

    def big(k):
        if k not in BB:
            raise RuntimeError("symmetric buffers were not allocated (see alloc_big)")
        return BB[k]

    ops = {
        "vdev": lambda: torch.ops.symm_mem.all_to_all_vdev(big("in"), big("out"), big("sp1"), big("so1"), group),
        "vdev2d_align128": lambda: torch.ops.symm_mem.all_to_all_vdev_2d(
            big("in"), big("out"), big("sp2"), big("so2"), group, major_align=128
        ),
        "vdev2d_offset": lambda: torch.ops.symm_mem.all_to_all_vdev_2d_offset(
            big("out"), big("back"), big("so2"), big("so3"), group
        ),
    }
    for name, fn in ops.items() if do_checks else ():

        def t(fn=fn):
            ms = timed(fn)
            return (
                f"{Rr} rows/rank x {BIG_H} bf16 ({nbytes / 2**20:.0f} MiB/rank): {ms:.3f} ms/call "
                f"({nbytes / ms / 1e6:.0f} GB/s per rank)"
            )

        R.run(f"time_{name}", t)
        if not cuda_alive():
            sys.exit(3)

    # -------------------------------------------------------------------- host run-ahead (stage c)
    if stage == "c" or W == 1:

        def calib():
            for _ in range(2):  # the first one can run at a lower clock
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                torch.cuda._sleep(50_000_000)
                e.record()
                e.synchronize()
                ctx["cyc_per_ms"] = 50_000_000 / s.elapsed_time(e)
            return f"{ctx['cyc_per_ms'] / 1e6:.2f} GHz sleep clock"

        R.run("sleep_calibration", calib)
        cyc = ctx.get("cyc_per_ms", 1.98e6)
        for name, fn in ops.items():

            def ahead(fn=fn):
                fn()
                torch.cuda.synchronize()
                host_barrier()
                t0 = time.perf_counter()
                torch.cuda._sleep(int(200 * cyc))
                t1 = time.perf_counter()
                for _ in range(5):
                    fn()
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                host = (t2 - t1) * 1e3
                return host < 100, (
                    f"5 calls took {host:.2f} ms of host time behind a 200 ms GPU sleep "
                    f"(sleep launch {1e3 * (t1 - t0):.2f} ms, all done after {1e3 * (t3 - t0):.0f} ms)"
                )

            R.run(f"runahead_{name}", ahead)
            if not cuda_alive():
                sys.exit(3)

    print(f"DONE oks={R.oks} fails={R.fails}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0 if R.fails == 0 else 1)  # skip NVSHMEM/atexit teardown, which can hang under MPG


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pkg(name):
    try:
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001
        return None


def nvshmem_version_child():
    """Prints the NVSHMEM library version through ctypes (no torch, no CUDA context)."""
    import ctypes

    for dist_name in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            files = importlib.metadata.distribution(dist_name).files or []
        except Exception:  # noqa: BLE001
            continue
        for f in files:
            if str(f).endswith("libnvshmem_host.so.3"):
                path = str(f.locate())
                lib = ctypes.CDLL(path)
                maj, mnr = ctypes.c_int(), ctypes.c_int()
                lib.nvshmem_info_get_version(ctypes.byref(maj), ctypes.byref(mnr))
                name = ctypes.create_string_buffer(256)
                try:
                    lib.nvshmem_info_get_name(name)
                except Exception:  # noqa: BLE001
                    pass
                print(f"{name.value.decode(errors='replace') or 'NVSHMEM'} spec {maj.value}.{mnr.value} ({path})")
                return
    print("libnvshmem_host.so.3 not found in nvidia-nvshmem-cu13/cu12")


def header():
    print("== symm_one_gpu probe ==", flush=True)
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    for p in ("torch", "triton", "nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12", "nvidia-nccl-cu13"):
        v = pkg(p)
        if v:
            print(f"{p} {v}")
    try:
        import torch

        print(f"torch {torch.__version__} cuda {torch.version.cuda} device_count {torch.cuda.device_count()}")
        try:
            import torch.distributed._symmetric_memory as symm_mem

            print(f"symm_mem.is_nvshmem_available() = {symm_mem.is_nvshmem_available()}")
        except Exception as e:  # noqa: BLE001
            print(f"symm_mem import: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        print(f"torch not importable: {type(e).__name__}: {e}")
    try:
        r = subprocess.run([sys.executable, HERE, "--nvshmem-version"], capture_output=True, text=True, timeout=20)
        print("nvshmem library: " + (r.stdout.strip() or f"rc {r.returncode}: {r.stderr.strip()[-200:]}"))
    except Exception as e:  # noqa: BLE001
        print(f"nvshmem library: {type(e).__name__}: {e}")
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15)
            print("nvidia-smi -L: " + " | ".join(r.stdout.strip().splitlines()))
        except Exception as e:  # noqa: BLE001
            print(f"nvidia-smi: {type(e).__name__}")
    else:
        print("nvidia-smi: not found")
    mps = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    print(f"CUDA MPS pipe dir {mps} exists: {os.path.exists(mps)} (MPG without MPS = NVSHMEM 'limited MPG')")
    keys = (
        "NCCL_NVLS_ENABLE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
        "NVSHMEM_DISABLE_NCCL",
        "NVSHMEM_SYMMETRIC_SIZE",
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
        "NVSHMEM_DEBUG",
        "TORCH_SYMMMEM_NBLOCKS",
    )
    print("env: " + " ".join(f"{k}={os.environ.get(k)}" for k in keys))
    print(flush=True)


# NVSHMEM_DEBUG=INFO writes to stdout and stderr; keep only what says something about this probe
NOISE = ("Warning", "warn(", "FutureWarning", "bootstrap_uid", "ibrc.cpp", "NVLINK SHARP", "cuIpcOpenMemHandle")
INTEREST = (
    "MPG",
    "MPS",
    "not supported",
    "ERROR",
    "Error",
    "error",
    "Assertion",
    "assert",
    "Traceback",
    'File "',
    "exiting",
    "abort",
    "Fatal",
    "fatal",
    "Timeout",
    "timed out",
)
KEY = ("not supported", "Error:", "Assertion", "abort", "Timeout", "exiting")


def noteworthy(ln):
    return any(k in ln for k in INTEREST) and not any(n in ln for n in NOISE)


def run_group(stage, world, backend, timeout, extra_env=None):
    """Start `world` children on cuda:0; return (ok, any_op_ok, summary, results)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix=f"symm_probe_{stage}_")
    procs = []
    for r in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PROBE_STAGE=stage,
            PROBE_BACKEND=backend,
            PROBE_CHILD_TIMEOUT=str(timeout),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra_env or {})
        out = open(os.path.join(tmp, f"r{r}.out"), "w")
        err = open(os.path.join(tmp, f"r{r}.err"), "w")
        p = subprocess.Popen(
            [sys.executable, HERE, "--child"],
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append((p, out, err))
    t0 = time.time()
    timed_out, first_fail = False, None
    while True:
        codes = [p.poll() for p, _, _ in procs]
        if all(c is not None for c in codes):
            break
        if first_fail is None and any(c not in (None, 0) for c in codes):
            first_fail = time.time()
        if time.time() - t0 > timeout or (first_fail and time.time() - first_fail > 8):
            timed_out = time.time() - t0 > timeout
            break
        time.sleep(0.2)
    for p, _, _ in procs:  # end only the children started here, by their own process groups
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p, _, _ in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)
    elapsed = time.time() - t0
    results, any_op_ok, all_ok, reasons = [], False, True, []
    for r, (p, out, err) in enumerate(procs):
        out.close()
        err.close()
        with open(out.name, errors="replace") as f:
            so = f.read().splitlines()
        with open(err.name, errors="replace") as f:
            se = f.read().splitlines()
        last_run = None
        for ln in so:
            if ln.startswith("RUN "):
                last_run = ln[4:]
            elif ln.startswith("RESULT "):
                results.append((r, ln[7:]))
                print(f"  [rank {r}] {ln[7:]}")
                name, _, rest = ln[7:].partition(" ")
                if rest.startswith("OK") and any(k in name for k in ("vdev", "time_vdev", "runahead")):
                    any_op_ok = True
                if rest.startswith("FAILED"):
                    all_ok = False
            elif ln.startswith("DONE"):
                pass
            elif noteworthy(ln):
                print(f"  [rank {r}] | {ln[:300]}")
        rc = p.returncode
        if rc != 0:
            all_ok = False
            why = f"rank {r} rc {rc}"
            if rc in (-signal.SIGTERM, -signal.SIGKILL):
                why = (
                    f"rank {r} killed after {timeout} s timeout"
                    if timed_out
                    else f"rank {r} killed after a peer failed"
                )
            if last_run and not any(x[0] == r and x[1].startswith(last_run.split()[0] + " ") for x in results):
                why += f", hung or died in {last_run}"
            key = [
                ln.strip()
                for ln in so + se
                if any(k in ln for k in KEY)
                and noteworthy(ln)
                and "NVSHMEM INFO" not in ln
                and not ln.startswith(("RESULT", "RUN"))
            ]
            if key:
                why += f": {key[0][-160:]}"
            reasons.append(why)
        keep = [ln for ln in se if noteworthy(ln)]
        tail = [ln for ln in se if ln.strip() and not any(n in ln for n in NOISE)][-4:]
        shown = list(dict.fromkeys(keep[-14:] + tail))
        if shown and (rc != 0 or keep):
            print(f"  [rank {r}] stderr ({len(se)} lines, showing {len(shown)}):")
            for ln in shown:
                print(f"  [rank {r}]   ! {ln[:300]}")
    shutil.rmtree(tmp, ignore_errors=True)
    summary = "OK" if all_ok else "FAILED" + (f" ({'; '.join(reasons)})" if reasons else " (see FAILED lines)")
    return all_ok, any_op_ok, f"{summary} [{elapsed:.1f} s]", results


def mps_stage():
    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        print("STAGE m: SKIPPED (no nvidia-cuda-mps-control)\n")
        return "SKIPPED (no nvidia-cuda-mps-control)"
    d = tempfile.mkdtemp(prefix="symm_probe_mps_")
    menv = dict(
        os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(d, "pipe"), CUDA_MPS_LOG_DIRECTORY=os.path.join(d, "log")
    )
    os.makedirs(menv["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(menv["CUDA_MPS_LOG_DIRECTORY"])
    print(f"== stage m: W=2 on cuda:0 under a private MPS daemon ({d}) ==", flush=True)
    try:
        r = subprocess.run([ctl, "-d"], env=menv, capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return f"FAILED to start MPS: rc {r.returncode} {r.stderr.strip()[-200:]}"
        extra = {k: menv[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
        extra["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "50"  # NVSHMEM wants the PEs of one GPU to sum <= 100
        ok, any_ok, s, _ = run_group("b", 2, "gloo", timeout=45, extra_env=extra)
        print(f"STAGE m/b: {s}\n", flush=True)
        ok, any_c, s2, res = run_group("c", 2, "gloo", timeout=30, extra_env=extra)
        ra = [x for _, x in res if x.startswith("runahead")]
        print(f"STAGE m/c: {s2}\n", flush=True)
        return f"checks {s}; run-ahead {s2}" + (f"; {ra[0]}" if ra else "")
    except Exception as e:  # noqa: BLE001
        return f"FAILED {type(e).__name__}: {e}"
    finally:
        try:
            subprocess.run([ctl], input="quit\n", env=menv, capture_output=True, text=True, timeout=20)
        except Exception as e:  # noqa: BLE001
            print(f"MPS quit: {type(e).__name__}: {e}")
        shutil.rmtree(d, ignore_errors=True)


def main():
    t_start = time.time()
    header()
    summary = {}
    stages = os.environ.get("PROBE_STAGES", "abc") + ("m" if os.environ.get("PROBE_MPS") == "1" else "")

    if "a" in stages:
        print("== stage a: world size 1, one process, NVSHMEM backend ==", flush=True)
        ok, any_ok, s, _ = run_group("a", 1, "gloo", timeout=40)
        summary["a (W=1, one process)"] = s
        print(f"STAGE a: {s}\n", flush=True)

    backend_c = "gloo"
    if "b" in stages:
        print("== stage b: world size 2, both processes on cuda:0 (multiple PEs per GPU), gloo group ==", flush=True)
        ok_b, any_b, s, _ = run_group("b", 2, "gloo", timeout=40)
        summary["b (W=2 same GPU, gloo)"] = s
        print(f"STAGE b/gloo: {s}\n", flush=True)
        if not any_b:
            print("== stage b again over an nccl group (no op got through with gloo) ==", flush=True)
            ok_n, any_n, s, _ = run_group("b", 2, "nccl", timeout=30)
            summary["b (W=2 same GPU, nccl)"] = s
            print(f"STAGE b/nccl: {s}\n", flush=True)
            if any_n:
                backend_c, any_b = "nccl", True
        summary["MPG (2 PEs on one GPU, no MPS)"] = "WORKS (some op passed)" if any_b else "DID NOT WORK"

    if "c" in stages:
        print(f"== stage c: host run-ahead, W=2 on cuda:0 over {backend_c} ==", flush=True)
        ok, any_ok, s, res = run_group("c", 2, backend_c, timeout=30)
        ra = [x for _, x in res if x.startswith("runahead")]
        summary["c (host run-ahead)"] = s + (f"; {ra[0]}" if ra else "")
        print(f"STAGE c: {s}\n", flush=True)

    if "b" in stages and "m" not in stages and summary.get("MPG (2 PEs on one GPU, no MPS)") == "DID NOT WORK":
        print("hint: NVSHMEM needs an MPS server for full MPG; PROBE_MPS=1 PROBE_STAGES=m runs b and c under one\n")

    if "m" in stages:  # opt-in: full MPG needs an MPS server (a private one here)
        summary["m (W=2 same GPU under MPS)"] = mps_stage()

    print("== summary ==")
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"total {time.time() - t_start:.1f} s")
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    elif "--nvshmem-version" in sys.argv:
        nvshmem_version_child()
    else:
        main()
