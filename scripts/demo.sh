#!/usr/bin/env bash
# The main job: set-up, then on the heterogeneous CPU testbed
#   profile (measured cluster spec) -> plan (HexiSeq layout + symmetric baselines)
#   -> train a small Megatron GPT twice (best symmetric layout, HexiSeq layout) -> table + JSON + PNG.
# Creates/refreshes .venv on first use. Knobs: TESTBED (ranks per core), STEPS, SEQ, MODEL.
# PACKED=1: packed documents (DOCS, default ../shared/data/doc_lengths_prolong.json): train the
# THD-style even split, the fixed HexiSeq layout and per-micro-batch layouts on the same micro-batches.
# Every knob is checked before the set-up and the 30-s profile (one line, exit 2): PACKED 0 or 1,
# STEPS and SEQ positive integers, with PACKED=1 the DOCS file (varlen.packing.load_doc_lengths);
# TESTBED and MODEL are profile's first checks.
# JOB=1: plan a whole job (GLOBAL_BATCH sequences per step, default 12; testbed default 1+3) and train
# it, one HexiSeq domain over every rank and equal-share data parallelism, from the same weights.
set -euo pipefail
JOB=${JOB:-0}
GLOBAL_BATCH=${GLOBAL_BATCH:-12}
SEQ=${SEQ:-2048}
MODEL=${MODEL:-examples/models/cpu-demo.yaml}
OUT=${OUT:-results}
PACKED=${PACKED:-0}
DOCS=${DOCS:-../shared/data/doc_lengths_prolong.json}
knob_error() { printf 'error: %s\n' "$1" >&2; exit 2; }
shown() { local v=${1:0:60}; v=${v//[[:cntrl:]]/ }; printf "'%s'" "$v"; }  # quoted, cut short
check_bool() { case $2 in 0|1) ;; *) knob_error "$1 must be 0 or 1, got $(shown "$2")" ;; esac; }
check_count() { [[ $2 =~ ^[1-9][0-9]{0,8}$ ]] || knob_error "$1 must be a positive integer, got $(shown "$2")"; }
check_bool PACKED "$PACKED"
check_bool JOB "$JOB"
check_count GLOBAL_BATCH "$GLOBAL_BATCH"
[ "$JOB" = 1 ] && [ "$PACKED" = 1 ] && knob_error "JOB=1 and PACKED=1 are separate demos: set one of them"
if [ "$JOB" = 1 ]; then TESTBED=${TESTBED:-1+3} STEPS=${STEPS:-12}; else TESTBED=${TESTBED:-1+2}; fi
STEPS=${STEPS:-30}
check_count STEPS "$STEPS"
check_count SEQ "$SEQ"
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
if [ "$PACKED" = 1 ]; then  # the document lengths: a bad file is one line now, not after profile and plan
  python -c 'import sys
from megatron_hexiseq.errors import run_user_command
from megatron_hexiseq.varlen.packing import load_doc_lengths
sys.exit(run_user_command(lambda: load_doc_lengths(sys.argv[1]) and 0))' "$DOCS" || exit $?
fi
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore  # Megatron warns about Apex/TE absence on every rank; nothing to act on
echo "== 1/3 profile the testbed ($TESTBED ranks per core), calibrated with the model's own layer shapes"
megatron-hexiseq profile --testbed "$TESTBED" --memory-gib 4 --model-config "$MODEL" -o "$OUT/cluster.yaml"
if [ "$JOB" = 1 ]; then
  echo "== 2/3 plan the job: $GLOBAL_BATCH sequences of $SEQ tokens per step"
  megatron-hexiseq plan --cluster "$OUT/cluster.yaml" --model-config "$MODEL" --seq-length "$SEQ" \
    --global-batch "$GLOBAL_BATCH" -o "$OUT/job.json"
  echo "== 3/3 train three times: the job, one HexiSeq domain over every rank, equal-share data parallelism"
  python -m megatron_hexiseq.testbed.job_demo --job "$OUT/job.json" --testbed "$TESTBED" --steps "$STEPS" \
    -o "$OUT/job_demo.json" --markdown "$OUT/job_demo.md" --plot "$OUT/job_demo.png"
  exit
fi
echo "== 2/3 plan"
megatron-hexiseq plan --cluster "$OUT/cluster.yaml" --model-config "$MODEL" --seq-length "$SEQ" -o "$OUT/layout.json"
if [ "$PACKED" = 1 ]; then
  echo "== 3/3 train three times on packed documents: THD-style even split, fixed HexiSeq layout, per-micro-batch layouts"
  python -m megatron_hexiseq.testbed.demo --cluster "$OUT/cluster.yaml" --layout "$OUT/layout.json" \
    --model-config "$MODEL" --testbed "$TESTBED" --steps "$STEPS" --packed "$DOCS" \
    -o "$OUT/demo_packed.json" --plot "$OUT/demo_packed.png"
else
  echo "== 3/3 train twice: best symmetric layout vs HexiSeq layout"
  python -m megatron_hexiseq.testbed.demo --cluster "$OUT/cluster.yaml" --layout "$OUT/layout.json" \
    --model-config "$MODEL" --testbed "$TESTBED" --steps "$STEPS" -o "$OUT/demo.json" --plot "$OUT/demo.png"
fi
