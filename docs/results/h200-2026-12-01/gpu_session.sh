#!/bin/bash
# What produced the files beside this one, on the lent one-H200 machine (device tool), run from the
# repository root: `bash docs/results/h200-2026-12-01/gpu_session.sh STAGE...`.
# Carried with the call: .whl/ (megatron-core 0.19.2 and ../shared/tools/deep_ep's wheel) and, for
# the "before" profile, .baseline/ (`git archive ba94f49`, with this commit's bench/profile.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export HYBRID_EP_CACHE_DIR=/tmp/hybrid_ep_jit
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
# megatron_ext.patches is installed from patches/ (a package-dir mapping): a link does it here.
[ -d megatron_ext/patches ] || ln -sfn ../patches megatron_ext/patches  # before 4d06e61 moved it in
[ -d .baseline ] && ln -sfn ../patches .baseline/megatron_ext/patches
export PYTHONPATH=$PWD:/tmp/site
LARGE="--layers 8 --tokens 8192 --hidden 4096 --ffn-hidden 1024 --experts 64 --topk 8"
MID="--layers 4 --tokens 4096 --hidden 2048 --ffn-hidden 1024 --experts 32 --topk 4"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    tests)  # the GPU tests of this code (TE's are skipped without TE)
      timeout 300 python3 -m pytest -q -m gpu tests/test_fused.py tests/test_experts.py tests/test_gpu_buffer.py \
        tests/test_gpu_moe_layer.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" ;;
    profile-after)  # this commit only
      timeout 200 python3 -m megatron_ext.bench.profile $LARGE --modes blocking,capacity+equal --out /tmp/prof-after \
        > /dev/null 2>"$OUT/profile-after.err"; cp /tmp/prof-after/profile.txt "$OUT/profile-after.txt"
      grep -E "^## |minus|alive at its peak" "$OUT"/profile-after.txt ;;
    profile)  # where the time and memory go, before (ba94f49) and after
      timeout 200 python3 -m megatron_ext.bench.profile $LARGE --modes blocking,capacity+equal --out /tmp/prof-after \
        > /dev/null 2>"$OUT/profile-after.err"; cp /tmp/prof-after/profile.txt "$OUT/profile-after.txt"
      (cd .baseline && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m megatron_ext.bench.profile $LARGE \
        --modes blocking,capacity+equal --out /tmp/prof-before > /dev/null 2>"$OUT/profile-before.err")
      cp /tmp/prof-before/profile.txt "$OUT/profile-before.txt"
      tar czf "$OUT/memory-snapshots.tar.gz" -C /tmp prof-before prof-after
      grep -E "^## |minus|alive at its peak" "$OUT"/profile-*.txt ;;
    quick)  # one round at the large size, to see where we stand
      timeout 300 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --no-progress \
        --modes megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse --json "$OUT/large-quick.json" \
        2>&1 | grep -v Warning | head -20 ;;
    large)
      timeout 560 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --repeat 3 --no-progress \
        --modes megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse --json "$OUT/large.json" \
        2>&1 | grep -v Warning | head -24 ;;
    mid)
      timeout 400 python3 -m megatron_ext.bench $MID --steps 10 --repeat 3 --no-progress \
        --modes megatron,blocking,capacity+equal,deep_ep,deep_ep+capacity+equal+reuse --json "$OUT/mid.json" \
        2>&1 | grep -v Warning | head -24 ;;
    factors)  # capacity factors 1.0 and 2.0, one round each (1.5 is the large run)
      for f in 1.0 2.0; do
        timeout 200 python3 -m megatron_ext.bench $LARGE --check-steps 1 --steps 5 --no-progress --capacity-factor $f \
          --modes blocking,capacity+equal,deep_ep+capacity+equal+reuse --json "$OUT/large-factor-$f.json" \
          2>&1 | grep -E "^(blocking|capacity|deep_ep)"
      done ;;
  esac
done
