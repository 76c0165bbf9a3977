import sys

from scripts.deployctl.cli import main

sys.exit(main())
