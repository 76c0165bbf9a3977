"""The chart's scripts directory as a program, as every pod runs it: `python3 -I /etc/deepspeed/scripts PROGRAM
[ARGS]` (python3 puts this directory first on its path, -I or not, and nothing else of the pod's: podruntime is the
package beside this file). The programs are podruntime/cli.py's."""

import sys

from podruntime.cli import main

sys.exit(main(sys.argv[1:]))
