#!/usr/bin/env bash
# Launcher pod entrypoint (launchMode ssh). Usage: launcher.sh DEEPSPEED_COMMAND...
# Waits for every worker (of the current template), clears ranks left by an earlier attempt, runs the DeepSpeed
# command, and after a failure runs it again up to DS_RUN_RETRIES times (all ranks together, each run resuming
# from the last complete checkpoint; retry_verdict in run-child.sh decides). Its exit status is the last run's
# (143 after a stop); after a success it scales the workers to 0 when DS_SCALE_DOWN_WORKERS=true.
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "launcher: $*"; }
# shellcheck source=run-child.sh
source "$scripts_dir/run-child.sh"  # run_in_background, $child
stopping=""
# PID 1 ignores SIGTERM without a handler: set it first, also for the waits below. DeepSpeed's runner answers
# SIGTERM by killing the ranks on every worker (pdsh pkill), then exits 1.
trap 'stopping=1; log "SIGTERM: stopping the DeepSpeed run"; if [[ -n "$child" ]]; then kill -TERM "$child" 2> /dev/null; else exit 143; fi' TERM INT

# shellcheck source=ssh-setup.sh
source "$scripts_dir/ssh-setup.sh"
hostfile="$DS_CONFIG_DIR/hostfile"
# DeepSpeed forwards the KEY=VALUE lines of ~/.deepspeed_env to every rank.
install -m 600 /dev/null "$HOME/.deepspeed_env"  # written before every run, with the run's name
# pdsh's ssh must read our config (port, key, known_hosts) whatever the passwd home says.
export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND="-F $HOME/.ssh/config"
kill_ranks=(env "DS_KILL_GRACE_SECONDS=$DS_KILL_GRACE_SECONDS" "DS_RANK_STATE_DIR=$DS_RANK_STATE_DIR" bash "$scripts_dir/kill-ranks.sh")
hosts=$(bash "$scripts_dir/hosts.sh" "$hostfile" | paste -sd, -)

retries="${DS_RUN_RETRIES:-0}"
for ((attempt = 0; ; attempt++)); do
  run_in_background bash "$scripts_dir/wait-for-workers.sh" "$hostfile" "$DS_WAIT_TIMEOUT_SECONDS"
  [[ -n "$stopping" ]] && exit 143
  ((rc == 0)) || exit "$rc"
  log "clearing ranks left by an earlier attempt"
  pdsh -S -w "$hosts" "${kill_ranks[@]}" || true

  # The attempt's name, for every rank (DS_RUN_ID): a hang's diagnostics go to diagnostics/<run>.
  run_id="run-$(date -u +%Y%m%dT%H%M%SZ)"
  { cat "$DS_CONFIG_DIR/deepspeed_env"; echo "DS_RUN_ID=$run_id"; } > "$HOME/.deepspeed_env"
  log "running ($run_id): $*"
  run_in_background "$@"
  log "DeepSpeed exited with status $rc"
  if ((rc != 0)) && [[ -n "${DS_HANG_STEP_SECONDS:-}" ]]; then
    # What the workers' watchdogs found, if this run ended in a hang (nothing otherwise).
    pdsh -S -w "$hosts" cat "$DS_RANK_STATE_DIR/hang-$run_id.txt" 2> /dev/null || true
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
  if ((rc == 0)); then
    break
  fi
  log "clearing ranks still running on the workers"
  pdsh -S -w "$hosts" "${kill_ranks[@]}" || true
  retry_verdict "$attempt"
  [[ "$verdict" == retry ]] || exit "$verdict"
  log "retry $((attempt + 1)) of $retries: starting the run again, from the last complete checkpoint"
done
if [[ "${DS_SCALE_DOWN_WORKERS:-false}" == true ]]; then
  python3 "$scripts_dir/scale-workers.py" || log "WARNING: could not scale the workers down; delete them with helm uninstall"
fi
exit 0
