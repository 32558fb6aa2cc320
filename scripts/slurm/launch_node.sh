#!/usr/bin/env bash
# Start this host's ranks: launch_node.sh RANK_TABLE HOST -- COMMAND...
# RANK_TABLE lines are "RANK HOST LOCAL_RANK"; WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the
# environment. DRY_RUN=1 prints each rank's command instead of running it, every word shell-quoted
# (printf %q), so a printed line pasted into a shell runs the same words.
#
# CUDA_DEVICE_MAX_CONNECTIONS follows the memory mode in COMMAND's flags (the layout's
# megatron_flags, or the user's own): Megatron-LM's validate_args (core_v0.16.1) requires 1 with
# context or tensor parallelism before Blackwell, and refuses 1 with --use-megatron-fsdp or
# --use-torch-fsdp2. Those runs get 8, CUDA's default, set explicitly so that a 1 exported in the
# submitting shell (srun --export=ALL) cannot reach them.
set -euo pipefail
TABLE=$1 HOST=$2; shift 2; [ "${1:-}" = -- ] && shift
: "${WORLD_SIZE:?}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}"
connections=1
for arg in "$@"; do
  case $arg in --use-megatron-fsdp|--use-torch-fsdp2) connections=8 ;; esac
done
pids=()
while read -r rank host local; do
  [ "$host" = "$HOST" ] || continue
  envs=(RANK="$rank" LOCAL_RANK="$local" WORLD_SIZE="$WORLD_SIZE" MASTER_ADDR="$MASTER_ADDR"
        MASTER_PORT="$MASTER_PORT" CUDA_DEVICE_MAX_CONNECTIONS="$connections")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '+ [%s] env' "$HOST"; printf ' %q' "${envs[@]}" "$@"; printf '\n'  # each word quoted
  else
    env "${envs[@]}" "$@" & pids+=($!)
  fi
done < "$TABLE"
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
