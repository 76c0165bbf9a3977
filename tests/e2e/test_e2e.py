"""The rendered chart trains across hosts: launcher + workers as network-namespace hosts (see harness.py)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from podruntime import protocol
from podruntime.ledger import Ledger
from tests.support.chart_pods import COLLECTIVE_TIMEOUT_MINUTES, REASON, SECRET_VALUE, UID, e2e_values, render
from tests.support.harness import (
    ROOT,
    Cluster,
    step_losses,
    wait,
    wait_for,
)
from train import checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
def test_the_rendered_chart_trains_across_hosts(shared_dir):
    docs = render(e2e_values(shared_dir))
    with Cluster(docs) as cluster:
        code, log = cluster.run_launcher(timeout=240)
        assert code == 0, log[-5000:]
        assert "wait-for-workers: all 2 workers are reachable" in log
        assert "world size 2 | ZeRO stage 2" in log
        losses = step_losses(log)
        assert sorted(losses) == [10, 20, 30, 40]
        assert losses[40] < losses[10]
        ckpt = cluster.checkpoint_dir()
        assert (ckpt / "latest").read_text() == "step_00000040"
        assert checkpoint.is_complete(ckpt / "step_00000040")
        # The chart's env reached every rank: plain values through .deepspeed_env, the secret through sshd.
        expected_secret = __import__("hashlib").sha256(SECRET_VALUE.encode()).hexdigest()[:12]
        probes = re.findall(r"rank-probe rank=(\d) host=(\S+) E2E_MARKER=(\S+) DEEPSPEED_TIMEOUT=(\S+) "
                            r"E2E_SECRET_sha256=(\S+)", log)
        assert sorted(p[0] for p in probes) == ["0", "1"]
        assert {p[1] for p in probes} == {w.hostname for w in cluster.pods_of("worker")}
        assert all(p[2] == "from-the-chart" and p[4] == expected_secret for p in probes), probes
        # The one collective timeout: every rank has it, and the train package's process group uses it.
        assert {p[3] for p in probes} == {str(COLLECTIVE_TIMEOUT_MINUTES)}, probes
        assert f"collective timeout {COLLECTIVE_TIMEOUT_MINUTES} min" in log
        assert SECRET_VALUE not in log  # never in the launcher's log
        # Ranks ran as the pod's non-root user.
        assert all(p.uid == UID for p in cluster.pods)


def test_the_launcher_fails_within_its_deadline_naming_the_missing_worker(shared_dir):
    values = e2e_values(shared_dir)
    values["job"]["waitTimeoutSeconds"] = 5
    with Cluster(render(values)) as cluster:
        cluster.start_workers(1)
        launcher = cluster.pods_of("launcher")[0]
        started = time.monotonic()
        process = cluster.start(launcher)
        # While it waits, where the job stands says for whom and how long yet (the progress ConfigMap, `make why`).
        verdict, said = cluster.rank_state_dir(launcher) / protocol.VERDICT, set()
        while process.poll() is None and time.monotonic() - started < 60:
            try:
                said.add(json.loads(verdict.read_text()).get("reason", ""))
            except (OSError, ValueError):  # not written yet
                pass
            time.sleep(0.05)
        code = wait(process, timeout=60)
        elapsed = time.monotonic() - started
        assert code == 1
        missing = cluster.pods_of("worker")[1]
        assert f"wait-for-workers:   {missing.fqdn}: SSH failed" in launcher.log()
        assert elapsed < 5 + 15
        assert any(re.fullmatch(rf"the launcher waits for 1 of 2 workers \({re.escape(missing.fqdn)}; "
                                rf"{re.escape(missing.fqdn.split('.')[0])}: SSH failed.*\): \d+s more, then the job "
                                r"fails \(job\.waitTimeoutSeconds\)", reason, re.S) for reason in said), said


def test_a_killed_rank_fails_the_run_within_the_timeout_and_a_spent_budget_fails_the_job(shared_dir):
    """runRetries 0: the first failure spends the job's budget; the launcher ends with the ledger's status, which
    the chart's podFailurePolicy turns into a failed Job (no new pod)."""
    values = e2e_values(shared_dir, steps=100000, log_every=10, checkpoint_every=0)
    values["job"]["runRetries"] = 0
    with Cluster(render(values)) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        first = cluster.start(launcher)
        wait_for(lambda: "INFO step 10/" in launcher.log(), 180, "training to start", launcher.log)
        victim = cluster.rank_pids(workers[1], ranks_only=True)
        assert victim, "no rank process on worker 1"
        killed_at = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        code = wait(first, timeout=120)
        failed_after = time.monotonic() - killed_at
        log = launcher.log()
        assert code == protocol.EXIT_NOT_RETRIED, log[-3000:]
        assert "attempts: attempt 1 (0 of 0 failures used, 0 preemptions)" in log
        assert "failure budget spent: 1 failed attempts, job.runRetries=0 allows 0" in log
        assert failed_after < 60 + 30, f"job took {failed_after:.0f}s to fail"  # the collective timeout + teardown
        for worker in workers:
            wait_for(lambda w=worker: not cluster.rank_pids(w), 30, f"no ranks left on {worker.name}")


