"""A plain DeepSpeed program's rank on per-worker volumes, as files/rank-log.py becomes it where the chart asks for
every node's `latest` (podruntime/savehook.py): `python -u rank-hook.py (-m MODULE | SCRIPT) [ARGS...]` runs the
program as python would run it, with DeepSpeed's save_checkpoint marking this node's `latest` (python puts this
file's directory, the chart's scripts, first on its path: the package is found by a static import)."""

import sys

from podruntime import savehook

savehook.run(sys.argv[1:])
