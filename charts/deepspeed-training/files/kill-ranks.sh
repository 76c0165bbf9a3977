#!/usr/bin/env bash
# Stops this host's DeepSpeed ranks: SIGTERM to the ranks (they save a checkpoint together and exit), then
# SIGKILL to those same processes after DS_KILL_GRACE_SECONDS. Run locally by worker.sh and nossh-worker.sh on
# SIGTERM, and over SSH by launcher.sh, which clears ranks left by an earlier attempt before it starts a new one.
#
# Ranks that report their state in DS_RANK_STATE_DIR/<pid> (train/rankstate.py: the state is the file's first
# word) do not hold the pod for the whole grace period when they cannot save: `starting` and `restoring` (no
# step finished since the rank started: nothing to save) are killed at once, and `training` still there
# ACK_SECONDS after SIGTERM means the rank never ran its handler (stuck in a C++ collective, e.g. waiting for
# peers that are gone): it is killed then. Ranks that acknowledged (`stopping`) or are `saving`, and programs
# that report nothing, get the full grace.
set -uo pipefail
# shellcheck source=generated/podstate.sh
source "$(dirname "${BASH_SOURCE[0]}")/generated/podstate.sh"  # the run-state protocol's words (train/podstate.py)
grace="${DS_KILL_GRACE_SECONDS:?set by the chart (worker.terminationGracePeriodSeconds)}"
state_dir="${DS_RANK_STATE_DIR:-}"
ack_seconds=10
me=$EUID
log() { echo "kill-ranks: $(hostname): $*"; }
state() {
  local word=""
  [[ -n "$state_dir" ]] && read -r word _ < "$state_dir/$1" 2> /dev/null
  echo "$word"
}

# The launcher clears every worker before each attempt, where there is usually nothing to stop: one pgrep says so.
pgrep -u "$me" -f -- 'deepspeed\.launcher\.launch|--local_rank=' > /dev/null || exit 0
# The ranks are the children of deepspeed.launcher.launch; ranks whose launcher died carry its --local_rank=.
launchers=$(pgrep -u "$me" -f 'deepspeed\.launcher\.launch' || true)
ranks=$(for pid in $launchers; do pgrep -P "$pid"; done)
[[ -n "$launchers" ]] || ranks=$(pgrep -u "$me" -f -- '--local_rank=' || true)
targets="$launchers $ranks"
[[ -n "${targets//[[:space:]]/}" ]] || exit 0
log "stopping ranks ${ranks:-none} (launchers ${launchers:-none})"

# kill_where STATE WHY: SIGKILL to the ranks in that state.
kill_where() {
  local pid doomed=""
  for pid in $ranks; do
    [[ "$(state "$pid")" == "$1" ]] && doomed+=" $pid"
  done
  [[ -z "$doomed" ]] && return 0
  log "SIGKILL to${doomed}: $2"
  # shellcheck disable=SC2086
  kill -KILL $doomed 2> /dev/null
}

for word in $NOTHING_TO_SAVE_STATES; do
  kill_where "$word" "no step finished since it started ($word), nothing to save"
done
# Only the ranks: deepspeed.launcher.launch reaps them and exits, and would SIGKILL them itself after 30 s.
# shellcheck disable=SC2086
kill -TERM ${ranks:-$launchers} 2> /dev/null
# Checked every 0.1 s: the pod (and the launcher's next attempt) goes on as soon as the ranks are gone.
for ((tick = 0; tick < grace * 10; tick++)); do
  # shellcheck disable=SC2086
  kill -0 $targets 2> /dev/null || exit 0
  ((tick == ack_seconds * 10)) && kill_where "$STATE_TRAINING" "no answer to SIGTERM in ${ack_seconds}s: stuck in a collective, cannot save"
  sleep 0.1
done
log "still running after ${grace}s, sending SIGKILL"
# shellcheck disable=SC2086
kill -KILL $targets 2> /dev/null
exit 0