def test_a_lost_pod_a_crash_and_a_preemption_on_one_job_then_attempt_4_runs_with_2_failures_used(shared_dir):
    """The job's failure budget (runRetries 2), across pods. Crashes: the launcher pod lost with its node (every
    process SIGKILLed: no outcome written; the next pod counts it, and clears the ranks that trained on), then a
    killed rank (retried in that next pod). A preemption: SIGTERM to the launcher (the ranks stop and save at the
    next step, the Job's third pod resumes there). Attempt 4 runs, in the third pod, with the two failures of the
    two pods before counted, says so, and finishes."""
    values = e2e_values(shared_dir, steps=300, log_every=5, checkpoint_every=10)
    values["job"]["runRetries"] = 2
    with Cluster(render(values)) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        job_started = time.time()  # the test's own clock: the first launcher pod starts
        process = cluster.start(launcher)
        pod_logs, preempted_at = [], []
        # Its timeline of start-up: from the end of the attempt before (the job's start, a crash's kill, a
        # preemption's SIGTERM, the old ranks' end after a lost pod) to the attempt's first logged step.
        ended_at, startup_seen = time.monotonic() - (time.time() - job_started), 0.0

        def trains(attempt: int) -> bool:
            after = launcher.log().split(f"attempts: attempt {attempt} (")
            return len(after) > 1 and "INFO step" in after[-1]

        def next_pod(attempt: int, stopped_ranks: bool) -> int:
            """The Job controller's next launcher pod, once this one ended: its exit status."""
            nonlocal process
            code = wait(process, timeout=120)
            pod_logs.append(launcher.log())
            for worker in workers if stopped_ranks else ():  # the launcher's stop reached the workers' ranks
                wait_for(lambda w=worker: not cluster.rank_pids(w), 60, f"no ranks left on {worker.name}")
            process = cluster.start(launcher, log_name=f"launcher-{attempt}", new_pod=True)
            return code

        for attempt, fault in enumerate(("lost", "crash", "preemption"), start=1):
            startup_seen += wait_for(lambda a=attempt: trains(a), 180, f"attempt {attempt} to train",
                                     lambda: launcher.log()[-3000:], interval=0.02) - ended_at
            if fault == "crash":
                os.kill(cluster.rank_pids(workers[1], ranks_only=True)[0], signal.SIGKILL)
                ended_at = time.monotonic()
            elif fault == "preemption":
                cluster.signal_main(process, signal.SIGTERM)  # the kubelet's signal to PID 1 (eviction, deletion)
                ended_at = time.monotonic()
                assert next_pod(attempt + 1, stopped_ranks=True) == 143
                stopped = re.findall(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)", pod_logs[-1])
                assert stopped and stopped[-1][0] == stopped[-1][1], pod_logs[-1][-3000:]  # it saved that step
                preempted_at.append(int(stopped[-1][0]))
            else:  # its node is gone: nothing of the pod runs on, not even its SIGTERM trap; the ranks do
                ranks = [pid for worker in workers for pid in cluster.rank_pids(worker, ranks_only=True)]
                cluster.kill(launcher)
                assert next_pod(attempt + 1, stopped_ranks=False) != 0
                # The ranks train on until the next pod clears them: the attempt ends there.
                ended_at = wait_for(lambda r=ranks: not any(Path(f"/proc/{pid}").exists() for pid in r), 120,
                                    "the next pod to clear the old ranks", lambda: launcher.log()[-3000:],
                                    interval=0.02)
        startup_seen += wait_for(lambda: trains(4), 180, "attempt 4 to train", lambda: launcher.log()[-3000:],
                                 interval=0.02) - ended_at
        trained_at = wait_for(lambda: "INFO done: " in launcher.log(), 300, "the last attempt to finish",
                              lambda: launcher.log()[-3000:])
        job_ended = time.time() - (time.monotonic() - trained_at)
        code = wait(process, timeout=300)
        log = launcher.log()
        assert code == 0, log[-4000:]
        assert "attempts: attempt 4 (2 of 2 failures used, 1 preemption)" in log
        # Goodput over the four attempts: measured buckets that add up to the job's wall time, which matches the
        # test's own clock; the crashes' lost steps are recomputation, the preemptions lost none, nothing hung.
        split = json.loads((cluster.checkpoint_dir() / "metrics.json").read_text())["goodput_s"]
        buckets = ("productive", "startup", "restore", "save", "recomputation", "hung")
        assert abs(sum(split[b] for b in buckets) + split["unaccounted"] - split["wall"]) < 0.05, split
        assert abs(split["unaccounted"]) < max(0.02 * split["wall"], 3), split
        assert abs(split["wall"] - (job_ended - job_started)) < max(0.02 * split["wall"], 3), \
            (split, job_ended - job_started)
        assert split["attempts"] == 4 and split["hung"] == 0 and split["recomputation"] > 0, split
        # Start-up (with the restores, which it includes on the test's clock) against the test's timeline, which
        # also holds up to 5 steps per attempt before the first logged one; and each retry's start the two clocks
        # take from different moments: the chart from the last step before the fault (after a stop, its save), the
        # test from the fault it made or the old ranks' end, about a second apart on this machine (up to 3 s apart
        # in all under a loaded CI run's three test processes).
        assert abs(split["startup"] + split["restore"] - startup_seen) < max(0.02 * split["wall"], 3) + 3 * 1.0, \
            (split, startup_seen)
        records = sorted((cluster.checkpoint_dir() / "_job" / "goodput").glob("*/*.json"))
        assert len(records) == 4, records
        attempts_ = [json.loads(r.read_text()) for r in records]
        assert attempts_[3]["resumed_from"] == attempts_[2]["last_step"], attempts_  # where attempt 3 stopped
        assert re.search(r"INFO goodput \d+\.\d% \| wall [\d.]+s = productive [\d.]+s \+ start-up [\d.]+s \+ "
                         r"restore [\d.]+s \+ save [\d.]+s \+ recomputation [\d.]+s \+ hung 0\.0s \+ unaccounted "
                         r"-?[\d.]+s \(4 attempts\)", log), log[-2000:]
        print(re.search(r"goodput .*", log)[0], split,
              f"test's clock: {job_ended - job_started:.1f}s, start-up {startup_seen:.1f}s")
        assert f"collective timeout {COLLECTIVE_TIMEOUT_MINUTES} min | attempt 4 (2 of 2 failures used, " \
               "1 preemption)" in log  # rank 0's start line
        assert max(step_losses(log)) == 300
        # A preemption lost no step: the next attempt resumed at the step the ranks stopped and saved at.
        resumed = [int(r) for r in re.findall(r"resumed from \S+ at step (\d+)", "".join(pod_logs) + log)]
        assert all(step in resumed for step in preempted_at), (preempted_at, resumed)
        attempts = cluster.checkpoint_dir() / "_job" / "attempts"
        book = Ledger({"DS_ATTEMPTS_DIR": str(attempts), "DS_JOB_UID": next(attempts.iterdir()).name})
        assert [book.verdict(n) for n in book.numbered()] == ["failure", "failure", "preemption", "success"]
        # A stop's cause keeps the step the ranks stopped at (`make why`: "1 pod-deleted at step N").
        assert [book.cause_of(3).get("step")] == preempted_at, book.cause_of(3)


