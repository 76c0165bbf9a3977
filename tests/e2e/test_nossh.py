"""launchMode nossh through the rendered chart: the workers' Indexed Job pods as network-namespace hosts (see
harness.py), each running DeepSpeed's launcher for its own node rank, no sshd anywhere."""

import hashlib
import os
import re
import signal
import subprocess
import time

import pytest

from podruntime import protocol
from podruntime.ledger import Ledger
from tests.support.chart_pods import COLLECTIVE_TIMEOUT_MINUTES, REASON, SECRET_VALUE, e2e_values, render
from tests.support.harness import Claims, Cluster, step_losses, wait, wait_for
from tests.support.train_run import cpu_ds_config
from train import checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def nossh_values(shared_dir, retries: int = 1, **train) -> dict:
    values = e2e_values(shared_dir, **train)
    values["launchMode"] = "nossh"
    values["job"]["runRetries"] = retries
    return values


def test_nossh_trains_across_hosts_without_ssh_and_every_pod_ends(shared_dir):
    docs = render(nossh_values(shared_dir))
    assert not [d for d in docs if d["kind"] in ("StatefulSet", "Secret") and "ssh" in d["metadata"]["name"]]
    with Cluster(docs) as cluster:
        assert not cluster.pods_of("launcher")
        codes = cluster.run_workers(timeout=240)
        worker0, worker1 = cluster.pods_of("worker")
        assert codes == [0, 0], worker0.log()[-4000:] + worker1.log()[-3000:]
        log = worker0.log()
        assert "barrier 0: all 2 workers are here" in log
        assert "world size 2 | ZeRO stage 2" in log
        losses = step_losses(log)
        assert sorted(losses) == [10, 20, 30, 40] and losses[40] < losses[10]
        ckpt = cluster.checkpoint_dir()
        assert checkpoint.is_complete(ckpt / "step_00000040")
        # Plain env and the secret reach every rank by construction (the pod's env), on both hosts.
        expected_secret = hashlib.sha256(SECRET_VALUE.encode()).hexdigest()[:12]
        probes = re.findall(r"rank-probe rank=(\d) host=(\S+) E2E_MARKER=(\S+) DEEPSPEED_TIMEOUT=(\S+) "
                            r"E2E_SECRET_sha256=(\S+)", worker0.log() + worker1.log())
        assert sorted(p[0] for p in probes) == ["0", "1"]
        assert {p[1] for p in probes} == {worker0.hostname, worker1.hostname}
        assert all(p[2] == "from-the-chart" and p[4] == expected_secret for p in probes), probes
        assert {p[3] for p in probes} == {str(COLLECTIVE_TIMEOUT_MINUTES)}, probes
        assert f"collective timeout {COLLECTIVE_TIMEOUT_MINUTES} min" in log
        # Nothing of the SSH mode ran, and nothing is left running.
        assert "sshd" not in log and "pdsh" not in log
        assert not cluster.pids(worker0) and not cluster.pids(worker1)


def test_nossh_a_killed_rank_fails_every_rank_and_a_spent_budget_ends_every_worker(shared_dir):
    """runRetries 0: the killed rank's run fails on every worker within the collective timeout; at the start
    barrier worker 0 finds the job's budget spent and ends every worker with the ledger's status (the chart's
    podFailurePolicy fails the Job on it)."""
    docs = render(nossh_values(shared_dir, retries=0, steps=100000, log_every=10, checkpoint_every=0))
    with Cluster(docs) as cluster:
        worker0, worker1 = cluster.pods_of("worker")
        processes = [cluster.start(w) for w in (worker0, worker1)]
        wait_for(lambda: "INFO step 10/" in worker0.log(), 180, "training to start", worker0.log)
        victim = cluster.rank_pids(worker1, ranks_only=True)
        assert victim, "no rank on worker 1"
        killed_at = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        codes = [wait(p, timeout=60 + 60) for p in processes]
        failed_after = time.monotonic() - killed_at
        log0, log1 = worker0.log(), worker1.log()
        assert codes == [protocol.EXIT_NOT_RETRIED] * 2, log0[-4000:] + log1[-3000:]
        assert "failure budget spent: 1 failed attempts, job.runRetries=0 allows 0" in log0
        # The cause, from worker 1's evidence at the barrier (its launcher's status: the rank's SIGKILL), not worker
        # 0's ranks' errors that followed from it.
        assert f"the last ended: attempt 1 ended: program-error: a rank on {worker1.hostname} was killed by SIGKILL" \
            in log0, log0[-3000:]
        assert "worker 0 says the job stops (budget-spent: its log says why)" in log1
        assert failed_after < 60 + 30, f"the run took {failed_after:.0f}s to fail everywhere"


