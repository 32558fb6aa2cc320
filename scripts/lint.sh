#!/usr/bin/env bash
# Lint, format check and type check: ./scripts/lint.sh
# ruff check (pyproject.toml [tool.ruff.lint]) and ruff format --check over the repository, mypy
# ([tool.mypy]) over the library megatron_hexiseq/. Runs all three, prints one summary line per
# step and exits 1 if any failed. scripts/test.sh runs it before pytest. Uses the tools pinned in
# setup.py's `test` extra, from .venv (created or refreshed by scripts/_venv.sh like test.sh does).
# Fix most findings with: ruff format . && ruff check --fix .
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
failed=()
step() {
  local name=$1; shift
  echo "[lint] $name: $*"
  if "$@"; then echo "[lint] $name: ok"; else echo "[lint] $name: FAILED"; failed+=("$name"); fi
}
step "ruff check" ruff check --output-format concise .
step "ruff format" ruff format --check --output-format concise .
step "mypy" mypy
if [ ${#failed[@]} -gt 0 ]; then
  echo "[lint] failed: ${failed[*]} (\`ruff format . && ruff check --fix .\` fixes most of ruff's)"
  exit 1
fi
echo "[lint] all passed"
