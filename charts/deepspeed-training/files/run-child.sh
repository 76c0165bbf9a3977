#!/usr/bin/env bash
# Sourced by launcher.sh and nossh-worker.sh, whose SIGTERM traps read and signal `$child` (and set `stopping`),
# and which define `log` and `scripts_dir` and source generated/podstate.sh (the protocol's exit statuses).
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

# retry_verdict: after a failed run (status $rc), sets `verdict` to "retry" or to the pod's exit status, saying
# why. One rule for both launch modes: a stop (SIGTERM) and a configuration error (exit 2) are never retried;
# other failures are, while the job's failure budget lasts: attempts.py decides when the next attempt begins,
# counting the failures of every pod of the job.
# shellcheck disable=SC2034 # verdict is read by the sourcing script
retry_verdict() {
  verdict=retry
  if [[ -n "${stopping:-}" ]]; then
    verdict=$EXIT_STOPPED
  elif ((rc == EXIT_CONFIG_ERROR)); then
    log "status $rc is a configuration error (bad arguments or input files): not retried"
    verdict=$EXIT_CONFIG_ERROR
  fi
}

# begin_attempt: numbers the next attempt in the job's ledger (attempts.py) and exports its env (DS_RUN_ID,
# DS_ATTEMPT_DIR, ...) into `attempt_env` and this shell; exits the pod with attempts.py's status when the
# job's failure budget is spent (the chart's podFailurePolicy then fails the Job).
# shellcheck disable=SC2034,SC2154 # attempt_env is read, scripts_dir set, by the sourcing script
begin_attempt() {
  local status=0
  attempt_env="$(python3 "$scripts_dir/attempts.py" begin)" || status=$?
  ((status == 0)) || exit "$status"
  export_attempt_env
}

# export_attempt_env: exports the KEY=VALUE lines of `attempt_env` (attempts.py's, never a shell's to evaluate).
export_attempt_env() {
  local key value
  while IFS='=' read -r key value; do
    [[ "$key" =~ ^DS_[A-Z_]+$ ]] && export "$key=$value"
  done <<< "$attempt_env"
}
