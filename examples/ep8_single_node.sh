#!/usr/bin/env bash
# A GPT-MoE of 16 layers, hidden 2048, 64 experts top-8 (about 7B parameters, 1.2B active) on one
# node of 8 GPUs: expert parallel over all 8 (8 experts per GPU), the rest data parallel over the
# same 8, mock data, bf16, sequence 4096.
#
# Needs: one node with 8 CUDA GPUs (bf16, compute capability >= 8.0; about 45 GB of memory each:
# measured on one H200 with the same 8 experts per GPU, `GPUS=1 ... --num-experts 8`),
# torch and megatron-core 0.19.x, megatron-ext installed (pip install -e .). Transformer Engine,
# apex and deep_ep are optional: the flags below run without TE or apex; with deep_ep installed,
# `--moe-hybridep-implementation auto` (the default) dispatches through its HybridEP kernels.
#
# megatron-ext flags, on Megatron's HybridEP flex dispatcher:
#   --moe-hybridep-capacity-factor 1.5      capacity mode: after a calibration dispatch per layer,
#                                           no host synchronisation in any dispatch
#   --moe-hybridep-equal-token-counts       fixed micro-batch x sequence length: equal counts on
#                                           every rank, so no all-reduce to pad them
#   --moe-hybridep-reuse-allgather-buffer   one routing-map buffer instead of one per dispatch
# MODE=blocking drops the first two (Megatron's blocking dispatch): the same run otherwise, so
# the logged losses should match those of MODE=capacity (the default).
#
# Env: GPUS (default 8: the process count and the expert-parallel size; 64 must divide by it),
# MODE=capacity|blocking|stock, PRECISION=bf16|fp16 (default bf16: passes --bf16 or --fp16),
# LAYERS, GRAPHS (modes.sh), PYTHON (default: the checkout's .venv/bin/python where it exists,
# else python), DRY_RUN=1 (check the flags with Megatron's parser on any machine, no GPU:
# pretrain_moe.py --megatron-ext-dry-run).
# Extra arguments go to pretrain_moe.py after these (a later flag wins, but --fp16 and --bf16 are
# two switches: set PRECISION rather than append the other one).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The checkout's environment (.ci/setup) where there is one, as the README's setup line makes it.
[ -x "$here/../.venv/bin/python" ] && default_python=$here/../.venv/bin/python || default_python=python
PYTHON=${PYTHON:-$default_python}
source "$here/modes.sh"  # MODE, PRECISION -> mode_flags; common_flags
GPUS=${GPUS:-8}

args=(
  "${common_flags[@]}"
  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
  --seq-length 4096 --max-position-embeddings 4096
  --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 --moe-aux-loss-coeff 1e-3
  --expert-model-parallel-size "$GPUS"
  --micro-batch-size 1 --global-batch-size $((GPUS * 4))
  --use-distributed-optimizer
  "--$PRECISION" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --lr-decay-style cosine --seed 1234
  # No evaluation; megatron-core 0.19.2 still divides by --eval-interval, which has no default.
  --train-iters 50 --eval-iters 0 --eval-interval 50 --log-interval 1
)
args+=("${mode_flags[@]}" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  WORLD_SIZE=$GPUS exec "$PYTHON" "$here/pretrain_moe.py" "${args[@]}" --megatron-ext-dry-run
fi
require_gpu  # modes.sh
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" "$here/pretrain_moe.py" "${args[@]}"
