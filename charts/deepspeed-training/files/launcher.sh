#!/usr/bin/env bash
# Launcher pod entrypoint. Usage: launcher.sh DEEPSPEED_COMMAND...
# Waits for every worker, clears ranks left by an earlier attempt, runs the DeepSpeed command (its exit
# status is the Job's), then scales the workers to 0 after a success when DS_SCALE_DOWN_WORKERS=true.
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { echo "launcher: $*"; }
child=""
# PID 1 ignores SIGTERM without a handler: set it first, also for the wait below. DeepSpeed's runner answers
# SIGTERM by killing the ranks on every worker (pdsh pkill), then exits 1.
trap 'log "SIGTERM: stopping the DeepSpeed run"; if [[ -n "$child" ]]; then kill -TERM "$child" 2> /dev/null; else exit 143; fi' TERM INT

# shellcheck source=ssh-setup.sh
source "$scripts_dir/ssh-setup.sh"
hostfile="$DS_CONFIG_DIR/hostfile"
# DeepSpeed forwards the KEY=VALUE lines of ~/.deepspeed_env to every rank.
install -m 600 "$DS_CONFIG_DIR/deepspeed_env" "$HOME/.deepspeed_env"
# pdsh's ssh must read our config (port, key, known_hosts) whatever the passwd home says.
export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND="-F $HOME/.ssh/config"
kill_ranks=(env "DS_KILL_GRACE_SECONDS=$DS_KILL_GRACE_SECONDS" bash "$scripts_dir/kill-ranks.sh")

bash "$scripts_dir/wait-for-workers.sh" "$hostfile" "$DS_WAIT_TIMEOUT_SECONDS" &
wait $! # in the background, so SIGTERM is handled while waiting

hosts=$(bash "$scripts_dir/hosts.sh" "$hostfile" | paste -sd, -)
log "clearing ranks left by an earlier attempt"
pdsh -S -w "$hosts" "${kill_ranks[@]}"

log "running: $*"
"$@" &
child=$!
rc=0
wait "$child" || rc=$?
# A trapped signal ends the first wait early; the second returns the runner's real status (127 if reaped).
rc2=0
wait "$child" 2> /dev/null || rc2=$?
((rc2 == 127)) || rc=$rc2
log "DeepSpeed exited with status $rc"
if ((rc != 0)); then
  log "clearing ranks still running on the workers"
  pdsh -S -w "$hosts" "${kill_ranks[@]}" || true
  exit "$rc"
fi
if [[ "${DS_SCALE_DOWN_WORKERS:-false}" == true ]]; then
  python3 "$scripts_dir/scale-workers.py" || log "WARNING: could not scale the workers down; delete them with helm uninstall"
fi
exit 0
