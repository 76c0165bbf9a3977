#!/usr/bin/env bash
# Waits until every host in the hostfile resolves and accepts an SSH login, or fails at the deadline
# naming the hosts still missing.  Usage: wait-for-workers.sh HOSTFILE TIMEOUT_SECONDS [INTERVAL_SECONDS]
set -euo pipefail
hostfile="$1" timeout="$2" interval="${3:-5}"
log() { echo "wait-for-workers: $*"; }

mapfile -t pending < <(awk '!/^[[:space:]]*#/ && NF { print $1 }' "$hostfile")
total=${#pending[@]}
if ((total == 0)); then
  log "ERROR: $hostfile lists no hosts"
  exit 2
fi
log "waiting up to ${timeout}s for $total workers (DNS and SSH)"
deadline=$((SECONDS + timeout))
declare -A why
while :; do
  still=()
  for host in "${pending[@]}"; do
    if ! getent hosts "$host" > /dev/null; then
      why[$host]="no DNS record"
      still+=("$host")
    elif ! err=$(ssh -F "$HOME/.ssh/config" -n -o ConnectTimeout=5 "$host" true 2>&1); then
      why[$host]="SSH failed: ${err:-no output}"
      still+=("$host")
    fi
  done
  pending=("${still[@]}")
  if ((${#pending[@]} == 0)); then
    log "all $total workers are reachable after ${SECONDS}s"
    exit 0
  fi
  if ((SECONDS >= deadline)); then
    log "ERROR: ${#pending[@]} of $total workers still unreachable after ${timeout}s:"
    for host in "${pending[@]}"; do log "  $host: ${why[$host]}"; done
    exit 1
  fi
  shown="${pending[*]:0:5}"
  ((${#pending[@]} > 5)) && shown+=" ... (+$((${#pending[@]} - 5)) more)"
  log "$((total - ${#pending[@]}))/$total ready; waiting for: $shown ($((deadline - SECONDS))s left)"
  sleep "$interval"
done
