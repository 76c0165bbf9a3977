#!/usr/bin/env bash
# Sourced by launcher.sh and nossh-worker.sh, whose SIGTERM traps read and signal `$child`.
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
