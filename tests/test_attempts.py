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
    assert spent.returncode == attempts.NOT_RETRIED and spent.stdout == ""
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
    assert len(list(Path(env["DS_ATTEMPT_DIR"]).glob("stopped-*"))) == 1
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
        assert attempts.NOT_RETRIED in fail and 143 in ignore
        owner = container(job)
        env = env_of(job)
        assert env["DS_ATTEMPTS_DIR"] == ledger and "DS_JOB_UID" in [e["name"] for e in owner["env"]]
        mounts = [m["mountPath"] for m in owner.get("volumeMounts", [])]
        assert (ledger.startswith("/checkpoints")) == ("/checkpoints" in mounts), (values, mounts)
        assert "attempts.py" in one(docs, "ConfigMap", "-scripts")["data"]


def hang(host: str, run: str, rank: int, kind: str, beat: float, where: str) -> dict:
    return podstate.hang_report(host, run, beat + 20, [podstate.hang_rank(rank, host, kind, beat, 200, "training",
                                                                         where)])


def evidence(report: dict | None = None, host: str = "", run_id: str = "", status: int | None = None,
             ends: tuple = (), step: int | None = None) -> dict:
    """One host's evidence as attempts.py `evidence` prints it (its hang report's host and run, if given)."""
    return podstate.host_evidence(report["host"] if report else host, report["run"] if report else run_id, status,
                                  report, list(ends), step)


def end_record(run_id: str, rank: int, host: str, cause: str, line: str, step: int | None, when: float) -> dict:
    return podstate.end_record(run_id, rank, host, cause, line, step, when)


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
        ("w-0", f"hang on w-0 ({run_id}): rank 0 made no progress for 12s"), ("w-2", json.dumps(evidence(stale))),
        ("w-1", '{"v": 1, "kind": "evidence", "hang": {"v": 1, "ranks": "hostile"}}')))
    # A record without its newline runs into the next host's line, as pdsh writes them.
    pdsh += f"w-0: {json.dumps(evidence(victim))}w-1: {json.dumps(evidence(culprit))}\n"
    collected = run(tmp_path, "collect", env=env, stdin=pdsh)
    assert collected.returncode == 0 and collected.stdout == f"w-0: hang on w-0 ({run_id}): rank 0 made no progress " \
        "for 12s\n", collected.stdout
    assert run(tmp_path, "end", "1", env=env).returncode == 0
    verdict = json.loads((state / attempts.VERDICT).read_text())
    assert verdict["state"] == "failed" and verdict["culprit"] == "rank 1 on w-1", verdict
    assert verdict["reason"].startswith("attempt 1 ended: hang: rank 1 on w-1 is the likely culprit (its process is "
                                        "stopped, after step 200); 1 rank waits for it in collectives (rank 0 on w-0)")
    cause = json.loads((Path(env["DS_ATTEMPT_DIR"]) / "cause.json").read_text())
    assert {k: cause[k] for k in ("status", "cause", "reason", "culprit", "step")} == \
        {"status": 1, "cause": "hang", "reason": verdict["reason"], "culprit": "rank 1 on w-1", "step": 200}
    assert verdict["cause"] == "hang" and verdict["history"][-1]["cause"] == "hang" and verdict["causes"] == {"hang": 1}
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
    assert json.loads((state / attempts.VERDICT).read_text())["reason"] == \
        "attempt 1 ended: program-error: exit status 1 (no rank said why: the ranks' log has it)"
    run_id = env["DS_RUN_ID"]
    attempts.record_evidence([evidence(hang("w-0", run_id, 0, "in-collective", 1000.0, "waits: all_reduce")), "junk",
                              evidence(hang("w-1", run_id, 1, "outside-collective", 995.0,
                                            "in read_the_stuck_mount (x.py:9)"))])
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
    assert run(tmp_path, "begin", env=failed).returncode == attempts.NOT_RETRIED
    assert run(tmp_path, "begin", env=failed).returncode == attempts.NOT_RETRIED  # a new pod of that Job
    fixed = {**failed, "DS_JOB_UID": "job-revision-2"}
    result = run(tmp_path, "begin", env=fixed)
    assert result.returncode == 0 and "attempt 3 (0 of 1 failures used, 0 preemptions)" in result.stderr, result.stderr
    env = {**dict(line.split("=", 1) for line in result.stdout.splitlines()), **fixed}
    run(tmp_path, "end", "1", env=env)
    again = run(tmp_path, "begin", env=fixed)
    assert "attempt 4 (1 of 1 failures used, 0 preemptions)" in again.stderr, again.stderr
    env = {**dict(line.split("=", 1) for line in again.stdout.splitlines()), **fixed}
    run(tmp_path, "end", "1", env=env)
    assert run(tmp_path, "begin", env=fixed).returncode == attempts.NOT_RETRIED  # its own budget, spent in turn
    assert run(tmp_path, "begin", env=failed).returncode == attempts.NOT_RETRIED


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


