"""Hangs and stragglers on the namespace hosts, both launch modes, with the budgets shortened by values: a hung
rank is found by the watchdog in its pod within its budget, every rank's place is reported (the culprit named
with its stack, in the log and under <checkpoints>/_job/diagnostics/), and the retry resumes from the last complete
checkpoint and finishes. A rank slowed by a SIGSTOP/SIGCONT duty cycle is named as a straggler first. Both drills
run on the chart's default storage, an emptyDir per worker pod (per-worker checkpoint volumes)."""

import json
import os
import re
import signal
import threading
import time

import pytest

from podruntime import protocol
from tests.support.chart_pods import REASON, e2e_values, render
from tests.support.faults import duty_cycle
from tests.support.harness import Cluster, step_losses, wait, wait_for
from train import checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
SIGNAL_S = 5  # hangDetection.signalSeconds: a stopped or idle rank is found by its signals, long before the budgets


def hang_values(shared_dir, mode: str, steps: int) -> dict:
    values = e2e_values(shared_dir, steps=steps, log_every=20, checkpoint_every=20)
    values["launchMode"] = mode
    values["job"]["runRetries"] = 1
    # The chart's budgets (a step's 120 s, a save's 900 s): what ends these hangs sooner is the signals, also for a
    # stop that lands in a save (every 20 steps).
    values["hangDetection"] = {"enabled": True, "startupSeconds": 300, "stepSeconds": 120, "checkpointSeconds": 900,
                               "signalSeconds": SIGNAL_S}
    values["worker"]["terminationGracePeriodSeconds"] = 20
    return values


