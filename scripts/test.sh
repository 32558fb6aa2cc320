#!/usr/bin/env bash
# Run the whole test suite (CPU only). Creates/refreshes .venv on first use.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k layout -x
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider "$@" tests
