#!/usr/bin/env bash
# GPU acceptance check of the attention runtime on ONE GPU (<= 10 minutes), see bench/gpu_check.py:
#   kernels vs the float64 oracle in bf16 on blocks cut from random layouts; peak memory of local
#   and received blocks at 8K-32K tokens (must grow like S, not S^2); a world-of-1 megatron-core GPT,
#   stock vs HexiSeq, bf16, equal losses; tokens/s of HexiSeq vs torch SDPA on the same tokens.
# Writes $GPU_CHECK_OUT/gpu_check.{json,md} (default results/gpu_check) and exits 1 if a part fails.
# Needs torch with CUDA, megatron-core and this package's pure-Python deps (PyYAML, jsonschema):
# on a machine without network, put their wheels in .whl/ and they are installed to a temp folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-results/gpu_check}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU visible to torch')"
exec timeout 600 "$PY" -W ignore bench/gpu_check.py --out "$OUT_DIR" "$@"
