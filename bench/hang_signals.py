"""How soon the watchdog finds a hung rank, and what its per-second reads cost (issue: failures cost seconds), side by
side on this machine:
(a) time from the fault to the hang report with the chart's defaults (hangDetection.signalSeconds 20, stepSeconds
    120), against the same fault with the signals off (the step budget alone): a stopped rank (SIGSTOP), a rank idle
    outside any collective while a peer on its host waits, and the same with the peer on another host (its watchdog's
    `waiting`, relayed as the ledger's owner relays it);
(b) the watchdog thread's CPU with RANKS ranks beating STEPS_PER_S steps a second, signals on and off, and the step
    rate of those ranks (what a rank loses to the reads: nothing is asked of it, so only the CPU the thread takes).

Real rank processes (tests/support/hang_ranks.py: the train package's heartbeat and a gloo group), real watchdogs.

    python bench/hang_signals.py [--budget-runs]   (--budget-runs: also the 120-s runs with the signals off)
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podruntime.tenantfiles import Tree  # noqa: E402
from podruntime.text import Log  # noqa: E402
from podruntime.watchdog import Watchdog  # noqa: E402
from tests.support.hang_ranks import Host, init, wait_stepped  # noqa: E402

WINDOW_S = 20.0  # the chart's hangDetection.signalSeconds
STEP_BUDGET_S = 120.0  # the chart's hangDetection.stepSeconds
RANKS, STEPS_PER_S, COST_SECONDS = 8, 50, 30

BEATS = """
import sys, time
from train import rankstate
pace, seconds = float(sys.argv[1]), float(sys.argv[2])
rankstate.report("training", 0)
started, step = time.monotonic(), 0
while time.monotonic() - started < seconds:
    step += 1
    rankstate.beat(step)
    time.sleep(max(0.0, started + step / pace - time.monotonic()))
print(step / (time.monotonic() - started))
"""


def detection(tmp: Path, case: str, window: float) -> float:
    """Seconds from the fault to the first hang report."""
    hosts = [Host(tmp, f"{case}-{window:.0f}-w0", window, STEP_BUDGET_S)]
    address = init()
    try:
        if case == "stopped":
            culprit = hosts[0].rank(0, 2, address, "busy")
            hosts[0].rank(1, 2, address, "wait")
        elif case == "idle, peer on its host":
            culprit = hosts[0].rank(0, 2, address, "stuck")
            hosts[0].rank(1, 2, address, "wait")
        else:
            hosts.append(Host(tmp, f"{case}-{window:.0f}-w1", window, STEP_BUDGET_S))
            hosts[1].watchdog.announce = hosts[0].watchdog.notice
            culprit = hosts[0].rank(0, 2, address, "stuck")
            hosts[1].rank(1, 2, address, "wait")
        for host in hosts:
            wait_stepped(host, len(host.ranks))
            host.start()
        # The fault's moment: the SIGSTOP, or the stuck rank's last step (its state file's mtime).
        if case == "stopped":
            os.kill(culprit.pid, signal.SIGSTOP)
            fault = time.time()
        else:
            fault = (hosts[0].state / str(culprit.pid)).stat().st_mtime
        deadline = time.monotonic() + STEP_BUDGET_S + 120
        while hosts[0].report() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        found = (hosts[0].state / "hang-run-0007-abc.json").stat().st_mtime if hosts[0].report() else float("nan")
        return found - fault
    finally:
        for host in hosts:
            host.close()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def polling_cost(tmp: Path, window: float) -> tuple[float, float]:
    """(the watchdog thread's CPU, % of one core; the ranks' mean steps/s) over COST_SECONDS."""
    state = tmp / f"cost-{window:.0f}"
    state.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_RANK_STATE_DIR": str(state)}
    ranks = [subprocess.Popen([sys.executable, "-c", BEATS, str(STEPS_PER_S), str(COST_SECONDS + 10)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True) for r in range(RANKS)]
    while len([p for p in state.iterdir() if p.name.isdigit()]) < RANKS:
        time.sleep(0.1)
    watchdog = Watchdog(Tree(str(state)), {"starting": 300, "training": STEP_BUDGET_S, "checkpoint": 900,
                                           "signals": window}, None, Log("watchdog", stream=open(os.devnull, "w")))
    stop = threading.Event()
    thread = watchdog.start(stop)
    time.sleep(3)
    tid = thread.native_id
    before, started = cpu_seconds(os.getpid(), tid), time.monotonic()
    time.sleep(COST_SECONDS)
    used = cpu_seconds(os.getpid(), tid) - before
    share = 100 * used / (time.monotonic() - started)
    stop.set()
    rates = [float(p.communicate()[0].split()[-1]) for p in ranks]
    return share, sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-runs", action="store_true", help="also the runs with the signals off (2 min each)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("stopped", "idle, peer on its host", "idle, peer on another host"):
            signals = detection(Path(tmp), case, WINDOW_S)
            budget = detection(Path(tmp), case, 0) if args.budget_runs else float("nan")
            rows.append((f"found: {case}", f"{signals:.1f} s", f"{budget:.1f} s" if budget == budget
                         else f"{STEP_BUDGET_S:.0f} s (the step budget; not run)"))
        on, off = polling_cost(Path(tmp), WINDOW_S), polling_cost(Path(tmp), 0)
        rows.append((f"watchdog thread's CPU, {RANKS} ranks at {STEPS_PER_S} steps/s", f"{on[0]:.2f}% of one core",
                     f"{off[0]:.2f}% of one core"))
        rows.append(("the ranks' steps/s (paced)", f"{on[1]:.1f}", f"{off[1]:.1f}"))
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | signals on ({WINDOW_S:.0f} s) | signals off (budgets only) |\n"
          f"| {'-' * width} | --- | --- |")
    for name, on_value, off_value in rows:
        print(f"| {name:<{width}} | {on_value} | {off_value} |")


if __name__ == "__main__":
    main()
