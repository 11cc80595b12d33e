#!/bin/bash
# What produced the files beside this one, on the lent two-H200 machine (device tool), run from the
# repository root: `bash docs/results/h200x2-2026-12-01/session.sh CALL`.
# Carried with each call: .whl/ (megatron-core 0.19.2 and ../shared/tools/deep_ep's wheel).
#   one-gpu: two single-rank queues at once: GPU 0 the benches (large at factors 1.5 and 2.0, then
#            mid, each --repeat 3), GPU 1 the one-GPU tests.
#   one-h200: the same on a one-H200 machine, in turn.
#   two-gpu: EP 2 over both GPUs: the tests across GPU ranks, DeepEP's own test with 2 processes,
#            the bench at the large size (--repeat 3), the roundtrip against all_to_all_single.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
# megatron_ext.patches is installed from patches/ (a package-dir mapping): a link does it here.
ln -sfn ../patches megatron_ext/patches
export PYTHONPATH=$PWD:/tmp/site
LARGE="--layers 8 --tokens 8192 --hidden 4096 --ffn-hidden 1024 --experts 64 --topk 8"
MID="--layers 4 --tokens 4096 --hidden 2048 --ffn-hidden 1024 --experts 32 --topk 4"
ALL=megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4

bench() {  # bench NAME TIMEOUT ARGS...: one bench run, its table to the log, its JSON to $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  echo "=== bench $name $(date -u +%H:%M:%S)"
  timeout "$limit" python3 -m megatron_ext.bench "$@" --no-progress --json "$OUT/$name.json" 2>&1 | grep -v Warning
}

case ${1:-} in
  one-gpu)
    (
      export CUDA_VISIBLE_DEVICES=0 HYBRID_EP_CACHE_DIR=/tmp/jit0
      bench large 300 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
      bench large-factor-2.0 190 $LARGE --check-steps 1 --steps 5 --repeat 3 --capacity-factor 2.0 \
        --modes blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
      bench mid 80 $MID --steps 10 --repeat 3 --modes $ALL
    ) > "$OUT/gpu0.log" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=1 HYBRID_EP_CACHE_DIR=/tmp/jit1
      echo "=== tests $(date -u +%H:%M:%S)"
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_fused.py \
        tests/test_experts.py tests/test_gpu_buffer.py tests/test_gpu_moe_layer.py 2>&1 | grep -v Warning | tail -60
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    grep -hE "^=== |passed|failed|^(megatron|blocking|capacity|deep_ep|mode )" "$OUT"/gpu0.log "$OUT"/gpu1.log ;;
  one-h200)  # the same work on a one-H200 machine, in turn (the two-GPU kind was withdrawn)
    {
      export HYBRID_EP_CACHE_DIR=/tmp/jit0
      bench large 250 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
      echo "=== tests $(date -u +%H:%M:%S)"
      timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_fused.py \
        tests/test_experts.py tests/test_gpu_buffer.py tests/test_gpu_moe_layer.py 2>&1 | grep -v Warning | tail -40
      bench large-factor-2.0 150 $LARGE --check-steps 1 --steps 5 --repeat 3 --capacity-factor 2.0 \
        --modes blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse
      bench mid 60 $MID --steps 10 --repeat 3 --modes $ALL
    } > "$OUT/one-h200.log" 2>&1
    grep -hE "^=== |passed|failed|^(megatron|blocking|capacity|deep_ep|mode )" "$OUT"/one-h200.log ;;
  two-gpu)
    export HYBRID_EP_CACHE_DIR=/tmp/jit
    {
      echo "=== tests across GPU ranks $(date -u +%H:%M:%S)"
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_ranks.py 2>&1 | tail -30
      echo "=== roundtrip $(date -u +%H:%M:%S)"
      timeout 60 torchrun --nproc-per-node 2 -m megatron_ext.roundtrip --backend nccl --iters 20 \
        --tokens 8192 --hidden 4096 --experts 64 --topk 8 2>&1 | grep -v Warning | tail -20
      bench ep2-large 330 $LARGE --check-steps 1 --steps 5 --repeat 3 --modes $ALL
    } > "$OUT/two-gpu.log" 2>&1
    grep -E "^=== |passed|failed|GB/s|^(megatron|blocking|capacity|deep_ep|mode )" "$OUT/two-gpu.log" ;;
  *) echo "usage: $0 one-gpu|one-h200|two-gpu" >&2; exit 2 ;;
esac