def end_attempt(tmp_path: Path, status: int, *hosts: dict, env: dict | None = None) -> dict:
    """Begins an attempt, has the workers' evidence collected as the ssh launcher does (pdsh's `host: line` output)
    and ends it with `status`: its cause.json. `hosts` are functions of the run's ID giving one host's evidence."""
    env = {**(env or begin(tmp_path)), podstate.STATE_DIR_ENV: str(tmp_path / "ranks")}
    pdsh = "".join(f"{e['host']}: {json.dumps(e)}\n" for e in (make(env["DS_RUN_ID"]) for make in hosts))
    assert run(tmp_path, "collect", env=env, stdin=pdsh).returncode == 0
    assert run(tmp_path, "end", str(status), env=env).returncode == 0
    return json.loads((Path(env["DS_ATTEMPT_DIR"]) / "cause.json").read_text())


def raised(host: str, rank: int, line: str, step: int, when: float, cause: str = "program-error", status=None,
           echo: bool = False):
    return lambda run_id: evidence(host=host, run_id=run_id, status=status, step=step,
                                   ends=[podstate.end_record(run_id, rank, host, cause, line, step, when, echo)])


@pytest.mark.parametrize("status, hosts, cause, words", [
    (0, [], "completed", "completed"),
    (1, [raised("w-0", 0, "ZeroDivisionError: division by zero", 57, 100.0),
         raised("w-1", 1, "RuntimeError: Connection closed by peer [10.0.0.1]:4242", 57, 101.0)],
     "program-error", "rank 0 on w-0 at step 57: ZeroDivisionError: division by zero"),
    # kill -9 of rank 1: its node's launcher exits 247 (Python's sys.exit(-9)); its peers' errors follow from it.
    (1, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 57, 101.0, status=1),
         lambda run_id: evidence(host="w-1", run_id=run_id, status=247, step=57)],
     "program-error", "a rank on w-1 was killed by SIGKILL (kill -9, or the kernel's OOM killer"),
    (247, [], "program-error", "a rank was killed by SIGKILL"),
    (1, [raised("w-0", 0, "loss is nan at step 12 (the mean over ranks)", 12, 100.0, "loss-nan"),
         raised("w-1", 1, "loss is nan at step 12 (the mean over ranks)", 12, 100.1, "loss-nan")],
     "loss-nan", "rank 0 on w-0 at step 12: loss is nan"),
    (2, [raised("w-1", 1, "checkpoint /ckpt/step_00000040: No space left on device", 40, 100.0, "storage-error")],
     "storage-error", "No space left on device; not retried"),
    # The rank that learnt of another's failed write first says less than the one whose volume is full.
    (2, [raised("w-0", 0, "checkpoint /ckpt/step_00000040: writing it failed on another rank", 40, 99.0,
                "storage-error", echo=True),
         raised("w-1", 1, "checkpoint /ckpt/step_00000040: ... (full: 0.1 MiB free of 6.0 MiB)", 40, 99.5,
                "storage-error")],
     "storage-error", "rank 1 on w-1 at step 40: checkpoint /ckpt/step_00000040: ... (full:"),
    (2, [raised("w-0", 0, "train_config.json: steps: expected an integer >= 1", None, 100.0, "config-error")],
     "config-error", "rank 0 on w-0: train_config.json: steps: expected an integer >= 1; not retried"),
    (2, [], "config-error", "a configuration error"),
    (1, [], "program-error", "exit status 1 (no rank said why"),
    # A collective timed out (the chart's collective timeout below the hang budget) before the watchdog reported the
    # rank it waited for: the timeout is the cause, the hang's culprit is named.
    (1, [raised("w-0", 0, "RuntimeError: [gloo] Timed out waiting 60000ms for recv operation to complete", 30,
                1000.0, "collective-timeout"),
         lambda run_id: evidence(hang("w-1", run_id, 1, "outside-collective", 990.0, "in read_batch (x.py:9)"))],
     "collective-timeout", "Timed out waiting"),
    # The watchdog reported first: a hang, whatever the ranks raised while they were killed.
    (1, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 30, 1100.0),
         lambda run_id: evidence(hang("w-1", run_id, 1, "stopped", 950.0, "process stopped"))],
     "hang", "hang: rank 1 on w-1 is the likely culprit"),
])
def test_every_attempt_end_gets_one_cause_from_the_evidence(tmp_path, status, hosts, cause, words):
    found = end_attempt(tmp_path, status, *hosts)
    assert found["cause"] == cause and words in found["reason"], found
    assert found["cause"] in podstate.CAUSES and found["ended"] >= found["begun"]
    verdict = json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())
    assert verdict["cause"] == cause and verdict["causes"] == {cause: 1}


