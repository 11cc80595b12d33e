#!/usr/bin/env bash
# Smoke test: a small GPT-MoE (4 layers, hidden 512, 8 experts, top-2) trains 10 iterations on
# one GPU, mock data, bf16, the loss logged every iteration.
#
# Needs: one CUDA GPU (bf16; grouped GEMMs want compute capability >= 8.0), torch and
# megatron-core 0.19.x, megatron-ext installed (pip install -e .). Transformer Engine's layers where
# TE imports, else Megatron's local ones, with no need of TE or apex (LAYERS, in modes.sh). deep_ep
# is optional (the dispatch runs on megatron-ext's torch buffer without it).
#
# The fastest path where TE is installed: GRAPHS=te (TE's per-layer CUDA graphs; an overflow then
# stops at the device's assert); GRAPHS=full graphs the whole step (modes.sh).
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
# Env: MODE=capacity|blocking|stock, PRECISION=bf16|fp16 (default bf16: passes --bf16 or --fp16),
# LAYERS=te|local|auto, GRAPHS=none|te|full, PYTHON (default: the checkout's .venv/bin/python where
# it exists, else python), DRY_RUN=1 (check the flags with Megatron's parser on any machine, no GPU:
# pretrain_moe.py --megatron-ext-dry-run). Extra arguments go to pretrain_moe.py after these (a
# later flag wins, but --fp16 and --bf16 are two switches: set PRECISION rather than append the
# other one).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The checkout's environment (.ci/setup) where there is one, as the README's setup line makes it.
[ -x "$here/../.venv/bin/python" ] && default_python=$here/../.venv/bin/python || default_python=python
PYTHON=${PYTHON:-$default_python}
source "$here/modes.sh"  # MODE, PRECISION -> mode_flags; common_flags

args=(
  "${common_flags[@]}"
  --num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048
  --seq-length 512 --max-position-embeddings 512
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --moe-aux-loss-coeff 1e-2
  --micro-batch-size 2 --global-batch-size 2
  "--$PRECISION" --lr 1e-4 --lr-decay-style constant --seed 1234
  # No evaluation; megatron-core 0.19.2 still divides by --eval-interval, which has no default.
  --train-iters 10 --eval-iters 0 --eval-interval 10 --log-interval 1
)
args+=("${mode_flags[@]}" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  WORLD_SIZE=1 exec "$PYTHON" "$here/pretrain_moe.py" "${args[@]}" --megatron-ext-dry-run
fi
require_gpu  # modes.sh
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 "$here/pretrain_moe.py" "${args[@]}"
