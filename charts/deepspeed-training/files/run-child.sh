#!/usr/bin/env bash
# Sourced by launcher.sh and nossh-worker.sh, whose SIGTERM traps read and signal `$child` (and set `stopping`),
# and which define `log`.
# run_in_background CMD...: runs CMD so that a trapped SIGTERM is handled meanwhile; sets rc to its status.
# shellcheck disable=SC2034 # child and rc are read by the sourcing script
child=""
# shellcheck disable=SC2034
run_in_background() {
  "$@" &
  child=$!
  rc=0
  wait "$child" || rc=$?
  # A trapped signal ends the first wait early; the second returns the real status (127 if already reaped).
  local rc2=0
  wait "$child" 2> /dev/null || rc2=$?
  ((rc2 == 127)) || rc=$rc2
  child=""
}

# retry_verdict ATTEMPT: after a failed run (status $rc), sets `verdict` to "retry" or to the pod's exit status,
# saying why. One rule for both launch modes: a stop (SIGTERM) and a configuration error (exit 2) are never
# retried; other failures up to DS_RUN_RETRIES times, each run resuming from the last complete checkpoint.
# shellcheck disable=SC2034 # verdict is read by the sourcing script
retry_verdict() {
  local retries="${DS_RUN_RETRIES:-0}"
  verdict=retry
  if [[ -n "${stopping:-}" ]]; then
    verdict=143
  elif ((rc == 2)); then
    log "status 2 is a configuration error (bad arguments or input files): not retried"
    verdict=2
  elif (($1 >= retries)); then
    log "no retries left (job.runRetries=$retries); failing the pod"
    verdict=$rc
  fi
}
