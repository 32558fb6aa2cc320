#!/usr/bin/env bash
# GPU acceptance check of HexiSeq on ONE GPU (<= 4 minutes on an H200, --self-test included); see
# docs/gpu.md and bench/gpu_check.py. Parts: (1) HexiSeq attention over simulated ranks on CUDA
# tensors vs float64, (2) tests/test_attention_gpu.py + tests/test_attention_sim_device.py, (3) a
# megatron-core GPT, HexiSeq vs stock Megatron, each layer's attention output and every gradient in
# bf16, (4) attention memory linear in S, (5) tokens/s vs torch SDPA. --self-test reruns every part
# with attention broken on purpose and fails unless every part catches every break.
# Writes $GPU_CHECK_OUT/gpu_check.{json,md} (default results/gpu_check) plus the pytest logs, prints
# a pass/fail table last, exits 1 if a part fails (2 on bad arguments).
#   scripts/gpu_check.sh [--self-test] [--quick] [--parts ranks,pytest,...]
#   scripts/gpu_check.sh --device cpu --quick --self-test     # CPU stand-ins (no GPU needed)
# Needs torch, megatron-core and this package's pure-Python deps (PyYAML, jsonschema): on a machine
# without network, put their wheels in .whl/ and they are installed to a temp folder (only when
# megatron-core is not importable already, so a prepared environment is used as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-results/gpu_check}
LIMIT_S=${GPU_CHECK_TIMEOUT:-420}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import megatron.core" 2>/dev/null; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# a hang (a simulated rank waiting for ever) must not eat the GPU time: stop after LIMIT_S seconds
exec timeout -k 10 "$LIMIT_S" "$PY" -W ignore bench/gpu_check.py --out "$OUT_DIR" "$@"
