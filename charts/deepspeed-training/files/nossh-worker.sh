#!/usr/bin/env bash
# Worker pod entrypoint in launchMode nossh (a pod of the workers' Indexed Job; no sshd, no launcher pod).
# Usage: nossh-worker.sh DEEPSPEED_COMMAND...   (run as DEEPSPEED_COMMAND[0] --node_rank=<index> REST...)
# Every run starts with the start barrier on worker 0 (gang-barrier.py): all workers between two runs, none
# with ranks of an earlier run still alive. Then DeepSpeed's launcher starts this node's ranks. The hang
# watchdog (watchdog.py) runs beside them when DS_HANG_DETECTION is on, and ends a hung attempt. A failed run is
# started again, together with the other workers, while the job's failure budget lasts: worker 0 numbers every
# attempt in the job's ledger at the barrier and records its outcome (attempts.py); a SIGTERM marks it a
# preemption, which does not count. The pod's exit status is the last run's: success only when the program
# finished (143 after a stop, attempts.py's when the budget is spent).
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
node_rank="${JOB_COMPLETION_INDEX:?set by the Job controller (completionMode: Indexed)}"
log() { echo "worker $node_rank: $*"; }
# shellcheck source=generated/podstate.sh
source "$scripts_dir/generated/podstate.sh"  # the run-state protocol's names (train/podstate.py)
# shellcheck source=run-child.sh
source "$scripts_dir/run-child.sh"  # run_in_background, $child
stopping=""
# PID 1 ignores SIGTERM without a handler. The ranks get SIGTERM (they save a checkpoint together) and, if
# they do not stop within the grace period, SIGKILL. DeepSpeed's launcher may be gone by then (it exits with its
# ranks): a failed kill must not end the script under set -e with 1 instead of 143.
trap 'stopping=1; log "SIGTERM: stopping local ranks"; python3 "$scripts_dir/attempts.py" stopped || true
      bash "$scripts_dir/kill-ranks.sh" || true
      if [[ -n "$child" ]]; then kill -TERM "$child" 2> /dev/null || true; else exit "$EXIT_STOPPED"; fi' TERM INT

if [[ "${DS_HANG_DETECTION:-off}" == on ]]; then
  python3 "$scripts_dir/watchdog.py" &  # it exits with this script
fi
mapfile -t hosts < <(bash "$scripts_dir/hosts.sh" "$DS_CONFIG_DIR/hostfile")
while true; do
  run_in_background python3 "$scripts_dir/gang-barrier.py" "$node_rank" "$DS_BARRIER_PORT" \
    "$DS_WAIT_TIMEOUT_SECONDS" "${hosts[@]}"
  [[ -n "$stopping" ]] && exit "$EXIT_STOPPED"
  ((rc == 0)) || exit "$rc"
  # The attempt's env, the same on every worker (worker 0 hands it out at the barrier): DS_RUN_ID, ...
  attempt_env="$(cat "$DS_RANK_STATE_DIR/$ATTEMPT_ENV_FILE")"
  export_attempt_env  # run-child.sh
  log "running ($DS_RUN_ID): $1 --node_rank=$node_rank ${*:2}"
  run_in_background "$1" "--node_rank=$node_rank" "${@:2}"
  log "DeepSpeed exited with status $rc"
  export DS_LAST_STATUS="$rc"  # this worker's evidence for the ledger, sent with it to the next barrier
  if ((node_rank == 0)); then
    python3 "$scripts_dir/attempts.py" end "$rc"
  fi
  ((rc == 0)) && exit 0
  retry_verdict
  [[ "$verdict" == retry ]] || exit "$verdict"
  log "meeting the other workers at the start barrier: the run starts again if the job's failure budget allows"
done
