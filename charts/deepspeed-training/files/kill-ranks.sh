#!/usr/bin/env bash
# Stops this host's DeepSpeed ranks: SIGTERM (ranks save a checkpoint and exit), then SIGKILL after
# DS_KILL_GRACE_SECONDS. Run locally by worker.sh on eviction and over SSH by launcher.sh, which clears
# ranks left over from an earlier launcher attempt before it starts a new one.
set -uo pipefail
grace="${DS_KILL_GRACE_SECONDS:-30}"
# deepspeed.launcher.launch on each host, and the ranks it starts (it appends --local_rank=N to their args).
pattern='deepspeed\.launcher\.launch|--local_rank='
me=$(id -u)

pids() { pgrep -u "$me" -f -- "$pattern" | grep -vx "$$" || true; }
[[ -n "$(pids)" ]] || exit 0
echo "kill-ranks: $(hostname): stopping pids $(pids | tr '\n' ' ')"
pkill -TERM -u "$me" -f -- "$pattern"
for ((i = 0; i < grace; i++)); do
  [[ -n "$(pids)" ]] || exit 0
  sleep 1
done
echo "kill-ranks: $(hostname): still running after ${grace}s, sending SIGKILL"
pkill -KILL -u "$me" -f -- "$pattern"
exit 0
