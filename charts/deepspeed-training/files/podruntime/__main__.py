"""`python -m podruntime PROGRAM [ARGS]`: the pod programs (cli.py) where the package is installed."""

import sys

from podruntime.cli import main

sys.exit(main(sys.argv[1:]))
