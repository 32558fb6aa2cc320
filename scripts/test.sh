#!/usr/bin/env bash
# The test suite (CPU only): ./scripts/test.sh [PYTEST ARGS...]
# Without arguments: the whole suite (tests/). With arguments: exactly those paths and options,
# e.g. ./scripts/test.sh tests/test_layout.py -x; options alone (-k layout) still run tests/.
# Creates/refreshes .venv on first use (scripts/_venv.sh). The real-Megatron-LM tests use the
# Megatron-LM snapshot: MEGATRON_LM (a core_v0.16.1 checkout) if set, else MEGATRON_LM_TARBALL
# (default ../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz, relative to the repository root),
# unpacked into the git-ignored .megatron-lm/ (again only when it is missing or the tarball changed).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
if [ -z "${MEGATRON_LM:-}" ]; then
  tarball=${MEGATRON_LM_TARBALL:-../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz}
  if [ -f "$tarball" ]; then
    dest=$ROOT/.megatron-lm
    sum=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ ! -f "$dest/Megatron-LM/pretrain_gpt.py" ] || [ "$(cat "$dest/.sha256" 2>/dev/null)" != "$sum" ]; then
      echo "[test] unpacking $tarball into .megatron-lm/"
      rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
      tar -xzf "$tarball" -C "$dest.tmp"
      printf '%s' "$sum" > "$dest.tmp/.sha256"
      rm -rf "$dest" && mv "$dest.tmp" "$dest"
    fi
    export MEGATRON_LM=$dest/Megatron-LM
  else
    echo "[test] MEGATRON_LM is unset and $tarball does not exist: the real-Megatron-LM tests" \
         "(tests/test_megatron_lm.py, the real-patch test) will skip"
  fi
fi
paths=0
for a in "$@"; do
  case $a in -*) ;; *) [ -e "${a%%::*}" ] && paths=1 ;; esac
done
[ "$paths" = 1 ] || set -- "$@" tests
[ "${HEXISEQ_LINT:-1}" = 0 ] || "$ROOT/scripts/lint.sh"  # HEXISEQ_LINT=0 skips it
# HEXISEQ_TEST_WORKERS pytest-xdist workers (default 2, the CI machine's cores; 0 = one process);
# an -n among the arguments wins (it comes later)
exec python -m pytest -q -p no:cacheprovider -n "${HEXISEQ_TEST_WORKERS:-2}" "$@"
