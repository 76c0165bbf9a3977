"""The attempt loop: one life cycle for both launch modes, in the shape of torch elastic's agent
(SimpleElasticAgent._invoke_run): the hosts meet and the ledger's owner begins an attempt (ledger.Ledger.begin: the
stop rules and the budget first); the ranks start; when they end, every host's evidence is gathered and the ledger
decides why the attempt ended, once (causes.ATTEMPT_RULES); then the loop exits, stops, or starts the next attempt
from the last complete checkpoint.

The seam is Mode: how the hosts meet and how the ranks start. The loop does everything else.
- ssh (sshmode.Launcher): one loop, in the launcher pod, owns the ledger and drives passive workers over pdsh: it
  meets them by SSH (every worker reachable and of the current template, cleared of earlier ranks), starts
  DeepSpeed's runner, and gathers each worker's evidence in one pdsh round.
- nossh (nosshmode.Worker): one loop per worker pod; the hosts meet on worker 0, which owns the ledger: every worker
  joins, worker 0 begins the attempt and sends it out, each worker starts DeepSpeed's launcher for its own node
  rank, and each sends its evidence back when its run ends.
During an attempt a channel stays open between every host and the ledger's owner (channel.py: nossh, the meeting's
own connections; ssh, the launcher's connection to each worker's agent). Today it carries a pod's SIGTERM to the
owner before the pod's ranks stop, so that the attempt is a preemption whichever pod was deleted; a hang can be
judged across hosts over it while it happens.

Exit statuses: the run's (0 when the program finished), protocol.EXIT_STOPPED after a SIGTERM,
protocol.EXIT_NOT_RETRIED when a stop rule ends the job, protocol.EXIT_CONFIG_ERROR after a configuration error.
"""

import signal
import subprocess
import threading
import time
from typing import Protocol

from podruntime import host, ownership, protocol
from podruntime.ledger import Began, Ledger, last_word
from podruntime.text import Log, lines


def hosts_of(hostfile: str) -> list[str]:
    """The hosts of the chart's MPI-style hostfile (`<host> slots=N` lines; # comments), worker 0 first: the one
    parser of it."""
    text = host.chart_file(hostfile) or ""
    return [line.split()[0] for line in lines(text) if line.strip() and not line.lstrip().startswith("#")]


class Mode(Protocol):
    """How the hosts of one launch mode meet and start their ranks."""

    def meet(self) -> Began | int:
        """The hosts meet and the attempt begins: the attempt, or the loop's exit status (a stop rule, a deadline)."""

    def run(self, attempt: Began) -> int:
        """This host's part of the attempt, to its end: DeepSpeed's exit status."""

    def gather(self, attempt: Began, status: int) -> list[dict]:
        """Every host's evidence of the ended attempt, where this host owns the ledger ([] elsewhere, after sending
        its own to the owner)."""

    def clear(self) -> None:
        """Ranks an ended attempt left anywhere, stopped before the next."""

    def stop(self) -> None:
        """SIGTERM: the ledger's owner is told (a preemption) before this host's ranks are stopped."""


class Child:
    """A program the loop runs and waits for (DeepSpeed's runner or launcher), with a trapped signal handled
    meanwhile. A run has a key (its run ID): a run cancelled by key never starts, and is ended if it runs (another
    host left it)."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.key = ""
        self.cancelled: set[str] = set()
        self.ended: set[str] = set()  # runs that ran here and ended
        self.lock = threading.Lock()

    def run(self, argv: list[str], env: dict[str, str], key: str = "") -> int:
        with self.lock:  # a cancel() either comes first (no start) or sees the process
            if key and key in self.cancelled:
                return 128 + signal.SIGTERM
            try:
                self.process, self.key = subprocess.Popen(argv, env=env), key
            except OSError as err:
                print(f"cannot start {argv[0]}: {err.strerror}", flush=True)
                return 127
        try:
            status = self.process.wait()
        finally:
            with self.lock:
                self.process = None
                self.ended.add(key)
        return 128 - status if status < 0 else status  # killed by signal N: 128+N, as a shell says it

    def cancel(self, key: str) -> bool:
        """Run `key` is not to start (or go on): True the first time it is said, while it has not ended."""
        with self.lock:
            if not key or key in self.cancelled or key in self.ended:
                return False
            self.cancelled.add(key)
            return True

    def terminate(self, key: str | None = None) -> None:
        """SIGTERM to the running program (only if it runs run `key`, where one is given)."""
        with self.lock:
            process = self.process if key is None or self.key == key else None
        if process is not None and process.poll() is None:
            try:
                process.terminate()
            except OSError:
                pass


class AttemptLoop:
    def __init__(self, mode: Mode, ledger: Ledger | None, log: Log):
        self.mode, self.ledger, self.log = mode, ledger, log
        self.stopping = False

    def on_signal(self, signum, frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.log(f"{signal.Signals(signum).name}: stopping the run")
        self.mode.stop()

    def run(self) -> int:
        # PID 1 ignores SIGTERM without a handler: set it first, also for the meeting.
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        refused = ownership.claim_volume()  # the pod's checkpoint volume, before anything reads it
        if refused:  # the pod's last word only: the ledger on that volume is the other project's
            self.log(f"ERROR: {refused}")
            host.termination_message(last_word("failed", "config-error", refused))
            return protocol.EXIT_CONFIG_ERROR
        while True:
            met = self.mode.meet()
            if self.stopping:
                return protocol.EXIT_STOPPED
            if isinstance(met, int):
                return met
            status = self.mode.run(met)
            returned = time.time()
            self.log(f"DeepSpeed exited with status {status}")
            ended = self.end(met, status, returned)
            if ended is not None:
                return ended
            self.mode.clear()

    def end(self, attempt: Began, status: int, returned: float | None = None) -> int | None:
        """Records the attempt's end (the owner, from every host's evidence); the loop's exit status, or None to
        go on. A stop and a configuration error are never retried; other failures are while the budget lasts
        (the owner's ledger decides at the next meeting, counting every pod's failures)."""
        # Also after a stop: the evidence holds the step the ranks stopped (and saved) at.
        evidence = self.mode.gather(attempt, status) if status != 0 else []
        if self.ledger is not None:
            self.ledger.end(attempt.number, status, evidence, returned)
        if status == 0:
            return 0
        if self.stopping:
            return protocol.EXIT_STOPPED
        if status == protocol.EXIT_CONFIG_ERROR:
            self.log(f"status {status} is a configuration error (bad arguments or input files): not retried")
            return protocol.EXIT_CONFIG_ERROR
        return None