def test_autotuning_tunes_through_the_chart_in_the_releases_own_directory(shared_dir):
    """DeepSpeed's real autotuner in the launcher pod, its experiments over SSH on the workers, its files in the
    release's directory on the claim (a tiny search space: the model-info profile and one ZeRO-0 experiment)."""
    values = e2e_values(shared_dir)
    values["launcher"]["autotuning"] = "tune"
    values["train"] = {"script": str(ROOT / "tests" / "e2e" / "tune_probe.py"), "argsConvention": "deepspeed"}
    values["deepspeed"]["config"] = {
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1_000_000, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "autotuning": {"fast": True, "metric": "throughput", "start_profile_step": 1, "end_profile_step": 2,
                       "max_train_micro_batch_size_per_gpu": 1}}
    with Cluster(render(values)) as cluster:
        code, log = cluster.run_launcher(timeout=420)
        assert code == 0, log[-6000:]
        results = cluster.checkpoint_dir() / "autotuning" / "results"
        assert "autotuning done: /checkpoints/autotuning/results/ds_config_optimal.json" in log
        optimal = json.loads((results / "ds_config_optimal.json").read_text())
        assert optimal["train_micro_batch_size_per_gpu"] == 1 and optimal["zero_optimization"]["stage"] == 0
        assert (results / "profile_model_info" / "model_info.json").is_file()
        assert (cluster.checkpoint_dir() / "autotuning" / "exps").is_dir()
        claim = cluster.claim_dir("checkpoints")
        assert sorted(p.name for p in claim.iterdir()) == ["default"]  # nothing outside the release's directory