def test_nossh_a_lost_worker_is_replaced_and_a_preempted_one_too_and_only_the_loss_spends_the_budget(shared_dir):
    """A node dies (every process of worker 1 killed): the surviving worker's run fails and it waits at the
    barrier; the Job controller's replacement pod joins it there and the job resumes: a failure. Then worker 1 is
    preempted (SIGTERM): every rank stops and saves at the next step, worker 1's pod ends (143) and its
    replacement joins again: a preemption, which does not spend the budget (runRetries 1)."""
    docs = render(nossh_values(shared_dir, retries=1, steps=300, log_every=5, checkpoint_every=20))
    with Cluster(docs) as cluster:
        worker0, worker1 = cluster.pods_of("worker")
        first = cluster.start(worker0)
        cluster.start(worker1)
        ckpt = cluster.checkpoint_dir()
        wait_for(lambda: checkpoint.is_complete(ckpt / "step_00000040"), 180, "checkpoint 40", worker0.log)
        cluster.kill(worker1)
        wait_for(lambda: "meeting the other workers at the start barrier" in worker0.log(), 60 + 30,
                 "worker 0 to go back to the barrier", worker0.log)
        replacement = cluster.start(worker1, log_name="worker1-replacement", new_pod=True)
        attempt_2 = "starting the run, attempt 2 (1 of 1 failures used, 0 preemptions)"
        wait_for(lambda: attempt_2 in (log := worker0.log()) and "INFO step" in log.split(attempt_2)[1], 180,
                 "attempt 2 to train", worker0.log)
        cluster.signal_main(replacement, signal.SIGTERM)  # the kubelet's signal to PID 1 (an eviction)
        assert wait(replacement, timeout=60) == 143, worker1.log()[-3000:]
        stopped = re.findall(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)", worker0.log())
        assert stopped and stopped[-1][0] == stopped[-1][1], worker0.log()[-3000:]  # rank 0 saved that step
        second = cluster.start(worker1, log_name="worker1-replacement-2", new_pod=True)
        codes = [wait(first, timeout=300), wait(second, timeout=60)]
        log0 = worker0.log()
        assert codes == [0, 0], log0[-4000:] + worker1.log()[-3000:]
        assert "starting the run, attempt 3 (1 of 1 failures used, 1 preemption)" in log0
        assert re.search(r"resumed from \S+step_000000[4-9]0 at step", log0)
        step = int(stopped[-1][0])
        assert re.search(rf"resumed from \S+/step_{step:08d} at step {step}\b", log0)  # the preemption lost no step
        assert max(step_losses(log0)) == 300
        # Worker 0's loop started its retries' ranks itself; each new pod's first run is DeepSpeed's runner's, and
        # the ranks of both kinds of start meet in one world.
        assert len(re.findall(r"running \(run-\S+\): ranks 0 started by the loop as DeepSpeed's launcher started them "
                              r"in run-", log0)) == 2, log0[-4000:]
        assert re.search(r"running \(run-0003-\S+\): \S*deepspeed --node_rank=1 ", worker1.log()), worker1.log()[-3000:]
        assert all(checkpoint.is_complete(t) for t in checkpoint.tags_newest_first(ckpt))
        attempts = ckpt / "_job" / "attempts"
        book = Ledger({"DS_ATTEMPTS_DIR": str(attempts), "DS_JOB_UID": next(attempts.iterdir()).name})
        assert [book.verdict(n) for n in book.numbered()] == ["failure", "preemption", "success"]
        assert book.cause_of(2).get("step") == step, book.cause_of(2)  # the step the ranks stopped (and saved) at


