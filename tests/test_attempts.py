"""The job's ledger of attempts and its failure budget (charts/deepspeed-training/files/attempts.py), run as the
pod scripts run it, and the chart's side of its contract. The e2e tier drives it through real pods
(tests/e2e/test_e2e.py: three crashes and two preemptions on one job)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.chart import HELM, ROOT, container, env_of, one, pod_script, render_chart
from train import podstate

ATTEMPTS = ROOT / "charts" / "deepspeed-training" / "files" / "attempts.py"
attempts = pod_script("attempts")

needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")


def run(tmp_path: Path, *args: str, env: dict | None = None, stdin: str | None = None
        ) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "DS_ATTEMPTS_DIR": str(tmp_path / "attempts"), "DS_JOB_UID": "job-1",
            "DS_RUN_RETRIES": "3"}
    return subprocess.run([sys.executable, str(ATTEMPTS), *args], env={**base, **(env or {})}, input=stdin,
                          capture_output=True, text=True, timeout=30)


def begin(tmp_path: Path) -> dict[str, str]:
    result = run(tmp_path, "begin")
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_preemptions_do_not_spend_the_budget_and_a_spent_budget_ends_the_job(tmp_path):
    # Three crashes and two preemptions: the sixth attempt runs with 3 of 3 failures used.
    for fault in ("crash", "crash", "preemption", "lost", "preemption"):
        env = begin(tmp_path)
        if fault == "preemption":  # a pod script's SIGTERM trap marks it, then the run ends (143)
            assert run(tmp_path, "stopped", env=env).returncode == 0
            run(tmp_path, "end", "143", env=env)
        elif fault == "crash":
            run(tmp_path, "end", "1", env=env)
        # "lost": the owner died with its pod and wrote no outcome
    sixth = run(tmp_path, "begin")
    assert sixth.returncode == 0
    assert "attempt 6 (3 of 3 failures used, 2 preemptions)" in sixth.stderr
    env = dict(line.split("=", 1) for line in sixth.stdout.splitlines())
    assert (env["DS_ATTEMPT"], env["DS_FAILURES"], env["DS_FAILURE_BUDGET"], env["DS_PREEMPTIONS"]) == \
        ("6", "3", "3", "2")
    assert env["DS_RUN_ID"] == "run-0006-job1" and env["DS_ATTEMPT_DIR"].endswith("attempts/job-1/0006")
    run(tmp_path, "end", "1", env=env)  # a fourth failure: over the budget
    spent = run(tmp_path, "begin")
    assert spent.returncode == attempts.BUDGET_SPENT and spent.stdout == ""
    assert "failure budget spent: 4 failed attempts, job.runRetries=3 allows 3" in spent.stderr
    # Another Job of the release (a reinstall) has its own budget.
    assert run(tmp_path, "begin", env={"DS_JOB_UID": "job-2"}).returncode == 0


def test_a_stop_after_the_outcome_and_a_success_spend_nothing(tmp_path):
    env = {**begin(tmp_path), "DS_RANK_STATE_DIR": str(tmp_path / "ranks")}
    run(tmp_path, "end", "0", env=env)
    assert run(tmp_path, "stopped", env=env).stdout == ""  # the run had ended: no preemption recorded
    assert attempts.tally(tmp_path / "attempts" / "job-1") == (1, 0, 0)
    # And the progress sidecar still reads "done" (a scale-down after success sends SIGTERM).
    verdict = json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())
    assert verdict["state"] == "done" and verdict["attempt"] == env["DS_ATTEMPT"]
    # A stop during the next attempt: its failed run (143) is a preemption to the sidecar too, not a failure.
    ranks = {"DS_RANK_STATE_DIR": str(tmp_path / "ranks")}
    env = {**dict(line.split("=", 1) for line in run(tmp_path, "begin", env=ranks).stdout.splitlines()), **ranks}
    assert json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())["state"] == "starting"
    run(tmp_path, "stopped", env=env)
    run(tmp_path, "end", "143", env=env)
    verdict = json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())
    assert (verdict["state"], verdict["reason"]) == ("stopped", attempts.STOPPED), verdict


def test_an_ssh_worker_marks_the_attempt_its_ranks_run_and_nothing_outside_the_ledger(tmp_path):
    """The worker starts no attempt: its SIGTERM trap finds the attempt in its ranks' environment."""
    env = begin(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={"DS_ATTEMPT_DIR": path}) for path in (env["DS_ATTEMPT_DIR"], str(outside))]
    try:
        result = run(tmp_path, "stopped")
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert result.returncode == 0 and "stopped by SIGTERM" in result.stdout
    assert [p.name.startswith("stopped-") for p in Path(env["DS_ATTEMPT_DIR"]).iterdir()] == [True]
    assert list(outside.iterdir()) == []
    assert attempts.verdict(Path(env["DS_ATTEMPT_DIR"])) == "preemption"


