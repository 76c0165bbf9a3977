#!/usr/bin/env bash
# Readiness and liveness probe of a worker: is sshd listening on DS_SSH_PORT? Reads the kernel's socket tables
# instead of connecting, since sshd logs every connection that closes before a login (two lines per probe).
port=$(printf '%04X' "${DS_SSH_PORT:?set by the chart}")
# Columns: sl, local_address (hex IP:port), rem_address, st (0A = LISTEN).
awk -v port=":$port" 'substr($2, length($2) - 4) == port && $4 == "0A" { found = 1 } END { exit !found }' \
  /proc/net/tcp /proc/net/tcp6 2> /dev/null
