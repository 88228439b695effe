#!/usr/bin/env bash
# Multi-node run without a scheduler: ssh to each host and start one process per host.
#
#   HOSTS="gpu-a gpu-b" launch/multinode.sh --config=configs/sage.py:qwen2.5-7b \
#       --workdir=/shared/runs/sage7b [--config.key=value ...]
#
# HOSTS may name user@host. The first host runs the JAX coordinator. Every host needs the code
# at SAGE_JAX_DIR (default: this checkout's path) with its venv in .venv, and the workdir on a
# shared filesystem or in a bucket every host reaches (--workdir=gs://bucket/run).
# Logs: $SAGE_JAX_DIR/logs/<host>.log on each host. DRY_RUN=1 prints the ssh commands.
# Ctrl-C (or SIGTERM) here sends SIGTERM to every host's process once, over ssh: each saves a
# checkpoint after its step and stops (a second Ctrl-C leaves them to it).
set -euo pipefail

if [[ -z "${HOSTS:-}" ]]; then
  echo "multinode.sh: set HOSTS to the space-separated host names" >&2
  exit 2
fi
read -r -a hosts <<< "$HOSTS"
SAGE_JAX_DIR="${SAGE_JAX_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
SAGE_JAX_MODULE="${SAGE_JAX_MODULE:-sage_jax.train}"
COORDINATOR_PORT="${COORDINATOR_PORT:-12345}"
# A host may be given as user@host: the name alone is the coordinator's and its files'.
names=("${hosts[@]#*@}")
coordinator="${names[0]}:$COORDINATOR_PORT"
args="$(printf '%q ' "$@")"

# The command's config and overrides, checked once here (with this checkout's venv, where
# there is one) rather than failing on every host.
if [[ -x "$SAGE_JAX_DIR/.venv/bin/python" ]]; then
  (cd "$SAGE_JAX_DIR" && .venv/bin/python launch/check.py "$SAGE_JAX_MODULE" "$@") || exit 2
fi

dir="$(printf '%q' "$SAGE_JAX_DIR")"
pids=()
for i in "${!hosts[@]}"; do
  host="${hosts[$i]}"
  name="${names[$i]}"
  # `exec` keeps the shell's pid, written first, for the process: what stop() signals.
  remote="cd $dir && mkdir -p logs && . .venv/bin/activate && echo \$\$ > logs/$name.pid && \
JAX_COORDINATOR_ADDRESS=$coordinator JAX_NUM_PROCESSES=${#hosts[@]} JAX_PROCESS_ID=$i \
exec python -m $SAGE_JAX_MODULE $args > logs/$name.log 2>&1"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf 'ssh %q %q\n' "$host" "$remote"
  else
    # The command is built (and quoted) here on purpose, to run as-is on the remote host.
    # shellcheck disable=SC2029
    ssh "$host" "$remote" &
    pids+=("$!")
  fi
done

# shellcheck disable=SC2317  # run by the trap below
stop() {
  trap - INT TERM
  echo "multinode.sh: stopping every process after its step (SIGTERM)" >&2
  for i in "${!hosts[@]}"; do
    # Only a pid that is this run's process: the file may be an earlier run's.
    # shellcheck disable=SC2029
    ssh "${hosts[$i]}" "pid=\$(cat $dir/logs/${names[$i]}.pid) && \
grep -qF -- $(printf '%q' "$SAGE_JAX_MODULE") /proc/\$pid/cmdline && kill -TERM \$pid" || true
  done
}
trap stop INT TERM

# The exit status is the first failing host's (in HOSTS order); each failing host is named.
status=0
for i in "${!pids[@]}"; do
  pid="${pids[$i]}"
  while kill -0 "$pid" 2> /dev/null; do
    wait "$pid" || true  # returns early when a signal runs stop()
  done
  rc=0
  wait "$pid" || rc=$?  # the host's own exit status
  if [[ $rc -ne 0 ]]; then
    echo "multinode.sh: ${hosts[$i]} exited with status $rc" \
      "(its log: $SAGE_JAX_DIR/logs/${names[$i]}.log there)" >&2
    if [[ $status -eq 0 ]]; then status=$rc; fi
  fi
done
exit "$status"
