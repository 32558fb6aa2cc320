#!/usr/bin/env bash
# The main job. Creates/refreshes .venv on first use.
# For now: plan a layout for the bundled example cluster and show it.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
mkdir -p results
megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --model gpt-7b \
  --seq-length 131072 -o results/layout.json
megatron-hexiseq show results/layout.json
