import traceback

from train import rankstate
from train.main import exit_cleanly, main

# Everything is written and committed by now (main() tears the process group down itself).
try:
    status = main()
except SystemExit as stop:
    status = stop.code if isinstance(stop.code, int) else 1
except BaseException as error:  # e.g. a collective failed because a peer died: say why and leave at once, since
    rankstate.record_exception(error)  # the interpreter's own teardown with torch loaded takes seconds the retry
    traceback.print_exc()  # is waiting for; the ledger gets its last line
    status = 1
exit_cleanly(status)
