# Sourced by the example launch scripts (smoke_1gpu.sh, ep8_single_node.sh, slurm_multinode.sbatch):
# reads MODE, PRECISION and CAPACITY_FACTOR, refuses other values (exit 2), and sets
#   mode_flags: what MODE adds to Megatron's flags
#     capacity (default): --moe-hybridep-capacity-factor $CAPACITY_FACTOR (default 1.5)
#                         --moe-hybridep-equal-token-counts
#     blocking: nothing (Megatron's blocking dispatch, the same run otherwise)
#     stock: Megatron's own all-to-all dispatcher, none of megatron-ext's flags (the same model and
#            experts: what a user runs before turning megatron-ext on)
#     stock-hybridep: Megatron's own flex dispatcher on DeepEP's HybridEP, none of megatron-ext's
#            flags (Megatron's manager runs it where deep_ep imports; elsewhere megatron-ext's torch
#            implementation stands in, which is then no stock run)
#   PRECISION: bf16 (default) or fp16; a script passes --$PRECISION. fp16 with MODE=capacity needs
#     TE's op-fuser experts (megatron-ext's own compute in bf16 on a GPU; the parse says so).
#   common_flags: the flags of both modes that every launch script passes; a script adds its
#     model's sizes and experts, its parallelism, batch, precision, schedule and iterations.
#   LAYERS: te, local or auto (default): te is Transformer Engine's layers with the fusions TE provides
#     (fused attention and rope; the weight gradients' accumulation into the main gradients only
#     where apex's extension imports, which Megatron's output layer needs for it; Megatron's
#     optimizer is then TE's FusedAdam), what users train with; local is Megatron's own layers
#     without TE or apex (the --no-... flags below switch off what would need them); auto is te
#     where `import transformer_engine.pytorch` works with $PYTHON, else local.
#   GRAPHS: none (default), te or full: CUDA graphs for MODE=capacity (Megatron's own dispatchers take
#     their own flags). te: Transformer Engine's per-layer graphs of whole layers (--cuda-graph-impl
#     transformer_engine), the fastest path where TE is installed; needs LAYERS=te; the graphs are
#     captured once, so an overflow stops at the device's assert (--moe-hybridep-overflow-policy
#     fail) instead of re-running the step. full: graphs of the whole step (--cuda-graph-impl
#     full_iteration --no-check-for-nan-in-loss-and-grad: Megatron's NaN check reads the host).
#     Either needs one rank per GPU (collectives over gloo cannot be captured).
#   KERNEL_CACHE: where deep_ep's compiled kernels are kept for the next job
#     (--moe-hybridep-kernel-cache; default ${XDG_CACHE_HOME:-~/.cache}/megatron-ext/hybrid-ep-kernels,
#     on a disk the job's nodes share where they have one; KERNEL_CACHE= keeps none).
# and defines require_gpu, which a script calls before it starts torchrun.
MODE=${MODE:-capacity}
PRECISION=${PRECISION:-bf16}
CAPACITY_FACTOR=${CAPACITY_FACTOR:-1.5}
case $MODE in
  capacity) mode_flags=(--moe-hybridep-capacity-factor "$CAPACITY_FACTOR" --moe-hybridep-equal-token-counts) ;;
  blocking) mode_flags=() ;;
  stock | stock-hybridep) mode_flags=() ;;
  *) echo "MODE must be capacity, blocking, stock or stock-hybridep, not '$MODE'" >&2; exit 2 ;;
esac
# The dispatcher: Megatron's HybridEP flex dispatcher (megatron-ext's), or for stock its all-to-all.
if [ "$MODE" = stock ]; then
  dispatcher_flags=(--moe-token-dispatcher-type alltoall)
elif [ "$MODE" = stock-hybridep ]; then
  dispatcher_flags=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep)
else
  dispatcher_flags=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-hybridep-reuse-allgather-buffer)
fi
case $PRECISION in
  bf16 | fp16) ;;
  *) echo "PRECISION must be bf16 or fp16, not '$PRECISION'" >&2; exit 2 ;;
esac
# A launch script calls this before torchrun: where no CUDA GPU is visible, one line and exit status
# 2, rather than every rank failing in Megatron's first question to the GPU inside torchrun's report.
require_gpu() {
  local status=0
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null || status=$?
  if ((status == 3)); then
    echo "$(basename "$0"): error: training needs a CUDA GPU and none is visible here; DRY_RUN=1 checks the flags on any machine" >&2
    exit 2
  fi
}
LAYERS=${LAYERS:-auto}
if [ "$LAYERS" = auto ]; then
  LAYERS=local
  [ "$("${PYTHON:-python}" -c 'import transformer_engine.pytorch; print("te")' 2>/dev/null)" = te ] && LAYERS=te
fi
case $LAYERS in
  te) layer_flags=(--transformer-impl transformer_engine)
    # Megatron's own output layer accumulates its weight gradient through apex's extension alone.
    "${PYTHON:-python}" -c 'import fused_weight_gradient_mlp_cuda' >/dev/null 2>&1 ||
      layer_flags+=(--no-gradient-accumulation-fusion) ;;
  # Without TE, apex or Megatron's CUDA extensions: the fused wgrad accumulation, masked softmax and
  # rope kernels are missing, and torch's norm refuses the persistent layer norm.
  local) layer_flags=(--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --no-persist-layer-norm --no-rope-fusion) ;;
  *) echo "LAYERS must be te, local or auto, not '$LAYERS'" >&2; exit 2 ;;
esac
GRAPHS=${GRAPHS:-none}
case $GRAPHS in
  none) ;;
  te | full)
    if [ "$MODE" != capacity ]; then
      echo "GRAPHS=$GRAPHS needs MODE=capacity (this is MODE=$MODE, whose dispatch reads the host); use GRAPHS=none" >&2
      exit 2
    fi
    if [ "$GRAPHS" = te ]; then
      if [ "$LAYERS" != te ]; then
        echo "GRAPHS=te needs Transformer Engine's layers (LAYERS=te; this is LAYERS=$LAYERS): install TE or use GRAPHS=full" >&2
        exit 2
      fi
      mode_flags+=(--cuda-graph-impl transformer_engine --moe-hybridep-overflow-policy fail)
    else
      mode_flags+=(--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad)
    fi ;;
  *) echo "GRAPHS must be none, te or full, not '$GRAPHS'" >&2; exit 2 ;;
esac
common_flags=(
  "${layer_flags[@]}"
  --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0
  --moe-grouped-gemm --moe-router-load-balancing-type aux_loss
  "${dispatcher_flags[@]}"
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  # Causal attention builds its own mask (TE's reads none): no [seq, seq] mask made and copied per sample.
  --no-create-attention-mask-in-dataloader
)
KERNEL_CACHE=${KERNEL_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-ext/hybrid-ep-kernels}
if [ -n "$KERNEL_CACHE" ] && [ "$MODE" != stock ] && [ "$MODE" != stock-hybridep ]; then common_flags+=(--moe-hybridep-kernel-cache "$KERNEL_CACHE"); fi
