# Sourced by demo.sh and test.sh: create or refresh .venv with the project installed.
# The CPU wheel of torch 2.13.0 is pinned first so nothing pulls a CUDA build.
# Knobs: VENV (default .venv), PYTHON (the interpreter that creates it, default python3),
# HEXISEQ_EXTRAS (setup.py extras to install, default "test").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
EXTRAS=${HEXISEQ_EXTRAS:-test}
stamp="$VENV/.hexiseq-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$EXTRAS" ]; then
  start=$SECONDS
  echo "[setup 1/3] upgrading pip in $VENV"
  "$VENV/bin/python" -m pip install --upgrade --progress-bar on pip
  echo "[setup 2/3] torch==2.13.0 (CPU build; pinned first so no dependency pulls a CUDA build)"
  "$VENV/bin/python" -m pip install --progress-bar on "torch==2.13.0"
  echo "[setup 3/3] megatron-hexiseq[$EXTRAS] and its dependencies (megatron-core, OR-Tools, Megatron-LM's own ...)"
  "$VENV/bin/python" -m pip install --progress-bar on -e "$ROOT[$EXTRAS]"
  printf '%s' "$EXTRAS" > "$stamp"
  echo "[setup] done in $((SECONDS - start)) s"
fi
export PATH="$VENV/bin:$PATH"
