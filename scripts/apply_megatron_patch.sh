#!/usr/bin/env bash
# Apply megatron-hexiseq's small patch to Megatron-LM's pretrain_gpt.py (tag core_v0.16.1).
# Usage: scripts/apply_megatron_patch.sh [--undo] MEGATRON_DIR
# The patch adds the --hexiseq-* flags (extra_args_provider, also in --help) and the layout hooks
# (model provider, forward step);
# without --hexiseq-layout the patched script behaves exactly like the original.
# Idempotent: says so and exits 0 when the patch is already in place.
set -euo pipefail
PATCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/patches/megatron-lm-core_v0.16.1.patch"
UNDO=0
if [ "${1:-}" = --undo ]; then UNDO=1; shift; fi
DIR=${1:-}
if [ -z "$DIR" ] || [ ! -f "$DIR/pretrain_gpt.py" ]; then
  echo "error: usage: $0 MEGATRON_DIR (a Megatron-LM checkout at tag core_v0.16.1 containing pretrain_gpt.py)" >&2
  exit 2
fi
cd "$DIR"
# git apply inside a folder of some other repository (a snapshot unpacked into a project) would
# apply paths relative to that repository and skip ours: look for a repository in DIR only.
export GIT_CEILING_DIRECTORIES=$(dirname "$PWD")
if [ "$UNDO" = 1 ]; then
  git apply --reverse --check "$PATCH" 2>/dev/null \
    || { echo "error: $DIR/pretrain_gpt.py does not hold this patch; nothing to undo" >&2; exit 2; }
  git apply --reverse "$PATCH"
  echo "removed the megatron-hexiseq hooks from $DIR/pretrain_gpt.py"
  exit 0
fi
if git apply --reverse --check "$PATCH" 2>/dev/null; then
  echo "already applied: $DIR/pretrain_gpt.py has the megatron-hexiseq hooks; nothing to do"
  exit 0
fi
if ! git apply --check "$PATCH" 2>/dev/null; then
  echo "error: the patch does not apply to $DIR/pretrain_gpt.py (expected Megatron-LM tag core_v0.16.1;" \
       "check 'git -C $DIR describe --tags'); without patching, run: python -m megatron_hexiseq.pretrain_gpt" >&2
  exit 2
fi
git apply "$PATCH"
echo "patched $DIR/pretrain_gpt.py with $PATCH:"
git apply --stat "$PATCH" | sed 's/^/  /'
echo "  + import of megatron_hexiseq.megatron.plugin"
echo "  + hexiseq.help_with_hexiseq_flags(...) before inprocess_restart (--help lists the --hexiseq-* flags)"
echo "  + pretrain(hexiseq.model_provider(...), ..., hexiseq.forward_step(forward_step), ..., extra_args_provider=hexiseq.extra_args_provider(...))"
echo "undo with: $0 --undo $DIR"