def test_ssh_a_straggler_is_named_then_a_stopped_rank_is_found_reported_and_the_retry_resumes(shared_dir):
    """On the chart's default storage: an emptyDir per worker pod (per-worker checkpoint volumes; the ledger in the
    launcher pod), which the retry in the same pods keeps."""
    values = hang_values(shared_dir, "ssh", steps=300)
    del values["checkpoints"]
    values["train"]["config"]["model"] = {"n_layer": 4, "d_model": 128, "seq_len": 64}  # steps of some ms to slow
    with Cluster(render(values)) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        run = cluster.start(launcher)
        volumes = [cluster.checkpoint_dir(w) for w in workers]
        ckpt = volumes[0]  # rank 0's: the run's metrics.json
        wait_for(lambda: all(checkpoint.is_complete(v / "step_00000040") for v in volumes), 180, "checkpoint 40",
                 launcher.log)
        # What a healthy run names is the machine's noise (a loaded 2-core host may slow one rank 1.4x for ten
        # steps: a real straggler there); tests/test_train_units.py proves ranks inside the ratio are never named.
        # Only a line written after the slowing starts counts.
        healthy = len(launcher.log())
        victim = cluster.rank_pids(workers[1], ranks_only=True)[0]
        stop = threading.Event()
        slowing = threading.Thread(target=duty_cycle, args=(victim, stop))
        slowing.start()
        try:
            wait_for(lambda: "straggler: rank 1 " in launcher.log()[healthy:], 90, "rank 1 named as a straggler",
                     launcher.log)
        finally:
            stop.set()
            slowing.join()
        os.kill(victim, signal.SIGCONT)
        os.kill(victim, signal.SIGSTOP)
        stopped_at, stopped_wall = time.monotonic(), time.time()
        detected_at = wait_for(lambda: "hang on" in launcher.log(), SIGNAL_S + 60, "the hang report",
                               launcher.log)
        code = wait(run, timeout=300)
        log = launcher.log()
        assert code == 0, log[-5000:]
        # Found by its signal (the budget is 120 s; the last step came before the stop), and every rank placed.
        print(f"\nstopped rank found {detected_at - stopped_at:.1f}s after the SIGSTOP (signalSeconds {SIGNAL_S})")
        assert detected_at - stopped_at < SIGNAL_S + 30, log[-3000:]
        assert re.search(r"made no progress for \d+s \(its process stopped all that time, \w+ after step", log), \
            log[-3000:]
        assert re.search(r"rank 1 \(pid \d+, local rank 0\) on \S+: process stopped", log), log[-4000:]
        # The job's verdict, from both hosts' reports: the stopped rank on the second host, not the first host's rank
        # that waits for it in a collective (what the progress ConfigMap showed before).
        ledger = cluster.rank_state_dir(launcher) / "attempts"
        [cause] = [json.loads(p.read_text()) for p in ledger.glob("*/0001/cause.json")]
        assert cause["culprit"] == f"rank 1 on {workers[1].hostname}", cause
        assert f"hang: rank 1 on {workers[1].hostname} is the likely culprit (its process is stopped, after step " \
               in cause["reason"], cause
        # The stopped rank's stacks beside the checkpoints, on its own host's volume. (Whether worker 0's watchdog
        # also logged its rank waiting depends on which of the two hosts' windows ran out first: the stopped rank's
        # host ends the attempt, and the waiting rank's collective then fails. The nossh drill below needs that word
        # to find its culprit, and checks it there.)
        diagnostics = [p for v in volumes for p in (v / "_job" / "diagnostics").glob("run-*/*.txt")]
        assert workers[1].hostname in {p.name.removesuffix(".txt") for p in diagnostics}, diagnostics
        assert any("process stopped" in p.read_text() for p in diagnostics)
        assert not [p for v in volumes for p in (v / "_job" / "diagnostics").glob("run-*/*-rank1.fr.json")]
        # The retry resumed from a complete checkpoint and finished.
        retry = log[log.rindex("attempts: attempt 2 (1 of 1 failures used, 0 preemptions)"):]
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", retry).group(1))
        assert resumed >= 40 and max(step_losses(retry)) == 300
        assert all(checkpoint.is_complete(v / "step_00000300") for v in volumes)
        # Goodput: time hung runs from the last step, within a step of the test's stop, to the first watchdog's
        # report, whichever host's it was (rank 0's volume holds no report of another host's: the ledger tells the
        # retry when); the steps after the checkpoint the retry resumed from (saved every 20 steps) are recomputation.
        split = json.loads((ckpt / "metrics.json").read_text())["goodput_s"]
        stopped_step = max(int(n) for n in re.findall(r"made no progress for \d+s \(.*, \w+ after step (\d+)\)", log))
        reports = [p for w in workers for p in cluster.rank_state_dir(w).glob("hang-run-0001-*.json")]  # the verdicts
        reported = min(p.stat().st_mtime for p in reports) - stopped_wall
        assert abs(split["hung"] - reported) < 3, (split, reported)
        assert split["attempts"] == 2 and (split["recomputation"] > 0) == (stopped_step > resumed), (split, resumed)
        assert abs(split["unaccounted"]) < max(0.02 * split["wall"], 3), split
        # The fault's loss by its parts (rank 0's line at the retry's first step, and its progress file): every part
        # from the ledger's moments, detect the same span as `hung`, the parts adding up to the total.
        line = re.search(r"INFO attempt 2 lost ([\d.]+)s to the fault before it: (.*)", retry)
        assert line, retry[:3000]
        parts = {name: float(seconds) for name, seconds in re.findall(r"([a-z ]+?) ([\d.]+)s(?: \+ |$)", line[2])}
        assert list(parts) == [p.replace("_", " ") for p in protocol.FAULT_PARTS], line[0]
        assert abs(parts["detect"] - split["hung"]) < 0.1 and abs(sum(parts.values()) - float(line[1])) < 0.5, line[0]
        published = json.loads((cluster.rank_state_dir(workers[0]) / protocol.PROGRESS).read_text())["fault"]
        assert published["attempt"] == 2 and abs(published["total"] - float(line[1])) < 0.1, published
        print(line[0])