def test_a_preemption_is_preempted_whatever_the_ranks_raised(tmp_path):
    env = begin(tmp_path)
    run(tmp_path, "stopped", env=env)
    found = end_attempt(tmp_path, 143, raised("w-0", 0, "RuntimeError: Connection closed by peer", 5, 100.0), env=env)
    assert found["cause"] == "preempted", found


def test_the_same_error_at_the_same_step_twice_stops_the_job_after_attempt_2(tmp_path):
    """Deterministic: the budget (3) is not spent on it. The numbers that differ between runs (a port) do not
    make two errors different; another step does."""
    error = "RuntimeError: shape mismatch in layer 3 [10.0.0.1]:{port}"
    end_attempt(tmp_path, 1, raised("w-0", 0, error.format(port=4242), 57, 100.0))
    end_attempt(tmp_path, 1, raised("w-0", 0, error.format(port=5151), 57, 200.0))
    stopped = run(tmp_path, "begin", env={podstate.STATE_DIR_ENV: str(tmp_path / "ranks")})
    assert stopped.returncode == attempts.NOT_RETRIED and stopped.stdout == ""
    assert "the same error at step 57 in attempts 1 and 2 (program-error: RuntimeError: shape mismatch" in \
        stopped.stderr and "deterministic, not retried" in stopped.stderr and "2 of 3 failures used" in stopped.stderr
    verdict = json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())
    assert (verdict["state"], verdict["cause"]) == ("failed", "program-error"), verdict
    # The fix (a later Job of the same install: `helm upgrade`) starts afresh; the stopped Job stays stopped.
    (tmp_path / "ranks" / podstate.JOB_ID_FILE).write_text("job-1\n")  # the install, as the sidecar writes it
    install = {podstate.STATE_DIR_ENV: str(tmp_path / "ranks")}
    assert run(tmp_path, "begin", env=install).returncode == attempts.NOT_RETRIED
    fixed = run(tmp_path, "begin", env={**install, "DS_JOB_UID": "job-revision-2"})
    assert fixed.returncode == 0 and "attempt 3 (0 of 3 failures used, 0 preemptions)" in fixed.stderr, fixed.stderr


def test_a_nan_that_recurs_at_the_same_step_stops_and_one_at_another_step_is_retried(tmp_path):
    nan = "loss is nan at step {step} (the mean over ranks): stopped before saving this state"
    end_attempt(tmp_path, 1, raised("w-0", 0, nan.format(step=12), 12, 100.0, "loss-nan"))
    end_attempt(tmp_path, 1, raised("w-0", 0, nan.format(step=30), 30, 200.0, "loss-nan"))
    assert run(tmp_path, "begin").returncode == 0  # another step: retried
    tmp2 = tmp_path / "again"
    tmp2.mkdir()
    end_attempt(tmp2, 1, raised("w-0", 0, nan.format(step=12), 12, 100.0, "loss-nan"))
    end_attempt(tmp2, 1, raised("w-0", 0, nan.format(step=12), 12, 200.0, "loss-nan"))
    stopped = run(tmp2, "begin")
    assert stopped.returncode == attempts.NOT_RETRIED and "(loss-nan: loss is nan at step 12" in stopped.stderr


