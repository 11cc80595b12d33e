#!/usr/bin/env bash
# smoke_1gpu.sh's model (4 layers, hidden 512, 8 experts top-2, seq 512) with expert parallelism
# over RANKS ranks, and pipeline parallelism with PP: a small run that checks a parallel layout,
# 10 iterations.
#
# One rank per GPU over NCCL (RANKS GPUs), or, with RANKS_PER_GPU > 1, RANKS_PER_GPU ranks sharing
# each GPU over gloo: NCCL refuses two ranks on one GPU, so gloo moves the tokens, staging CUDA
# tensors through host memory. That is a rehearsal of expert parallelism on fewer GPUs (one is
# enough): every kernel and layout of RANKS ranks runs, and the losses of MODE=capacity and
# MODE=blocking can be compared (examples/compare_modes.py), but it measures no speed. Shared ranks
# start through `python -m megatron_ext.tooling.shared_gpu`, which points each rank at its GPU and
# stands in what gloo lacks on CUDA tensors (point-to-point between pipeline stages, an averaging
# all-reduce).
#
# Needs: CUDA GPUs (bf16, compute capability >= 8.0), torch, megatron-core 0.19.x and megatron-ext
# installed; no Transformer Engine or apex (as smoke_1gpu.sh).
#
# Env: RANKS (default 2: processes, one per GPU unless RANKS_PER_GPU), RANKS_PER_GPU (default 1), PP
# (default 1: pipeline stages; the expert-parallel size is RANKS / PP), VPP (default 1: virtual
# stages per pipeline rank, the interleaved schedule; the 4 layers must divide by PP x VPP),
# MODE=capacity|blocking|stock, PRECISION=bf16|fp16, LAYERS, GRAPHS (modes.sh; none where GPUs are
# shared), PYTHON, DRY_RUN=1 (check the flags with Megatron's parser on any machine: pretrain_moe.py
# --megatron-ext-dry-run). Extra arguments go to
# pretrain_moe.py after these.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -x "$here/../.venv/bin/python" ] && default_python=$here/../.venv/bin/python || default_python=python
PYTHON=${PYTHON:-$default_python}
source "$here/modes.sh"  # MODE, PRECISION -> mode_flags; common_flags
RANKS=${RANKS:-2} RANKS_PER_GPU=${RANKS_PER_GPU:-1} PP=${PP:-1} VPP=${VPP:-1}
for name in RANKS RANKS_PER_GPU PP VPP; do
  [[ ${!name} =~ ^[1-9][0-9]*$ ]] || { echo "$name must be a positive integer, not '${!name}'" >&2; exit 2; }
done
if ((RANKS % PP)); then
  echo "RANKS=$RANKS is not a multiple of PP=$PP (the expert-parallel size is RANKS / PP)" >&2; exit 2
fi
if ((4 % (PP * VPP))); then
  echo "PP=$PP x VPP=$VPP must divide the model's 4 layers" >&2; exit 2
fi
EP=$((RANKS / PP))
micro_batches=$((PP > 1 ? 4 * PP : 1))  # enough micro-batches to fill the pipeline

backend=nccl launcher=()
if ((RANKS_PER_GPU > 1)); then
  if [ "$GRAPHS" != none ]; then
    echo "GRAPHS=$GRAPHS needs one rank per GPU: ranks sharing a GPU meet over gloo, whose collectives cannot be captured; use GRAPHS=none" >&2
    exit 2
  fi
  backend=gloo launcher=(-m megatron_ext.tooling.shared_gpu --ranks-per-gpu "$RANKS_PER_GPU")
fi

args=(
  "${common_flags[@]}"
  --distributed-backend "$backend"
  --num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048
  --seq-length 512 --max-position-embeddings 512
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --moe-aux-loss-coeff 1e-2
  --expert-model-parallel-size "$EP" --pipeline-model-parallel-size "$PP"
  --micro-batch-size 2 --global-batch-size $((2 * EP * micro_batches))
  "--$PRECISION" --lr 1e-4 --lr-decay-style constant --seed 1234
  --train-iters 10 --eval-iters 0 --eval-interval 10 --log-interval 1
)
((VPP > 1)) && args+=(--num-layers-per-virtual-pipeline-stage $((4 / (PP * VPP))))
args+=("${mode_flags[@]}" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  WORLD_SIZE=$RANKS exec "$PYTHON" "$here/pretrain_moe.py" "${args[@]}" --megatron-ext-dry-run
fi
require_gpu  # modes.sh
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$RANKS" "${launcher[@]}" \
  "$here/pretrain_moe.py" "${args[@]}"
