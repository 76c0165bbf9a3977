#!/usr/bin/env bash
# Waits until every host in the hostfile resolves, accepts an SSH login and runs the current worker template
# (its DS_WORKER_TEMPLATE equals ours: during a rollout, pods of the previous revision still answer, and pdsh
# would start ranks on a pod about to be replaced), or fails at the deadline naming the hosts still missing.
# Usage: wait-for-workers.sh HOSTFILE TIMEOUT_SECONDS [INTERVAL_SECONDS [THEN_COMMAND]]
# THEN_COMMAND, a command line for the worker's shell, runs on each host of the current template in the same SSH
# session as its check (the launcher clears ranks an earlier attempt left there): one round trip per host, not
# two; its output is logged. Up to DS_WAIT_PARALLEL (32) hosts are checked at a time, the next one starting as soon
# as one is done (no batch waits for its slowest host), so a round stays short on large jobs.
set -euo pipefail
hostfile="$1" timeout="$2" interval="${3:-1}" then_command="${4:-}" parallel="${DS_WAIT_PARALLEL:-32}"
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "wait-for-workers: $*"; }

# shellcheck disable=SC2016 # expanded by the worker's shell
remote='echo "template=$DS_WORKER_TEMPLATE"'
if [[ -n "$then_command" && -n "${DS_WORKER_TEMPLATE:-}" ]]; then
  # shellcheck disable=SC2016
  remote+="; if [ \"\$DS_WORKER_TEMPLATE\" = $(printf %q "$DS_WORKER_TEMPLATE") ]; then $then_command || true; fi"
elif [[ -n "$then_command" ]]; then
  remote+="; $then_command || true"
fi

# Prints nothing when $1 is reachable, else why not; what THEN_COMMAND said goes to $results/said.$1.
check() {
  local host="$1" out
  # ssh's own lookup tells a missing DNS record apart: no separate resolver process per host and round.
  if ! out=$(ssh -F "$HOME/.ssh/config" -n -o ConnectTimeout=5 "$host" "$remote" 2>&1); then
    if [[ "$out" == *"Could not resolve hostname"* ]]; then
      echo "no DNS record"
    else
      echo "SSH failed: ${out:-no output}" | tr '\n' ' '
    fi
  elif [[ -n "${DS_WORKER_TEMPLATE:-}" && "${out%%$'\n'*}" != "template=$DS_WORKER_TEMPLATE" ]]; then
    echo "runs worker template ${out#template=}, not $DS_WORKER_TEMPLATE: a pod of an earlier revision, the rollout is not done"
  elif [[ "$out" == *$'\n'* ]]; then
    printf '%s\n' "${out#*$'\n'}" > "$results/said.$host"
  fi
}

mapfile -t pending < <(bash "$scripts_dir/hosts.sh" "$hostfile")
total=${#pending[@]}
if ((total == 0)); then
  log "ERROR: $hostfile lists no hosts"
  exit 2
fi
log "waiting up to ${timeout}s for $total workers (DNS, SSH, worker template ${DS_WORKER_TEMPLATE:-any})${then_command:+, then on each: $then_command}"
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
deadline=$((SECONDS + timeout)) last_pending=-1 next_log=0 round=0
# The first rounds come sooner (pods that are starting answer within a second), then one every INTERVAL: a job
# whose pods wait to be scheduled is not checked several times a second for as long as that takes.
first_pauses=(0.25 0.5)
while :; do
  running=0
  for host in "${pending[@]}"; do
    if ((running >= parallel)); then
      wait -n || true
      running=$((running - 1))
    fi
    check "$host" > "$results/$host" &
    running=$((running + 1))
  done
  wait
  for said in "$results"/said.*; do
    [[ -f "$said" ]] && cat "$said" && rm -f "$said"
  done
  still=()
  for host in "${pending[@]}"; do
    [[ -s "$results/$host" ]] && still+=("$host")
  done
  pending=("${still[@]}")
  if ((${#pending[@]} == 0)); then
    log "all $total workers are reachable after ${SECONDS}s"
    exit 0
  fi
  if ((SECONDS >= deadline)); then
    log "ERROR: ${#pending[@]} of $total workers still unreachable after ${timeout}s:"
    for host in "${pending[@]}"; do log "  $host: $(cat "$results/$host")"; done
    exit 1
  fi
  # One line when the count changes, else every 10 s: a check per second would flood the log.
  if ((${#pending[@]} != last_pending || SECONDS >= next_log)); then
    shown="${pending[*]:0:5}"
    ((${#pending[@]} > 5)) && shown+=" ... (+$((${#pending[@]} - 5)) more)"
    log "$((total - ${#pending[@]}))/$total ready; waiting for: $shown ($((deadline - SECONDS))s left)"
    last_pending=${#pending[@]} next_log=$((SECONDS + 10))
  fi
  sleep "${first_pauses[round]:-$interval}"
  round=$((round + 1))
done
