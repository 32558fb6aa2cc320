#!/usr/bin/env bash
# Start this host's ranks: launch_node.sh RANK_TABLE HOST -- COMMAND...
# RANK_TABLE lines are "RANK HOST LOCAL_RANK"; WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the
# environment. DRY_RUN=1 prints each rank's command instead of running it.
set -euo pipefail
TABLE=$1 HOST=$2; shift 2; [ "${1:-}" = -- ] && shift
: "${WORLD_SIZE:?}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}"
pids=()
while read -r rank host local; do
  [ "$host" = "$HOST" ] || continue
  envs=(RANK="$rank" LOCAL_RANK="$local" WORLD_SIZE="$WORLD_SIZE" MASTER_ADDR="$MASTER_ADDR"
        MASTER_PORT="$MASTER_PORT" CUDA_DEVICE_MAX_CONNECTIONS=1)
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "+ [$HOST] env ${envs[*]} $*"
  else
    env "${envs[@]}" "$@" & pids+=($!)
  fi
done < "$TABLE"
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
