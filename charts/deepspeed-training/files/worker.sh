#!/usr/bin/env bash
# Worker pod entrypoint: run a non-root sshd in the foreground for the launcher's pdsh, and the hang watchdog
# (watchdog.py) beside it when DS_HANG_DETECTION is on. On SIGTERM (eviction, scale-down) the local
# DeepSpeed ranks get SIGTERM first, so they can save a checkpoint within the pod's grace period, then sshd
# stops.
set -euo pipefail
scripts_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ssh-setup.sh
source "$scripts_dir/ssh-setup.sh"

# Ranks started over SSH do not inherit this container's env. sshd hands them ~/.ssh/environment
# (PermitUserEnvironment): this container's env as the image and the chart set it (PATH, LD_LIBRARY_PATH,
# CUDA_*, NVIDIA_*, and the chart's valueFrom entries such as secrets), never through a shell or a log.
skip='^(HOSTNAME|HOME|PWD|OLDPWD|SHLVL|_|TERM)$'
: > "$HOME/.ssh/environment"
chmod 600 "$HOME/.ssh/environment"
while IFS= read -r -d '' entry; do
  name="${entry%%=*}"
  [[ "$name" =~ $skip || ! "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] && continue
  if [[ "$entry" == *$'\n'* ]]; then
    echo "worker: env $name contains a newline; sshd's environment file cannot carry it to the ranks" >&2
    continue
  fi
  printf '%s\n' "$entry" >> "$HOME/.ssh/environment"
done < <(env -0)

stop() {
  echo "worker: SIGTERM: stopping local ranks"
  # First: the attempt its ranks run is marked a preemption, which does not spend the job's failure budget.
  python3 "$scripts_dir/attempts.py" stopped || true
  bash "$scripts_dir/kill-ranks.sh" || true
  kill -TERM "$sshd_pid" 2>/dev/null || true
}
trap stop TERM INT

if [[ "${DS_HANG_DETECTION:-off}" == on ]]; then
  python3 "$scripts_dir/watchdog.py" &  # it exits with this script
fi
sshd_bin="$(command -v sshd || echo /usr/sbin/sshd)"
echo "worker: $(hostname) starting sshd on port $DS_SSH_PORT"
"$sshd_bin" -D -e -f "$HOME/.ssh/sshd_config" &
sshd_pid=$!
# `wait` returns early when a trapped signal arrives; wait again for sshd itself.
wait "$sshd_pid" || true
wait "$sshd_pid" 2>/dev/null || true
