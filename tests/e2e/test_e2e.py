"""The rendered chart trains across hosts: launcher + workers as network-namespace hosts (see harness.py)."""

import json
import os
import re
import signal
import time

import pytest

from tests.e2e.chart_pods import COLLECTIVE_TIMEOUT_MINUTES, REASON, SECRET_VALUE, UID, e2e_values, render
from tests.e2e.harness import (
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
        code = wait(cluster.start(launcher), timeout=60)
        elapsed = time.monotonic() - started
        assert code == 1
        missing = cluster.pods_of("worker")[1].fqdn
        assert f"wait-for-workers:   {missing}: SSH failed" in launcher.log()
        assert elapsed < 5 + 15


def test_a_killed_rank_fails_the_job_within_the_timeout_and_a_retry_resumes(shared_dir):
    """runRetries 0: the launcher pod fails, and the Job's next pod resumes."""
    values = e2e_values(shared_dir, steps=120, log_every=10, checkpoint_every=20)
    values["job"]["runRetries"] = 0
    docs = render(values)
    with Cluster(docs) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        first = cluster.start(launcher)
        ckpt = cluster.checkpoint_dir()
        wait_for(lambda: checkpoint.is_complete(ckpt / "step_00000040"), 180, "checkpoint 40", launcher.log)
        victim = cluster.rank_pids(workers[1], ranks_only=True)
        assert victim, "no rank process on worker 1"
        killed_at = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        code = wait(first, timeout=120)
        failed_after = time.monotonic() - killed_at
        assert code != 0, launcher.log()[-3000:]
        assert failed_after < 60 + 30, f"job took {failed_after:.0f}s to fail"  # the collective timeout + teardown
        for worker in workers:
            wait_for(lambda w=worker: not cluster.rank_pids(w), 30, f"no ranks left on {worker.name}")
        done = max(step_losses(launcher.log()))
        # The Job's backoff: a new launcher pod, same workers and PVC.
        retry = cluster.start(launcher, log_name="launcher-retry", new_pod=True)
        code = wait(retry, timeout=300)
        log = launcher.log()
        retry_log = log[log.rindex("wait-for-workers: waiting"):]
        assert code == 0, retry_log[-4000:]
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", retry_log).group(1))
        assert resumed >= 40 and resumed % 20 == 0 and resumed <= done + 20
        assert max(step_losses(retry_log)) == 120
        assert checkpoint.is_complete(ckpt / "step_00000120")
        assert all(checkpoint.is_complete(t) for t in checkpoint.tags_newest_first(ckpt))


def test_sigterm_to_the_launcher_stops_the_remote_ranks(shared_dir):
    docs = render(e2e_values(shared_dir, steps=100000, log_every=10, checkpoint_every=0))
    with Cluster(docs) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        process = cluster.start(launcher)
        wait_for(lambda: "step 20/" in launcher.log(), 180, "training to start", launcher.log)
        cluster.signal_main(process, signal.SIGTERM)  # the kubelet's signal to the container's PID 1 (eviction)
        code = wait(process, timeout=120)
        assert code != 0
        assert "launcher: SIGTERM: stopping the DeepSpeed run" in launcher.log()
        for worker in workers:
            wait_for(lambda w=worker: not cluster.rank_pids(w), 45, f"no ranks left on {worker.name}",
                     launcher.log)


def test_the_launcher_restarts_a_failed_run_in_the_same_pod_from_the_checkpoint(shared_dir):
    """runRetries: a killed rank fails the run; the same launcher pod clears the workers and runs again."""
    values = e2e_values(shared_dir, steps=100, log_every=10, checkpoint_every=20)
    values["job"]["runRetries"] = 1
    with Cluster(render(values)) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        process = cluster.start(launcher)
        ckpt = cluster.checkpoint_dir()
        wait_for(lambda: checkpoint.is_complete(ckpt / "step_00000040"), 180, "checkpoint 40", launcher.log)
        victim = cluster.rank_pids(workers[1], ranks_only=True)
        os.kill(victim[0], signal.SIGKILL)
        code = wait(process, timeout=300)
        log = launcher.log()
        assert code == 0, log[-4000:]
        assert "launcher: retry 1 of 1: starting the run again" in log
        assert log.count("wait-for-workers: all 2 workers are reachable") == 2
        assert re.search(r"resumed from \S+step_000000[4-9]0 at step", log)
        assert max(step_losses(log)) == 100


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
