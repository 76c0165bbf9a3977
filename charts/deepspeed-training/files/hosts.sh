#!/usr/bin/env bash
# Prints the hosts of an MPI-style hostfile ("<host> slots=N" lines; # comments), one per line: the one
# parser of the hostfile for launcher.sh and wait-for-workers.sh.  Usage: hosts.sh HOSTFILE
set -euo pipefail
awk '!/^[[:space:]]*#/ && NF { print $1 }' "$1"