def test_nossh_a_rank_blocked_outside_any_collective_is_named_with_its_frame_and_the_retry_finishes(shared_dir):
    """On the chart's default storage: an emptyDir per worker pod (per-worker checkpoint volumes), which the
    retry in the same pods keeps."""
    values = hang_values(shared_dir, "nossh", steps=80)
    del values["checkpoints"]
    values["train"]["module"] = "tests.e2e.hang_probe"
    values["env"] += [{"name": "HANG_RANK", "value": "1"}, {"name": "HANG_AT_STEP", "value": "50"}]
    with Cluster(render(values)) as cluster:
        worker0, worker1 = cluster.pods_of("worker")
        processes = [cluster.start(w) for w in (worker0, worker1)]
        codes = [wait(p, timeout=400) for p in processes]
        log0, log1 = worker0.log(), worker1.log()
        assert codes == [0, 0], log0[-4000:] + log1[-4000:]
        # Worker 1's watchdog names the rank, its host and the frame it is stuck in.
        assert re.search(r"watchdog: \S+: rank 1 \(pid \d+, local rank 0\) on \S+: in read_the_stuck_mount "
                         r"\(\S+hang_probe.py:\d+\), not in a collective; likely the culprit", log1), log1[-4000:]
        # Found by its signals, long before the 120-s budget: idle outside any collective while rank 0, on the other
        # host, waits in one (worker 0's watchdog found it waiting and said so over the channel).
        found = re.search(r"made no progress for (\d+)s \(no CPU and no I/O all that time, outside any collective, "
                          rf"while rank 0 \(pid \d+, local rank 0\) on {worker0.hostname} waits in one, training "
                          r"after step 49\)", log1)
        assert found and int(found[1]) < SIGNAL_S + 30, log1[-4000:]
        print(f"\nidle rank found {found[1]}s after its last step (signalSeconds {SIGNAL_S})")
        ckpt0, ckpt1 = cluster.checkpoint_dir(worker0), cluster.checkpoint_dir(worker1)
        assert ckpt0 != ckpt1  # each worker's own volume
        run = re.search(r"hang on \S+ \((run-\S+)\)", log1).group(1)
        assert "read_the_stuck_mount" in (ckpt1 / "_job" / "diagnostics" / run / f"{worker1.hostname}.txt").read_text()
        # Worker 0's watchdog found rank 0 waiting and said so (the word that found the culprit), with rank 0's
        # flight recorder: the collective it waits in has not completed.
        assert re.search(r"waiting on \S+ \(run-\S+\): rank 0 \(pid \d+, local rank 0\) has made no step for \d+s, "
                         r"waiting in a collective", log0), log0[-3000:]
        # Rank 1's flight recorder: every collective it started completed; rank 0's waits in the next one.
        culprit = re.search(r"likely the culprit: .*; last recorded collective #(\d+) gloo:\w+ in group (\S+) "
                            r"\(completed\)", log1)
        assert culprit, "\n".join(line for line in log1.splitlines() if "watchdog" in line)
        waiting = re.search(r"rank 0 \(pid \d+, local rank 0\) on \S+: waits in a collective: .*; last recorded "
                            r"collective #(\d+) gloo:\w+ in group (\S+) \(pending, scheduled\)", log0)
        assert waiting and (waiting[2] != culprit[2] or int(waiting[1]) == int(culprit[1]) + 1), log0[-3000:]
        # The job's verdict, from both workers' reports at the start barrier: the blocked rank on the second host.
        [cause] = [json.loads(p.read_text()) for p in (ckpt0 / "_job" / "attempts").glob("*/0001/cause.json")]
        assert cause["culprit"] == f"rank 1 on {worker1.hostname}", cause
        assert "is the likely culprit (it is stuck outside any collective: in read_the_stuck_mount" in \
            cause["reason"], cause
        # The attempt was retried in the same pods, from the last complete checkpoint, to the end.
        assert "starting the run, attempt 2 (1 of 1 failures used, 0 preemptions)" in log0
        # Each worker's loop started its retry's ranks itself, as DeepSpeed's launcher started them the first time.
        for log in (log0, log1):
            assert re.search(r"running \(run-0002-\S+\): ranks \d started by the loop as DeepSpeed's launcher started "
                             r"them in run-0001-", log), log[-3000:]
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", log0).group(1))
        assert resumed == 40 and max(step_losses(log0)) == 80
        # From the part each worker committed on its own volume: every tag the run kept is on both.
        for directory in (ckpt0, ckpt1):
            assert checkpoint.read_manifest(directory / "step_00000080")["storage"] == checkpoint.PER_WORKER
            assert [t.name for t in checkpoint.tags_newest_first(directory)] == [
                "step_00000080", "step_00000060", "step_00000040"]
