import sys

from train.main import main

sys.exit(main())
