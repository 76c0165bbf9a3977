import traceback

from train.main import exit_cleanly, main

# Everything is written and committed by now (main() tears the process group down itself).
try:
    status = main()
except SystemExit as stop:
    status = stop.code if isinstance(stop.code, int) else 1
except BaseException:  # e.g. a collective failed because a peer died: say why and leave at once, since the
    traceback.print_exc()  # interpreter's own teardown with torch loaded takes seconds the retry is waiting for
    status = 1
exit_cleanly(status)
