import logging
import os
import sys

from train.main import main

status = main()
# Everything is written and committed by now. Leave without running C++ static destructors: at interpreter
# exit a rank sometimes aborts ("terminate called without an active exception", exit -6) after a finished
# run, which would fail the whole job.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
