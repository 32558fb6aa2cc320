# Sourced by demo.sh and test.sh: create or refresh .venv with the project installed.
# The CPU wheel of torch 2.13.0 is pinned first so nothing pulls a CUDA build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.hexiseq-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ]; then
  echo "[setup] installing dependencies into $VENV (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