def test_a_worker_pod_that_gets_sigterm_is_a_preemption_on_the_charts_default_storage(shared_dir):
    """An emptyDir per pod (the ledger in the launcher's /tmp, none shared): worker 1's pod gets SIGTERM mid-run (a
    deletion, a drain). Its agent tells the launcher over the attempt loop's channel before its ranks stop (they
    save the step they stop at), so the attempt is a preemption: with runRetries 0 a failure would end the job, and
    the next attempt begins with the budget untouched. Its agent copies the stop's checkpoint part to worker 0
    (the peer copy) before the pod ends; the replacement pod, whose volume is empty, resumes from that copy at the
    very step the ranks stopped at. Killed outright, it is node-lost: a failure."""
    values = e2e_values(shared_dir, steps=1000, log_every=5, checkpoint_every=0)
    del values["checkpoints"]
    values["job"]["runRetries"] = 0
    with Cluster(render(values)) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        run = cluster.start(launcher)
        wait_for(lambda: "INFO step 10/" in launcher.log(), 180, "training to start", launcher.log)
        cluster.signal_main(workers[1].process, signal.SIGTERM)  # the kubelet's signal to the pod's PID 1
        assert wait(workers[1].process, timeout=60) == 0, workers[1].log()[-3000:]
        wait_for(lambda: "attempts: attempt 2 (0 of 0 failures used, 1 preemption)" in launcher.log(), 120,
                 "the next attempt, the budget untouched", launcher.log)
        log = launcher.log()
        assert "got SIGTERM: attempt 1 is a preemption" in log
        # Its ranks end with the pod: the clean-up after the run leaves it out (the meeting clears its successor).
        going = workers[1].hostname.split(".")[0]
        assert f"clearing ranks still running on the workers (not on {going}: its pod is going away)" in log, log
        stopped = re.findall(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)", log)
        assert stopped and stopped[-1][0] == stopped[-1][1], log[-3000:]  # the ranks saved the step they stopped at
        assert run.poll() is None  # the launcher waits for the worker to come back
        step = int(stopped[-1][0])
        tag = f"step_{step:08d}"
        assert f"{tag}: this worker's part" in workers[1].log()  # copied to its peer within the grace period
        cluster.start(workers[1], log_name="worker1-replacement", new_pod=True)  # a new pod: an empty volume
        wait_for(lambda: re.search(rf"resumed from \S+/{tag} at step {step}\b", launcher.log()), 180,
                 "attempt 2 to resume from the peer copy", launcher.log)
        log = launcher.log()
        assert f"resuming from {tag}: worker 1 from the copy its peer keeps (worker 0)" in log, log[-3000:]
        assert f"worker 1: fetched its part of {tag} from worker 0" in log
        assert "config-error" not in log
        # Then the new pod is killed outright (a force delete, a lost node: no SIGTERM, no word): the launcher sees
        # its channel drop mid-run, so the attempt is node-lost, a failure, which spends the budget of 0.
        cluster.kill(workers[1])
        assert wait(run, timeout=120) == protocol.EXIT_NOT_RETRIED, launcher.log()[-3000:]
        assert f"node-lost: {workers[1].hostname} left during the attempt without a SIGTERM" in launcher.log()
