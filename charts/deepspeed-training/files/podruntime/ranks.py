"""This host's DeepSpeed ranks: finding them, and stopping them so that they save what they can and no more time is
spent than that. Run on SIGTERM by the pod's attempt loop (nossh) and the ssh worker's agent, and over pdsh by the
ssh launcher, which clears ranks an earlier attempt left before it starts the next.

Ranks that report their state (protocol.RANK_FILE) do not hold the pod for the whole grace period when they cannot
save: `starting` and `restoring` (no step finished since the rank started: nothing to save) are killed at once, and
`training` still there ACK_SECONDS after SIGTERM means the rank never ran its handler (stuck in a C++ collective,
waiting for peers that are gone): it is killed then. Ranks that acknowledged (`stopping`) or are `saving`, and
programs that report nothing, get the whole grace period (DS_KILL_GRACE_SECONDS).
"""

import os
import signal
import time

from podruntime import host, protocol, rankstart
from podruntime.tenantfiles import Tree
from podruntime.text import Log

LAUNCHER = "deepspeed.launcher.launch"
ACK_SECONDS = 10
POLL_S = 0.1


def is_rank(argv: list[str]) -> bool:
    return any(word.startswith("--local_rank=") for word in argv)


def is_launcher(argv: list[str]) -> bool:
    """DeepSpeed's launcher, or the loop's starter in its place on a retry (rankstart.py)."""
    return any(LAUNCHER in word for word in argv) or host.runs_pod_program(argv, rankstart.PROGRAM)


def find(uid: int | None = None) -> tuple[list[int], list[int]]:
    """(the launchers, their ranks) of this host's user: the ranks are the launchers' children, or, where a
    launcher died, the processes that carry its --local_rank=."""
    me = os.getpid()
    processes = [p for p in host.processes(os.getuid() if uid is None else uid) if p.pid != me]
    launchers = [p.pid for p in processes if is_launcher(p.argv)]
    ranks = [p.pid for p in processes if p.ppid in launchers] if launchers else \
        [p.pid for p in processes if is_rank(p.argv)]
    return launchers, ranks


def state_of(state: Tree | None, pid: int) -> str:
    if state is None:
        return ""
    return protocol.rank_line(state.read_text(str(pid), protocol.MAX_LINE_BYTES) or "")[0]


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop(grace: float, state: Tree | None, log: Log) -> None:
    """SIGTERM to the ranks (they save a checkpoint together and exit), then SIGKILL to those same processes after
    `grace` seconds; returns as soon as they are gone."""
    launchers, ranks = find()
    if not launchers and not ranks:
        return
    log(f"stopping ranks {' '.join(map(str, ranks)) or 'none'} (launchers {' '.join(map(str, launchers)) or 'none'})")
    targets = [*launchers, *ranks]

    def kill_where(word: str, why: str) -> None:
        doomed = [pid for pid in ranks if state_of(state, pid) == word]
        if doomed:
            log(f"SIGKILL to {' '.join(map(str, doomed))}: {why}")
            _kill(doomed, signal.SIGKILL)

    for word in protocol.NOTHING_TO_SAVE_STATES:
        kill_where(word, f"no step finished since it started ({word}), nothing to save")
    # Only the ranks: DeepSpeed's launcher reaps them and exits, and would SIGKILL them itself after 30 s.
    _kill(ranks or launchers, signal.SIGTERM)
    started, acked = time.monotonic(), False
    while time.monotonic() - started < grace:
        if not any(host.alive(pid) for pid in targets):
            return
        if not acked and time.monotonic() - started >= ACK_SECONDS:
            acked = True
            kill_where("training", f"no answer to SIGTERM in {ACK_SECONDS}s: stuck in a collective, cannot save")
        time.sleep(POLL_S)
    log(f"still running after {grace:.0f}s, sending SIGKILL")
    _kill(targets, signal.SIGKILL)


def stop_here(env=os.environ, log: Log | None = None) -> None:
    """stop() with this pod's grace (DS_KILL_GRACE_SECONDS) and state directory."""
    state = env.get(protocol.STATE_DIR_ENV)
    grace = env.get("DS_KILL_GRACE_SECONDS", "")
    stop(float(grace) if grace.isdigit() else 20.0, Tree(state) if state else None,
         log or Log(f"stop-ranks: {host.hostname()}"))
