#!/usr/bin/env bash
# Multi-node run without a scheduler: ssh to each host and start one process per host.
#
#   HOSTS="gpu-a gpu-b" launch/multinode.sh --config=configs/sage.py:qwen2.5-7b \
#       --workdir=/shared/runs/sage7b [--config.key=value ...]
#
# The first host runs the JAX coordinator. Every host needs the code at SAGE_JAX_DIR (default:
# this checkout's path) with its venv in .venv, and the workdir on a shared filesystem or in a
# bucket every host reaches (--workdir=gs://bucket/run).
# Logs: $SAGE_JAX_DIR/logs/<host>.log on each host. DRY_RUN=1 prints the ssh commands.
set -euo pipefail

if [[ -z "${HOSTS:-}" ]]; then
  echo "multinode.sh: set HOSTS to the space-separated host names" >&2
  exit 2
fi
read -r -a hosts <<< "$HOSTS"
SAGE_JAX_DIR="${SAGE_JAX_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
SAGE_JAX_MODULE="${SAGE_JAX_MODULE:-sage_jax.train}"
COORDINATOR_PORT="${COORDINATOR_PORT:-12345}"
coordinator="${hosts[0]}:$COORDINATOR_PORT"
args="$(printf '%q ' "$@")"

pids=()
for i in "${!hosts[@]}"; do
  host="${hosts[$i]}"
  remote="cd $(printf '%q' "$SAGE_JAX_DIR") && mkdir -p logs && . .venv/bin/activate && \
JAX_COORDINATOR_ADDRESS=$coordinator JAX_NUM_PROCESSES=${#hosts[@]} JAX_PROCESS_ID=$i \
python -m $SAGE_JAX_MODULE $args > logs/$host.log 2>&1"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf 'ssh %q %q\n' "$host" "$remote"
  else
    # The command is built (and quoted) here on purpose, to run as-is on the remote host.
    # shellcheck disable=SC2029
    ssh "$host" "$remote" &
    pids+=("$!")
  fi
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
