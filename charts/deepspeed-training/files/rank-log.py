"""Every rank's program, as DeepSpeed's launcher starts it (it takes a script's path): `python -u rank-log.py
[--local_rank=N] (-m MODULE | SCRIPT) [ARGS...]` tags the rank's output and becomes the program
(podruntime/ranklog.py; python puts this file's directory, the chart's scripts, first on its path)."""

import sys

from podruntime.ranklog import main

sys.exit(main(sys.argv[1:]))
