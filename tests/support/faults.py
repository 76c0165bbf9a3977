"""Faults the drills inject into a rank's process."""

import os
import signal
import threading
import time


def duty_cycle(pid: int, stop: threading.Event, stopped_s: float = 0.03, running_s: float = 0.01) -> None:
    """Keeps `pid` stopped 3/4 of the time, in slices shorter than its step: a rank on a throttled CPU. (At 1/2,
    a loaded 2-core machine's own noise broke the 10-step run now and then before the job ended.)"""
    while not stop.is_set():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stopped_s)
        os.kill(pid, signal.SIGCONT)
        time.sleep(running_s)
