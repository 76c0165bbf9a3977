#!/usr/bin/env bash
# Launcher pod entrypoint (launchMode ssh). Usage: launcher.sh DEEPSPEED_COMMAND...
# Every attempt is numbered in the job's ledger (attempts.py), which keeps the failure budget across pods. Waits
# for every worker (of the current template) and clears ranks left by an earlier attempt on it, runs the DeepSpeed
# command, and after a failure runs it again while the budget lasts (all ranks together, each run resuming from
# the last complete checkpoint; retry_verdict in run-child.sh and attempts.py decide). Its exit status is the
# last run's (143 after a stop, attempts.py's when the budget is spent).
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "launcher: $*"; }
# shellcheck source=generated/podstate.sh
source "$scripts_dir/generated/podstate.sh"  # the run-state protocol's names (train/podstate.py)
# shellcheck source=run-child.sh
source "$scripts_dir/run-child.sh"  # run_in_background, $child
stopping=""
in_run=""  # set while the DeepSpeed run is the child
# On SIGTERM: the stop is recorded in the attempt first (a preemption does not spend the failure budget). Then
# the ranks on every worker get SIGTERM (kill-ranks.sh: they agree on a step, save it and exit) while the run's
# own pdsh still relays their last lines; DeepSpeed's runner, signalled first, would cut pdsh off (it exits 1
# at once) and the stop's step and checkpoint would go unseen. PID 1 ignores SIGTERM without a handler: set it
# first, also for the waits below.
# shellcheck disable=SC2317 # invoked by the trap below
stop() {
  stopping=1
  log "SIGTERM: stopping the DeepSpeed run"
  python3 "$scripts_dir/attempts.py" stopped || true
  [[ -n "$child" ]] || exit "$EXIT_STOPPED"
  if [[ -n "$in_run" ]]; then
    pdsh -S -w "$hosts" "${kill_ranks[@]}" || true
  fi
  kill -TERM "$child" 2> /dev/null || true
}
trap stop TERM INT

# shellcheck source=ssh-setup.sh
source "$scripts_dir/ssh-setup.sh"
hostfile="$DS_CONFIG_DIR/hostfile"
# DeepSpeed forwards the KEY=VALUE lines of ~/.deepspeed_env to every rank.
install -m 600 /dev/null "$HOME/.deepspeed_env"  # written before every run, with the run's name
# pdsh's ssh must read our config (port, key, known_hosts) whatever the passwd home says.
export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND="-F $HOME/.ssh/config"
# A command line for the workers' shells (pdsh and ssh paste it into one): the assignments need no `env` process.
kill_ranks=("DS_KILL_GRACE_SECONDS=$DS_KILL_GRACE_SECONDS" "DS_RANK_STATE_DIR=$DS_RANK_STATE_DIR" bash "$scripts_dir/kill-ranks.sh")
hosts=$(bash "$scripts_dir/hosts.sh" "$hostfile" | paste -sd, -)

while true; do
  begin_attempt  # run-child.sh: exports DS_RUN_ID, DS_ATTEMPT_DIR, ... or exits when the budget is spent
  # Every worker reachable and of the current template, and cleared of ranks an earlier attempt left (a lost
  # launcher pod's), in one SSH round trip per worker.
  run_in_background bash "$scripts_dir/wait-for-workers.sh" "$hostfile" "$DS_WAIT_TIMEOUT_SECONDS" 1 \
    "$(printf '%q ' "${kill_ranks[@]}")"
  [[ -n "$stopping" ]] && exit "$EXIT_STOPPED"
  if ((rc != 0)); then
    python3 "$scripts_dir/attempts.py" end "$rc"
    exit "$rc"
  fi

  # The attempt, for every rank: its name (DS_RUN_ID: a hang's diagnostics go to diagnostics/<run>), its number
  # and the budget used (the train package's start line), its ledger entry (a worker's SIGTERM marks it).
  { cat "$DS_CONFIG_DIR/deepspeed_env"; printf '%s\n' "$attempt_env"; } > "$HOME/.deepspeed_env"
  log "running ($DS_RUN_ID): $*"
  in_run=1
  run_in_background "$@"
  in_run=""
  log "DeepSpeed exited with status $rc"
  if ((rc != 0)); then
    # What every worker knows of how this run ended: its watchdog's report if the run hung (its text to this log),
    # and its evidence (attempts.py evidence: the hang report, its ranks' end records, the last step) to the ledger,
    # which decides the cause from all of them (attempts.py end). One pdsh round; the remote shell gets the
    # protocol's paths and the run's ID, nothing else.
    # shellcheck disable=SC2059 # the pattern is the protocol's
    printf -v hang_text "$HANG_TEXT_PATTERN" "$DS_RUN_ID"
    pdsh -S -w "$hosts" cat "$DS_RANK_STATE_DIR/$hang_text" ";" "DS_RANK_STATE_DIR=$DS_RANK_STATE_DIR" python3 \
      "$scripts_dir/attempts.py" evidence "$DS_RUN_ID" 2> /dev/null | python3 "$scripts_dir/attempts.py" collect || true
  fi
  # DeepSpeed's tuner exits 0 also when every experiment failed: only its optimal config means it finished.
  if ((rc == 0)) && [[ -n "${DS_AUTOTUNING_RESULTS:-}" ]]; then
    if [[ -f "$DS_AUTOTUNING_RESULTS/ds_config_optimal.json" ]]; then
      log "autotuning done: $DS_AUTOTUNING_RESULTS/ds_config_optimal.json (see summary.txt beside it)"
    else
      log "autotuning ended without $DS_AUTOTUNING_RESULTS/ds_config_optimal.json: no experiment succeeded (see the experiments' stderr.log under $DS_AUTOTUNING_RESULTS)"
      rc=1
    fi
  fi
  python3 "$scripts_dir/attempts.py" end "$rc"
  if ((rc == 0)); then
    break
  fi
  log "clearing ranks still running on the workers"
  pdsh -S -w "$hosts" "${kill_ranks[@]}" || true
  retry_verdict
  [[ "$verdict" == retry ]] || exit "$verdict"
  log "starting the run again, from the last complete checkpoint, if the job's failure budget allows"
done
exit 0  # the progress sidecar scales the workers down (launcher.scaleDownWorkers): it holds the pod's only token
