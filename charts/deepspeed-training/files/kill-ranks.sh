#!/usr/bin/env bash
# Stops this host's DeepSpeed ranks: SIGTERM to the ranks (they save a checkpoint together and exit), then
# SIGKILL to those same processes after DS_KILL_GRACE_SECONDS. Run locally by worker.sh on eviction and over
# SSH by launcher.sh, which clears ranks left by an earlier attempt before it starts a new one.
set -uo pipefail
grace="${DS_KILL_GRACE_SECONDS:?set by the chart (worker.terminationGracePeriodSeconds)}"
me=$(id -u)

# The ranks are the children of deepspeed.launcher.launch; ranks whose launcher died carry its --local_rank=.
launchers=$(pgrep -u "$me" -f 'deepspeed\.launcher\.launch' || true)
ranks=$(for pid in $launchers; do pgrep -P "$pid"; done)
[[ -n "$launchers" ]] || ranks=$(pgrep -u "$me" -f -- '--local_rank=' || true)
targets="$launchers $ranks"
[[ -n "${targets//[[:space:]]/}" ]] || exit 0
echo "kill-ranks: $(hostname): stopping ranks ${ranks:-none} (launchers ${launchers:-none})"
# Only the ranks: deepspeed.launcher.launch reaps them and exits, and would SIGKILL them itself after 30 s.
# shellcheck disable=SC2086
kill -TERM ${ranks:-$launchers} 2> /dev/null
for ((i = 0; i < grace; i++)); do
  # shellcheck disable=SC2086
  kill -0 $targets 2> /dev/null || exit 0
  sleep 1
done
echo "kill-ranks: $(hostname): still running after ${grace}s, sending SIGKILL"
# shellcheck disable=SC2086
kill -KILL $targets 2> /dev/null
exit 0