def test_hostile_job_uids_and_hostnames_stay_one_path_component(tmp_path):
    result = run(tmp_path, "begin", env={"DS_JOB_UID": "../../x; rm -rf /"})
    values = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert Path(values["DS_ATTEMPT_DIR"]).parent.parent == tmp_path / "attempts"
    assert all(c.isalnum() or c in "_.-/" for v in values.values() for c in v)


@needs_helm
def test_the_charts_pod_failure_policy_and_ledger_place_match_attempts_py():
    """The exit status attempts.py ends a spent budget with fails the Job; a SIGTERM stop (143) spends nothing.
    The launcher mounts a shared claim for the ledger; the ledger is where both modes' owners write it."""
    for values, ledger in (({"checkpoints": {"existingClaim": "ckpt"}}, "/checkpoints/_job/attempts"),
                           ({}, "/tmp/deepspeed-ranks/attempts"),
                           ({"launchMode": "nossh"}, "/checkpoints/_job/attempts")):
        docs = render_chart(values)
        job = next(d for d in docs if d["kind"] == "Job")
        rules = job["spec"]["podFailurePolicy"]["rules"]
        fail = [r for r in rules if r["action"] == "FailJob"][0]["onExitCodes"]["values"]
        ignore = [r for r in rules if r["action"] == "Ignore" and "onExitCodes" in r][0]["onExitCodes"]["values"]
        assert attempts.BUDGET_SPENT in fail and 143 in ignore
        owner = container(job)
        env = env_of(job)
        assert env["DS_ATTEMPTS_DIR"] == ledger and "DS_JOB_UID" in [e["name"] for e in owner["env"]]
        mounts = [m["mountPath"] for m in owner.get("volumeMounts", [])]
        assert (ledger.startswith("/checkpoints")) == ("/checkpoints" in mounts), (values, mounts)
        assert "attempts.py" in one(docs, "ConfigMap", "-scripts")["data"]


def hang(host: str, run: str, rank: int, kind: str, beat: float, where: str) -> dict:
    return podstate.hang_report(host, run, beat + 20, [podstate.hang_rank(rank, host, kind, beat, 200, "training",
                                                                         where)])


