#!/usr/bin/env bash
# GPU acceptance check of HexiSeq on 2+ GPUs of one node (torchrun, NCCL); see docs/gpu.md and
# scripts/gpu_check/multi.py (python -m gpu_check.multi). Parts:
#   attention  fwd/bwd of HexiSeq attention vs float64 on random uneven layouts of all GPUs (bf16,
#              fp16, comm_chunks 1-3), then 200 iterations whose CUDA memory must stay steady;
#   pretrain   (4+ GPUs, even; Megatron-LM + Transformer Engine) pretrain_gpt.py in bf16 with the TE
#              layer spec, 2 data-parallel replicas: stock Megatron CP, stock without CP (the
#              yardstick) and HexiSeq on an uneven layout, 50 steps on the same mock data; lm loss and
#              grad norm per step compared.
# Every torchrun is killed after HANG_TIMEOUT seconds (and NCCL's own timeout is the same), so a
# hang ends as a failure. Writes $GPU_CHECK_OUT (default results/gpu_check_multi): attention.json,
# pretrain.json, the runs' logs and gpu_check_multi.md; prints the table last; exits 1 on a failure.
#   scripts/gpu_check_multi.sh                  # all GPUs of this node
#   NPROC=2 scripts/gpu_check_multi.sh          # the attention part on 2 GPUs
#   MEGATRON_LM=~/Megatron-LM scripts/gpu_check_multi.sh --dry-run   # print the pretrain commands
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-results/gpu_check_multi}
HANG_TIMEOUT=${HANG_TIMEOUT:-900}
MEGATRON_LM=${MEGATRON_LM:-Megatron-LM}
DEVICE=${DEVICE:-cuda}            # cpu: gloo processes on CPU tensors (a smoke test of the script)
ITERS=${ITERS:-200}
STEPS=${STEPS:-50}
DRY_RUN=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "gpu_check_multi: unknown argument '$arg' (the only one is --dry-run; settings are environment variables, see the header)" >&2; exit 2 ;;
  esac
done
if [ -z "${NPROC:-}" ]; then
  if [ "$DEVICE" = cpu ]; then NPROC=2
  else NPROC=$("$PY" -c "import torch; print(torch.cuda.device_count())"); fi
fi
case "$NPROC" in ''|*[!0-9]*) echo "gpu_check_multi: NPROC must be a number, got '$NPROC'" >&2; exit 2 ;; esac
if [ "$NPROC" -lt 2 ]; then
  echo "gpu_check_multi: needs 2+ GPUs, found $NPROC; on one GPU run scripts/gpu_check.sh" >&2; exit 2
fi
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
mkdir -p "$OUT_DIR"
parts=attention
if [ "$NPROC" -ge 4 ] && [ $((NPROC % 2)) -eq 0 ] && [ "$DEVICE" = cuda ]; then
  parts=attention,pretrain
else
  echo "gpu_check_multi: the pretrain part needs an even number >= 4 of GPUs (2 replicas x CP >= 2); running the attention part only"
fi
if [ -n "$DRY_RUN" ]; then
  echo "# attention ($NPROC processes)"
  echo "timeout -k 30 $HANG_TIMEOUT $PY -m torch.distributed.run --standalone --nproc-per-node $NPROC -m gpu_check.multi attention --device $DEVICE --iters $ITERS --out $OUT_DIR --hang-timeout $HANG_TIMEOUT"
  if [ "$parts" = attention,pretrain ]; then
    "$PY" -m gpu_check.multi pretrain --nproc "$NPROC" --megatron-lm "$MEGATRON_LM" \
      --steps "$STEPS" --out "$OUT_DIR" --hang-timeout "$HANG_TIMEOUT" --dry-run
  fi
  exit 0
fi
rm -f "$OUT_DIR/attention.json" "$OUT_DIR/pretrain.json"
timeout -k 30 "$HANG_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m gpu_check.multi attention --device "$DEVICE" --iters "$ITERS" --out "$OUT_DIR" \
  --hang-timeout "$HANG_TIMEOUT" > "$OUT_DIR/attention.log" 2>&1 \
  || echo "gpu_check_multi: the attention part failed or timed out (see $OUT_DIR/attention.log)"
tail -n 3 "$OUT_DIR/attention.log"
if [ "$parts" = attention,pretrain ]; then
  "$PY" -m gpu_check.multi pretrain --nproc "$NPROC" --megatron-lm "$MEGATRON_LM" \
    --steps "$STEPS" --out "$OUT_DIR" --hang-timeout "$HANG_TIMEOUT" || true
fi
echo
exec "$PY" -m gpu_check.multi report --out "$OUT_DIR" --parts "$parts"