def test_nossh_on_the_charts_default_storage_a_replaced_worker_resumes_from_the_copy_its_peer_keeps(shared_dir):
    """An emptyDir per pod, no claim, no bucket: worker 1 is deleted (SIGTERM: a preemption; its stop's checkpoint
    goes to worker 0 before the pod ends), then force-deleted (every process killed: no SIGTERM, no last copy: worker
    0 sees its connection drop, node-lost). Each time its replacement starts with an empty volume and resumes from the
    part worker 0 keeps of it, the newest tag both workers hold; the job finishes, one failure used."""
    values = nossh_values(shared_dir, retries=1, steps=200, log_every=5, checkpoint_every=20)
    del values["checkpoints"]
    with Cluster(render(values)) as cluster:
        worker0, worker1 = cluster.pods_of("worker")
        first = cluster.start(worker0)
        victim = cluster.start(worker1)
        wait_for(lambda: "this worker's part" in worker1.log(), 180, "worker 1's first copy", worker1.log)
        cluster.signal_main(victim, signal.SIGTERM)
        assert wait(victim, timeout=60) == 143, worker1.log()[-3000:]
        stopped = re.findall(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)", worker0.log())
        step = int(stopped[-1][0])
        replacement = cluster.start(worker1, log_name="worker1-replacement", new_pod=True)
        wait_for(lambda: re.search(rf"resumed from \S+/step_{step:08d} at step {step}\b", worker0.log()), 180,
                 "attempt 2 to resume where the preemption stopped", worker0.log)
        assert f"resuming from step_{step:08d}: worker 1 from the copy its peer keeps (worker 0)" in worker0.log()
        wait_for(lambda: re.search(r"step_(\d+): this worker's part", worker1.log()) and int(re.findall(
            r"step_(\d+): this worker's part", worker1.log())[-1]) > step, 180, "a newer copy", worker1.log)
        copied = int(re.findall(r"step_(\d+): this worker's part", worker1.log())[-1])
        cluster.kill(worker1)  # a force delete, a lost node: no SIGTERM, nothing more copied
        assert wait(replacement, timeout=30) != 0
        wait_for(lambda: "meeting the other workers at the start barrier" in worker0.log().split(
            f"resuming from step_{step:08d}")[-1], 120, "worker 0 back at the barrier", worker0.log)
        second = cluster.start(worker1, log_name="worker1-replacement-2", new_pod=True)
        codes = [wait(first, timeout=300), wait(second, timeout=60)]
        log0 = worker0.log()
        assert codes == [0, 0], log0[-4000:] + worker1.log()[-3000:]
        resumed = re.findall(r"resuming from step_(\d+): worker 1 from the copy its peer keeps", log0)
        assert [int(r) for r in resumed] == [step, copied] or int(resumed[-1]) >= copied, log0[-4000:]
        assert "config-error" not in log0 and max(step_losses(log0)) == 200
        attempts = cluster.checkpoint_dir(worker0) / "_job" / "attempts"
        book = Ledger({"DS_ATTEMPTS_DIR": str(attempts), "DS_JOB_UID": next(attempts.iterdir()).name})
        assert [book.verdict(n) for n in book.numbered()] == ["preemption", "failure", "success"]
        assert book.cause_of(2)["cause"] == "node-lost", book.cause_of(2)  # it left without a SIGTERM
        assert f"{worker1.hostname} left during the attempt without a SIGTERM" in book.cause_of(2)["reason"]
        assert [e.get("resumed") for e in book.history()[0]] == [None, "peer copy", "peer copy"]


def test_nossh_a_worker_with_another_rank_count_fails_loudly_and_is_not_retried(shared_dir):
    docs = render(nossh_values(shared_dir, retries=2))
    with Cluster(docs) as cluster:
        worker0, worker1 = cluster.pods_of("worker")
        # Worker 1 sees a hostfile with 2 slots on its node: its launcher starts 2 ranks of a world of 3.
        worker1.mounts = cluster._materialize(worker1)
        hostfile = worker1.mounts["/etc/deepspeed/config"] / "hostfile"
        lines = hostfile.read_text().splitlines()
        hostfile.write_text(f"{lines[0]}\n{lines[1].replace('slots=1', 'slots=2')}\n")
        processes = [cluster.start(worker0), cluster.start(worker1)]
        code1 = wait(processes[1], timeout=120)
        log1 = worker1.log()
        assert code1 == 2, log1[-3000:]
        assert "world size 3 (WORLD_SIZE from DeepSpeed's launcher), but the chart runs 2 ranks" in log1
        assert "status 2 is a configuration error" in log1 and "retry" not in log1
        cluster.kill(worker0)  # the Job's podFailurePolicy (FailJob on exit status 2) ends the others