def test_ssh_the_ledger_names_the_culprit_on_the_second_host_from_every_hosts_report(tmp_path):
    """The launcher collects every worker's hang report from pdsh's output after a failed run; the attempt's cause,
    the verdict the sidecar publishes and the next attempt's reason name the stopped rank on worker 1, not worker
    0's rank waiting in all_reduce (whose report comes first)."""
    state = tmp_path / "ranks"
    env = {**begin(tmp_path), podstate.STATE_DIR_ENV: str(state)}
    run_id = env["DS_RUN_ID"]
    victim = hang("w-0", run_id, 0, "in-collective", 1000.0, "waits in a collective: all_reduce")
    culprit = hang("w-1", run_id, 1, "stopped", 990.0, "process stopped (T (stopped))")
    stale = hang("w-2", "run-0009-other", 2, "stopped", 10.0, "of another run")
    pdsh = "".join(f"{host}: {line}\n" for host, line in (
        ("w-0", f"hang on w-0 ({run_id}): rank 0 made no progress for 12s"), ("w-2", json.dumps(stale)),
        ("w-1", '{"v": 1, "ranks": "hostile"}')))
    # A report without its newline runs into the next host's line, as pdsh writes them.
    pdsh += f"w-0: {json.dumps(victim)}w-1: {json.dumps(culprit)}\n"
    collected = run(tmp_path, "collect", env=env, stdin=pdsh)
    assert collected.returncode == 0 and collected.stdout == f"w-0: hang on w-0 ({run_id}): rank 0 made no progress " \
        "for 12s\n", collected.stdout
    assert run(tmp_path, "end", "1", env=env).returncode == 0
    verdict = json.loads((state / attempts.VERDICT).read_text())
    assert verdict["state"] == "failed" and verdict["culprit"] == "rank 1 on w-1", verdict
    assert verdict["reason"].startswith("attempt 1 ended: hang: rank 1 on w-1 is the likely culprit (its process is "
                                        "stopped, after step 200); 1 rank waits for it in collectives (rank 0 on w-0)")
    cause = json.loads((Path(env["DS_ATTEMPT_DIR"]) / "cause.json").read_text())
    assert cause == {"status": 1, "reason": verdict["reason"], "culprit": "rank 1 on w-1"}
    run(tmp_path, "begin", env=env)  # the retry keeps saying why the attempt before ended
    assert json.loads((state / attempts.VERDICT).read_text())["reason"] == verdict["reason"]


