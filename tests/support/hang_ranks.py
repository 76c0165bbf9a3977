"""Rank processes for the watchdog's signals (podruntime/watchdog.py), for its tests and its bench: the train
package's heartbeat (train/rankstate.py) and a real gloo process group, so "waits in a collective" is torch's own
all_reduce waiting for a peer; and a Host: a state directory (one pod's) with its ranks and its watchdog, run as the
attempt loop runs it (a thread)."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from podruntime.tenantfiles import Tree
from podruntime.text import Log
from podruntime.watchdog import Watchdog
from tests.support.harness import wait_for
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 120.0  # every budget, as the chart's step budget: a verdict before it is the signals'
RUN = "run-0007-abc"

# A rank: joins a gloo group of `world` ranks, steps (a beat each, an all_reduce each) `steps` times, then does what
# its role says. Its peers then wait for it in the next all_reduce (`wait`: this rank is such a peer).
RANK = r"""
import os, sys, time, multiprocessing
import torch, torch.distributed as dist
from train import rankstate
role, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
rankstate.report("training", 0)
for step in range(1, steps + 1):
    dist.all_reduce(torch.ones(4))
    rankstate.beat(step)
print("stepped", flush=True)


def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


if role == "wait":
    dist.all_reduce(torch.ones(4))  # its peer never comes
elif role == "stuck":  # blocked outside any collective, as a data loader on a dead mount
    fifo = os.path.join(os.environ["DS_RANK_STATE_DIR"], f"stuck-{os.getpid()}")
    os.mkfifo(fifo)
    open(fifo).read()
elif role == "busy":  # a long step: CPU, outside any collective
    spin(600)
elif role == "reading":  # a slow reader: a byte now and then, no CPU to speak of
    with open("/dev/zero", "rb", buffering=0) as source:
        while True:
            source.read(1)
            time.sleep(0.3)
elif role == "loader":  # the rank waits on its data loader's worker, which computes
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    context.Process(target=lambda: (spin(600), queue.put(1)), daemon=True).start()
    queue.get()
elif role == "sleep":
    time.sleep(600)
"""


class Host:
    """One host's ranks and its watchdog: a state directory of its own."""

    def __init__(self, tmp: Path, name: str, window: float, budget: float = BUDGET_S):
        self.state = tmp / name
        self.state.mkdir(mode=0o700)
        self.log = io.StringIO()
        log = Log(f"watchdog: {name}", stream=self.log)
        self.watchdog = Watchdog(Tree(str(self.state)), {"starting": budget, "training": budget,
                                                         "checkpoint": budget, "signals": window}, None, log)
        self.stop = threading.Event()
        self.ranks: list[subprocess.Popen] = []

    def rank(self, rank: int, world: int, init: str, role: str, steps: int = 3) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
               "INIT": init, "DS_RANK_STATE_DIR": str(self.state), "DS_RUN_ID": RUN}
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        process = subprocess.Popen([sys.executable, "-c", RANK, role, str(steps)], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.ranks.append(process)
        return process

    def start(self) -> None:
        self.watchdog.start(self.stop)

    def report(self) -> dict | None:
        path = self.state / f"hang-{RUN}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def text(self) -> str:
        path = self.state / f"hang-{RUN}.txt"
        return path.read_text() if path.is_file() else ""

    def close(self) -> None:
        self.stop.set()
        for process in self.ranks:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass
            process.wait(timeout=30)


def init() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def state_lines(host: Host) -> list[str]:
    """Every rank's state line (its <pid> file; never the FIFO beside it, whose open would block)."""
    return [p.read_text() for p in host.state.iterdir() if p.name.isdigit()]


def wait_stepped(host: Host, count: int) -> None:
    wait_for(lambda: sum("step=3" in line for line in state_lines(host)) >= count, 120, f"{count} rank(s) at step 3",
             lambda: "\n".join(state_lines(host)))


def verdict_within(host: Host, seconds: float) -> tuple[dict, float]:
    """The host's hang report and the seconds this wait for it took (or the wait's failure)."""
    started = time.monotonic()
    wait_for(host.report, seconds, "a hang report", lambda: host.log.getvalue())
    return host.report(), time.monotonic() - started