def test_a_job_redeployed_on_fewer_workers_resumes_through_a_universal_checkpoint(shared_dir, tmp_path):
    """2 workers train to step 20; the job is redeployed with 1 worker (a shrunk node pool) and continues."""
    claim = tmp_path / "claim"
    claim.mkdir()
    claim.chmod(0o777)

    def deploy(workers: int, steps: int) -> str:
        values = nossh_values(shared_dir, retries=0, steps=steps, log_every=10, checkpoint_every=10)
        values["worker"]["replicas"] = workers
        values["deepspeed"]["config"] = cpu_ds_config(stage=2, micro=4, accum=None, train_batch_size=8)
        with Cluster(render(values)) as cluster:
            subprocess.run(["cp", "-a", f"{claim}/.", str(cluster.checkpoint_dir())], check=True)
            codes = cluster.run_workers(timeout=300)
            subprocess.run(["cp", "-a", f"{cluster.checkpoint_dir()}/.", str(claim)], check=True)
            log = cluster.pods_of("worker")[0].log()
            assert codes == [0] * workers, log[-4000:]
            return log

    deploy(2, 20)
    log = deploy(1, 40)
    assert ("resumed from /checkpoints/step_00000020 at step 20 (written with 2 ranks, ZeRO stage 2; universal)"
            in log), log[-3000:]
    assert ("converted /checkpoints/step_00000020 to the universal checkpoint "
            "/checkpoints/universal/step_00000020") in log
    assert max(step_losses(log)) == 40
    assert checkpoint.read_manifest(claim / "step_00000040")["world_size"] == 1


def test_two_releases_on_one_claim_each_save_prune_and_resume_only_their_own(shared_dir, tmp_path):
    """Two projects on one checkpoint claim, running at the same time: each release writes, prunes and resumes
    in its own <namespace>/<release> directory, and a redeploy of one resumes its own newest checkpoint, not the
    other's newer one."""
    claims = Claims(tmp_path)
    tmp_path.chmod(0o755)

    def values(steps: int) -> dict:
        v = nossh_values(shared_dir, retries=0, steps=steps, log_every=10, checkpoint_every=10, keep_checkpoints=1)
        v["worker"]["replicas"] = 1
        v["deepspeed"]["config"] = cpu_ds_config(stage=1, micro=4)
        return v

    with Cluster(render(values(20), "team-a"), subnet=232, claims=claims) as a, \
            Cluster(render(values(30), "team-b"), subnet=233, claims=claims) as b:
        processes = [a.start(a.pods_of("worker")[0]), b.start(b.pods_of("worker")[0])]
        codes = [wait(p, timeout=300) for p in processes]
        assert codes == [0, 0], a.pods_of("worker")[0].log()[-3000:] + b.pods_of("worker")[0].log()[-3000:]
        dir_a, dir_b = a.checkpoint_dir(), b.checkpoint_dir()
    assert sorted(p.relative_to(tmp_path / "claims" / "checkpoints").as_posix()
                  for p in (tmp_path / "claims" / "checkpoints" / "default").iterdir()) == ["default/team-a",
                                                                                          "default/team-b"]
    # Each pruned to its own newest (keep_checkpoints 1), and each checkpoint names its release.
    assert [t.name for t in checkpoint.tags_newest_first(dir_a)] == ["step_00000020"]
    assert [t.name for t in checkpoint.tags_newest_first(dir_b)] == ["step_00000030"]
    assert checkpoint.read_manifest(dir_a / "step_00000020")["release"] == "default/team-a"
    assert checkpoint.read_manifest(dir_b / "step_00000030")["release"] == "default/team-b"
    # Release a is redeployed: it resumes its own step 20, never b's step 30.
    with Cluster(render(values(40), "team-a"), subnet=232, claims=claims) as a:
        assert a.run_workers(timeout=300) == [0], a.pods_of("worker")[0].log()[-3000:]
        log = a.pods_of("worker")[0].log()
    assert "resumed from /checkpoints/step_00000020 at step 20" in log, log[-3000:]
    assert [t.name for t in checkpoint.tags_newest_first(dir_a)] == ["step_00000040"]
    assert [t.name for t in checkpoint.tags_newest_first(dir_b)] == ["step_00000030"]
