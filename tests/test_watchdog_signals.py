"""The watchdog's signals (podruntime/watchdog.py): a stopped rank, and a rank idle outside any collective while a
peer waits in one, are hung within the signal window, long before the step budget; a busy rank, a reading rank and a
rank whose data loader works are not. Real rank processes: the train package's heartbeat (train/rankstate.py) and a
real gloo process group, so "waits in a collective" is torch's own all_reduce waiting for a peer. The watchdogs run
in this process as the attempt loop runs them (a thread each); two state directories are two hosts, and what the
ledger's owner relays between them (`waiting`) is the watchdogs' own announce/notice."""

import os
import re
import signal
import time

import pytest

from tests.support.hang_ranks import BUDGET_S, RUN, Host, init, verdict_within, wait_stepped
from tests.support.harness import wait_for

WINDOW_S = 4.0  # hangDetection.signalSeconds here (the chart's default is 20)


@pytest.fixture
def hosts(tmp_path):
    made: list[Host] = []

    def make(name: str, window: float = WINDOW_S) -> Host:
        made.append(Host(tmp_path, name, window))
        return made[-1]

    yield make
    for host in made:
        host.close()


def test_a_stopped_rank_is_hung_after_the_window_not_the_budget(hosts):
    host = hosts("w-0")
    address = init()
    stuck = host.rank(0, 2, address, "busy")
    host.rank(1, 2, address, "wait")
    wait_stepped(host, 2)
    host.start()
    os.kill(stuck.pid, signal.SIGSTOP)
    report, _ = verdict_within(host, BUDGET_S / 2)
    kinds = {r["rank"]: r["kind"] for r in report["ranks"]}
    assert kinds[0] == "stopped", report
    assert "its process stopped all that time" in host.text(), host.text()
    # The culprit's peer on this host waits in the all_reduce: its stack says so (read through its FIFO).
    assert kinds[1] == "in-collective", report


def test_a_rank_idle_outside_any_collective_while_a_peer_on_its_host_waits_is_hung(hosts):
    host = hosts("w-0")
    address = init()
    host.rank(0, 2, address, "stuck")
    host.rank(1, 2, address, "wait")
    wait_stepped(host, 2)
    host.start()
    report, _ = verdict_within(host, BUDGET_S / 2)
    kinds = {r["rank"]: r["kind"] for r in report["ranks"]}
    assert kinds == {0: "outside-collective", 1: "in-collective"}, report
    first = host.text().splitlines()[0]
    assert "rank 0 (pid" in first and "no CPU and no I/O all that time, outside any collective, while rank 1" in first
    assert not re.search(r"rank 1 \(pid \d+, local rank 0\) made no progress", first), first  # never the waiting one


def test_across_hosts_the_waiting_hosts_word_finds_the_idle_rank_on_the_other(hosts):
    """One rank per host (the cluster tier's sizing): host w-0's rank is stuck, w-1's waits for it. Only w-1's
    watchdog can see a rank waiting; what it announces reaches w-0's (the ledger's owner relays it)."""
    culprit_host, waiting_host = hosts("w-0"), hosts("w-1")
    relayed: list[tuple] = []

    def relay(run: str, since: float, who: str) -> None:
        relayed.append((run, since, who))
        culprit_host.watchdog.notice(run, since, who)

    waiting_host.watchdog.announce = relay
    address = init()
    culprit_host.rank(0, 2, address, "stuck")
    waiting_host.rank(1, 2, address, "wait")
    wait_stepped(culprit_host, 1)
    wait_stepped(waiting_host, 1)
    culprit_host.start()
    waiting_host.start()
    report, _ = verdict_within(culprit_host, BUDGET_S / 2)
    assert [(r["rank"], r["kind"]) for r in report["ranks"]] == [(0, "outside-collective")], report
    assert relayed and relayed[0][0] == RUN and "rank 1 (pid" in relayed[0][2], relayed
    assert "while rank 1 (pid" in culprit_host.text() and "on " in culprit_host.text(), culprit_host.text()
    # The waiting host reports nothing of its own: its rank is a victim, and its peer's end ends it.
    assert waiting_host.report() is None


@pytest.mark.parametrize("role", ["busy", "reading", "loader"])
def test_a_busy_reading_or_loading_rank_is_not_hung_by_the_signals_while_its_peer_waits(hosts, role):
    """A long step (CPU), a slow reader (I/O) and a rank whose data loader's worker computes: each is slow, not hung;
    left to the step budget. Watched for three windows after its last step, with a peer waiting all along."""
    host = hosts("w-0")
    address = init()
    host.rank(0, 2, address, role)
    host.rank(1, 2, address, "wait")
    wait_stepped(host, 2)
    host.start()
    quiet_since = time.monotonic()
    # Three windows with the rank quiet: the watchdog looked (the peer's stack says it waits) and judged nothing.
    wait_for(lambda: time.monotonic() - quiet_since > 3 * WINDOW_S + 2, 60, "three windows")
    assert host.report() is None, host.text()
    assert host.watchdog.looked is not None, "the quiet ranks' stacks were never read"


def test_without_a_waiting_peer_an_idle_rank_is_left_to_the_budget(hosts):
    """A rank of a one-rank job idle outside a collective (nobody waits for it: a program that sleeps), a stale word
    of a wait that began long before its last step, and one dated a day ahead: none makes a hang by the signals."""
    host = hosts("w-0")
    host.rank(0, 1, init(), "stuck")
    wait_stepped(host, 1)
    host.watchdog.notice(RUN, time.time() - 3600, "rank 9 (pid 1, local rank 0) on w-9")  # an hour-old wait
    host.watchdog.notice(RUN, time.time() + 86400, "rank 9 (pid 1, local rank 0) on w-9")  # from a day ahead
    host.start()
    quiet_since = time.monotonic()
    wait_for(lambda: time.monotonic() - quiet_since > 3 * WINDOW_S + 2, 60, "three windows")
    assert host.report() is None, host.text()