def test_attempts_without_a_new_step_stop_as_no_progress_and_preemptions_neither_count_nor_break_the_row(tmp_path):
    end_attempt(tmp_path, 1, lambda run_id: evidence(host="w-0", run_id=run_id, step=40))  # progress: 40
    env = begin(tmp_path)
    run(tmp_path, "stopped", env=env)
    end_attempt(tmp_path, 143, env=env)  # a preemption between: skipped
    end_attempt(tmp_path, 1, lambda run_id: evidence(host="w-0", run_id=run_id, step=40))  # no new step
    assert run(tmp_path, "begin").returncode == 0  # one in a row: retried
    # (the begin above started attempt 4; end it without a step)
    env = {"DS_ATTEMPT_DIR": str(tmp_path / "attempts" / "job-1" / "0004"), "DS_RUN_ID": "run-0004-job1",
           podstate.STATE_DIR_ENV: str(tmp_path / "ranks")}
    run(tmp_path, "end", "1", env=env)
    stopped = run(tmp_path, "begin", env={podstate.STATE_DIR_ENV: str(tmp_path / "ranks")})
    assert stopped.returncode == attempts.NOT_RETRIED, stopped.stderr
    assert "2 failed attempts in a row (3, 4) reached no new step beyond step 40" in stopped.stderr
    assert json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())["cause"] == "no-progress"
    # job.noProgressAttempts 0 turns the rule off: the budget (3) decides.
    assert run(tmp_path, "begin", env={"DS_JOB_UID": "job-2", "DS_NO_PROGRESS_ATTEMPTS": "0"}).returncode == 0


def test_five_preemptions_spend_nothing_and_stop_nothing(tmp_path):
    for _ in range(5):
        env = begin(tmp_path)
        run(tmp_path, "stopped", env=env)
        end_attempt(tmp_path, 143, lambda run_id: evidence(host="w-0", run_id=run_id, step=None), env=env)
    sixth = run(tmp_path, "begin")
    assert sixth.returncode == 0 and "attempt 6 (0 of 3 failures used, 5 preemptions)" in sixth.stderr


def test_a_program_that_reports_no_steps_is_stopped_by_its_budget_not_by_no_progress(tmp_path):
    for _ in range(4):
        end_attempt(tmp_path, 1)
    spent = run(tmp_path, "begin", env={podstate.STATE_DIR_ENV: str(tmp_path / "ranks")})
    assert spent.returncode == attempts.NOT_RETRIED and "failure budget spent: 4 failed attempts" in spent.stderr
    assert json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())["cause"] == "budget-spent"


def test_hostile_evidence_is_typed_and_bounded():
    good = evidence(host="w", run_id="run-0001-a", status=1, step=3,
                    ends=[end_record("run-0001-a", 0, "w", "program-error", "x" * 5000, 3, 1.0)])
    assert podstate.valid_host_evidence(good)["ends"][0]["line"] == "x" * 1000
    for bad in ({**good, "v": 99}, {**good, "status": "rm -rf"}, {**good, "step": True}, {**good, "ends": "x"},
                {**good, "ends": [{"v": 1, "cause": "completed", "rank": 0, "time": 1}]}, [], None):
        checked = podstate.valid_host_evidence(bad)
        assert checked is None or (checked["status"] is None or isinstance(checked["status"], int)) and \
            all(e["cause"] in podstate.RANK_CAUSES for e in checked["ends"]) and \
            (checked["step"] is None or isinstance(checked["step"], int) and not isinstance(checked["step"], bool))
    record = podstate.valid_end_record({"v": 1, "run": "r\x1b[2J", "rank": 0, "host": "h\u202e", "cause":
                                        "collective-timeout", "line": "a\nb", "step": -1, "time": 5})
    assert record["run"] == "r [2J" and record["host"] == "h " and record["line"] == "a b" and record["step"] is None


