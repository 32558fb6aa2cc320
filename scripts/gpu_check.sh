#!/usr/bin/env bash
# GPU acceptance check of HexiSeq on ONE GPU; see docs/gpu.md and scripts/gpu_check/ (the Python
# package it runs: python -m gpu_check). Parts, in this order (the two never yet run on a GPU
# first): (1) efficient: the memory-efficient kernel's GQA calls over simulated ranks vs float64,
# (2) documents: packed documents (random boundaries, unaligned head ranges, every kernel auto can
# pick, bf16/fp16) vs the float64 document-masked reference, (3) batch_layouts: per-micro-batch
# layouts on one set of groups, (4) ranks: every other kernel, (5) pytest: the GPU tests and their
# CPU twins, (6) megatron: a megatron-core GPT, HexiSeq vs stock Megatron, each layer's attention
# and every gradient in bf16, with and without documents, (7) memory: linear in S, the packed path
# within 10% of the dense one, (8) throughput: tokens/s vs torch SDPA. --self-test reruns every part
# under five breaks of attention (zeros, a dropped received block, a wrong head map, a dropped
# document window, a wrong document boundary) and fails unless every part catches every break.
# Writes $GPU_CHECK_OUT/gpu_check.{json,md} (default results/gpu_check) plus the pytest logs, prints
# a pass/fail table last, exits 1 if a part fails (2 on bad arguments or settings, one error: line).
#   scripts/gpu_check.sh [--self-test] [--quick] [--parts documents,ranks,...] [--budget-s S]
#   scripts/gpu_check.sh --device cpu --quick --self-test     # CPU stand-ins (no GPU needed)
#   GPU_CHECK_OUT=/tmp/gc GPU_CHECK_TIMEOUT=540 scripts/gpu_check.sh --self-test
# Needs torch, megatron-core and this package's pure-Python deps (PyYAML, jsonschema): on a machine
# without network, put their wheels in .whl/ and they are installed to a temp folder (only when
# megatron-core is not importable already, so a prepared environment is used as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-results/gpu_check}
LIMIT_S=${GPU_CHECK_TIMEOUT:-540}
case "$LIMIT_S" in
  ''|*[!0-9]*|0*) echo "error: GPU_CHECK_TIMEOUT must be a whole number of seconds above 0, got '${LIMIT_S:0:40}'" >&2; exit 2 ;;
esac
if [ "${#LIMIT_S}" -gt 7 ]; then
  echo "error: GPU_CHECK_TIMEOUT must be at most 9999999 seconds, got ${LIMIT_S:0:40}..." >&2; exit 2
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import megatron.core" 2>/dev/null; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# a hang (a simulated rank waiting for ever) must not eat the GPU time: stop after LIMIT_S seconds
exec timeout -k 10 "$LIMIT_S" "$PY" -W ignore -m gpu_check --out "$OUT_DIR" "$@"