def test_nossh_the_reports_that_arrive_at_the_barrier_name_the_culprit_after_the_attempt_ended(tmp_path,
                                                                                              monkeypatch):
    """nossh: worker 0 ends the attempt before the others' reports reach it (they come with them to the start
    barrier): the cause is recorded again with them."""
    state = tmp_path / "ranks"
    env = {**begin(tmp_path), podstate.STATE_DIR_ENV: str(state), "DS_ATTEMPTS_DIR": str(tmp_path / "attempts"),
           "DS_JOB_UID": "job-1", "DS_RUN_RETRIES": "3"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    attempts.end(1)
    assert json.loads((state / attempts.VERDICT).read_text())["reason"] == "attempt 1 ended with status 1"
    run_id = env["DS_RUN_ID"]
    attempts.record_reports([hang("w-0", run_id, 0, "in-collective", 1000.0, "waits: all_reduce"), "junk",
                             hang("w-1", run_id, 1, "outside-collective", 995.0, "in read_the_stuck_mount (x.py:9)")])
    verdict = json.loads((state / attempts.VERDICT).read_text())
    assert verdict["culprit"] == "rank 1 on w-1" and "stuck outside any collective: in read_the_stuck_mount" in \
        verdict["reason"], verdict
    assert attempts.cause_of(Path(env["DS_ATTEMPT_DIR"]))["culprit"] == "rank 1 on w-1"


def test_an_upgrade_keeps_the_jobs_budget_and_a_reinstall_starts_a_fresh_one(tmp_path):
    """The ledger is keyed by the release's install (the sidecar's job.id: the progress ConfigMap's uid, which an
    upgrade keeps), not by the Job's uid, which every revision's Job has anew."""
    state = tmp_path / "ranks"
    state.mkdir()
    (state / podstate.JOB_ID_FILE).write_text("cm-uid-1\n")
    first = {podstate.STATE_DIR_ENV: str(state), "DS_JOB_UID": "job-revision-1"}
    env = {**dict(line.split("=", 1) for line in run(tmp_path, "begin", env=first).stdout.splitlines()), **first}
    run(tmp_path, "end", "1", env=env)
    upgraded = run(tmp_path, "begin", env={**first, "DS_JOB_UID": "job-revision-2"})  # helm upgrade: a new Job
    assert "attempt 2 (1 of 3 failures used, 0 preemptions)" in upgraded.stderr, upgraded.stderr
    (state / podstate.JOB_ID_FILE).write_text("cm-uid-2\n")  # helm uninstall + install: a new ConfigMap
    reinstalled = run(tmp_path, "begin", env={**first, "DS_JOB_UID": "job-revision-1"})
    assert "attempt 1 (0 of 3 failures used, 0 preemptions)" in reinstalled.stderr, reinstalled.stderr
    (state / podstate.JOB_ID_FILE).write_text("\n")  # no API (no token): the Job's uid, as before
    assert "attempt 1 " in run(tmp_path, "begin", env={**first, "DS_JOB_UID": "job-3"}).stderr


def test_an_upgrade_after_the_job_failed_gets_a_fresh_budget_and_the_failed_job_stays_failed(tmp_path):
    """The fix for a spent budget is a `helm upgrade` (a new Job of the same install): it counts afresh, from its own
    first attempt, while pods of the Job that spent it keep failing; the attempt numbers and history continue."""
    state = tmp_path / "ranks"
    state.mkdir()
    (state / podstate.JOB_ID_FILE).write_text("cm-uid-1\n")
    failed = {podstate.STATE_DIR_ENV: str(state), "DS_JOB_UID": "job-revision-1", "DS_RUN_RETRIES": "1"}
    for _ in range(2):
        env = {**dict(line.split("=", 1) for line in run(tmp_path, "begin", env=failed).stdout.splitlines()), **failed}
        run(tmp_path, "end", "1", env=env)
    assert run(tmp_path, "begin", env=failed).returncode == attempts.BUDGET_SPENT
    assert run(tmp_path, "begin", env=failed).returncode == attempts.BUDGET_SPENT  # a new pod of that Job
    fixed = {**failed, "DS_JOB_UID": "job-revision-2"}
    result = run(tmp_path, "begin", env=fixed)
    assert result.returncode == 0 and "attempt 3 (0 of 1 failures used, 0 preemptions)" in result.stderr, result.stderr
    env = {**dict(line.split("=", 1) for line in result.stdout.splitlines()), **fixed}
    run(tmp_path, "end", "1", env=env)
    again = run(tmp_path, "begin", env=fixed)
    assert "attempt 4 (1 of 1 failures used, 0 preemptions)" in again.stderr, again.stderr
    env = {**dict(line.split("=", 1) for line in again.stdout.splitlines()), **fixed}
    run(tmp_path, "end", "1", env=env)
    assert run(tmp_path, "begin", env=fixed).returncode == attempts.BUDGET_SPENT  # its own budget, spent in turn
    assert run(tmp_path, "begin", env=failed).returncode == attempts.BUDGET_SPENT


def test_the_ledger_moves_into_the_charts_folder_once_and_old_installs_are_pruned(tmp_path):
    """A release upgraded from the layout before _job/ keeps its budget (its ledger is moved, once); the ledgers of
    earlier installs beyond podstate.KEEP_JOBS go."""
    old = tmp_path / "ckpt" / "attempts"
    for job in ("a", "b", "c", "d", "e"):
        (old / job / "0001").mkdir(parents=True)
        (old / job / "0001" / "outcome").write_text("1\n")
        os.utime(old / job, (1000 + ord(job), 1000 + ord(job)))
    env = {"DS_ATTEMPTS_DIR": str(tmp_path / "ckpt" / podstate.JOB_DIR / "attempts"), "DS_JOB_UID": "e"}
    result = run(tmp_path, "begin", env=env)
    assert "attempt 2 (1 of 3 failures used, 0 preemptions)" in result.stderr, result.stderr
    assert not old.exists()
    kept = sorted(p.name for p in (tmp_path / "ckpt" / podstate.JOB_DIR / "attempts").iterdir())
    assert kept == ["b", "c", "d", "e"], kept  # the current job and the 3 newest others
