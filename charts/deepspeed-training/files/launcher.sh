#!/usr/bin/env bash
# Launcher pod entrypoint. Usage: launcher.sh DEEPSPEED_COMMAND...
# Waits for every worker, clears ranks left by an earlier attempt, runs the DeepSpeed command (its exit
# status is the Job's), then scales the workers to 0 after a success when DS_SCALE_DOWN_WORKERS=true.
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ssh-setup.sh
source "$scripts_dir/ssh-setup.sh"
hostfile="$DS_CONFIG_DIR/hostfile"
log() { echo "launcher: $*"; }

# DeepSpeed forwards the KEY=VALUE lines of ~/.deepspeed_env to every rank.
install -m 600 "$DS_CONFIG_DIR/deepspeed_env" "$HOME/.deepspeed_env"
# pdsh's ssh must read our config (port, key, known_hosts) whatever the passwd home says.
export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND="-F $HOME/.ssh/config"

bash "$scripts_dir/wait-for-workers.sh" "$hostfile" "${DS_WAIT_TIMEOUT_SECONDS:-600}"

hosts=$(awk '!/^[[:space:]]*#/ && NF { print $1 }' "$hostfile" | paste -sd, -)
log "clearing ranks left by an earlier attempt"
pdsh -S -w "$hosts" bash "$scripts_dir/kill-ranks.sh"

log "running: $*"
"$@" &
child=$!
# DeepSpeed's runner answers SIGTERM by killing the ranks on every worker (pdsh pkill), then exits 1.
trap 'log "SIGTERM: stopping the DeepSpeed run"; kill -TERM "$child" 2>/dev/null || true' TERM INT
rc=0
wait "$child" || rc=$?
# After a trapped signal the first wait returns early; collect the real exit status.
if kill -0 "$child" 2>/dev/null; then
  rc=0
  wait "$child" || rc=$?
fi
log "DeepSpeed exited with status $rc"
if ((rc != 0)); then
  log "clearing ranks still running on the workers"
  pdsh -S -w "$hosts" bash "$scripts_dir/kill-ranks.sh" || true
  exit "$rc"
fi
if [[ "${DS_SCALE_DOWN_WORKERS:-false}" == true ]]; then
  python3 "$scripts_dir/scale-workers.py" || log "WARNING: could not scale the workers down; delete them with helm uninstall"
fi
exit 0