def test_an_oom_kill_a_hosts_memory_cgroup_counted_is_the_cause_and_only_in_the_attempt_it_happened(tmp_path):
    """The kernel's OOM killer ends a rank (SIGKILL: its node's launcher exits 247); the container's memory cgroup
    counts it (oom_kill), which the host's evidence carries: the attempt is oom-killed, not a plain SIGKILL; the
    next attempt, with the count unchanged, is not; the same OOM twice in a row stops the job."""
    def host(kills, step, status=247):
        return lambda run_id: {**evidence(host="w-1", run_id=run_id, status=status, step=step), "oom_kills": kills}
    budget = {"DS_RUN_RETRIES": "9"}

    def attempt(kills, step):
        env = {**dict(line.split("=", 1) for line in run(tmp_path, "begin", env=budget).stdout.splitlines()), **budget}
        return end_attempt(tmp_path, 1, host(kills, step), env=env)
    first = attempt(1, 10)
    assert first["cause"] == "oom-killed" and "container of w-1 (1 kill)" in first["reason"], first
    second = attempt(1, 20)  # the same container, no new kill: a plain SIGKILL (kill -9)
    assert second["cause"] == "program-error" and "killed by SIGKILL" in second["reason"], second
    assert attempt(0, 30)["cause"] == "program-error"  # a new container (its count restarted), not killed
    assert attempt(1, 40)["cause"] == "oom-killed"
    assert attempt(2, 40)["cause"] == "oom-killed"
    stopped = run(tmp_path, "begin", env=budget)
    assert stopped.returncode == attempts.NOT_RETRIED, stopped.stderr
    assert "the same error at step 40 in attempts 4 and 5 (oom-killed: the kernel's OOM killer ended a process)" \
        in stopped.stderr, stopped.stderr


def test_the_evidence_command_reads_this_hosts_records_of_that_run_only(tmp_path):
    state = tmp_path / "ranks"
    state.mkdir()
    for rank, run_id in ((0, "run-0002-job1"), (1, "run-0001-job1")):
        (state / f"end-{rank}.json").write_text(json.dumps(end_record(run_id, rank, "w", "program-error", "boom", 7,
                                                                      1.0)))
    (state / "end-2.json").symlink_to(state / "end-0.json")  # a link is not followed
    (state / "progress.json").write_text(json.dumps({"run": "run-0002-job1", "step": 9}))
    printed = run(tmp_path, "evidence", "run-0002-job1", env={podstate.STATE_DIR_ENV: str(state)})
    found = json.loads(printed.stdout)
    assert podstate.valid_host_evidence(found) == found
    assert [e["rank"] for e in found["ends"]] == [0] and found["step"] == 9 and found["run"] == "run-0002-job1"
    assert run(tmp_path, "evidence", "../../x", env={podstate.STATE_DIR_ENV: str(state)}).stdout == ""


def test_a_full_ledger_volume_loses_the_record_not_the_verdict(tmp_path):
    """The checkpoints filled the volume the ledger shares with them (a real tmpfs, filled): `end` says so in one
    line and the verdict (the pod's state directory) still carries the cause; nothing raises (the launcher runs
    under set -e)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    volume = tmp_path / "attempts"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(volume)], check=True)
    try:
        env = {**begin(tmp_path), podstate.STATE_DIR_ENV: str(tmp_path / "ranks")}
        with open(volume / "checkpoint", "wb", buffering=0) as fill:  # the checkpoints take the rest
            try:
                while True:
                    fill.write(b"x" * 4096)
            except OSError:
                pass
        record = end_record(env["DS_RUN_ID"], 0, "w-0", "storage-error", "checkpoint ...: full", 40, 1.0)
        pdsh = f"w-0: {json.dumps(evidence(host='w-0', run_id=env['DS_RUN_ID'], ends=[record]))}\n"
        run(tmp_path, "collect", env=env, stdin=pdsh)
        result = run(tmp_path, "end", "2", env=env)
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
    assert result.returncode == 0 and f"attempts: cannot write {env['DS_ATTEMPT_DIR']}/outcome (No space left on " \
        "device)" in result.stderr, result.stderr
    verdict = json.loads((tmp_path / "ranks" / attempts.VERDICT).read_text())
    assert verdict["cause"] == "storage-error" and "full" in verdict["reason"], verdict
