"""The job's ledger of attempts, its failure budget and stop rules (podruntime/ledger.py), and why each attempt ended
(podruntime/causes.py ATTEMPT_RULES), run in-process on real directories; the chart's side of their contract. The
e2e tier drives them through real pods (tests/e2e: crashes, preemptions and hangs on one job), and
tests/test_attempt_loop.py through the attempt loop's own processes."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from podruntime import causes, evidence, protocol, sshmode
from podruntime.ledger import Began, Ledger, Stopped
from podruntime.text import Log
from tests.support.chart import HELM, container, env_of, one, render_chart

needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")


def ledger(tmp_path: Path, **env: str) -> Ledger:
    base = {"DS_ATTEMPTS_DIR": str(tmp_path / "attempts"), "DS_JOB_UID": "job-1", "DS_RUN_RETRIES": "3",
            protocol.STATE_DIR_ENV: str(tmp_path / "ranks")}
    return Ledger({**base, **env}, Log("attempts"))


def began(tmp_path: Path, **env: str) -> Began:
    attempt = ledger(tmp_path, **env).begin()
    assert isinstance(attempt, Began), attempt
    return attempt


def verdict(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "ranks" / protocol.VERDICT).read_text())


def test_preemptions_do_not_spend_the_budget_and_a_spent_budget_ends_the_job(tmp_path):
    # Three crashes and two preemptions: the sixth attempt runs with 3 of 3 failures used.
    for fault in ("crash", "crash", "preemption", "lost", "preemption"):
        book = ledger(tmp_path)
        attempt = book.begin()
        if fault == "preemption":  # the pod's notice of its SIGTERM reaches the owner, then the run ends (143)
            assert book.mark_stopped(attempt.number, "w-1")
            book.end(attempt.number, 143, [])
        elif fault == "crash":
            book.end(attempt.number, 1, [])
        # "lost": the owner died with its pod and wrote no outcome
    sixth = ledger(tmp_path).begin()
    assert sixth.line == "attempt 6 (3 of 3 failures used, 2 preemptions)"
    env = sixth.env
    assert (env["DS_ATTEMPT"], env["DS_FAILURES"], env["DS_FAILURE_BUDGET"], env["DS_PREEMPTIONS"]) == \
        ("6", "3", "3", "2")
    assert env["DS_RUN_ID"] == "run-0006-job1"
    assert ledger(tmp_path).cause_of(4)["cause"] == "node-lost"  # the lost owner: said once, at the next begin
    ledger(tmp_path).end(6, 1, [])  # a fourth failure: over the budget
    spent = ledger(tmp_path).begin()
    assert isinstance(spent, Stopped) and spent.cause == "budget-spent"
    assert "failure budget spent: 4 failed attempts, job.runRetries=3 allows 3" in spent.line
    # Another Job of the release (a reinstall: without the sidecar's identity, the Job's uid) has its own budget.
    assert isinstance(ledger(tmp_path, DS_JOB_UID="job-2").begin(), Began)


def test_a_stop_after_the_outcome_and_a_success_spend_nothing(tmp_path):
    book = ledger(tmp_path)
    attempt = book.begin()
    book.end(attempt.number, 0, [])
    assert not book.mark_stopped(attempt.number, "w-0")  # the run had ended: no preemption recorded
    assert book.tally() == (1, 0, 0)
    # The progress sidecar still reads "done" (a scale-down after success sends SIGTERM).
    assert verdict(tmp_path)["state"] == "done" and verdict(tmp_path)["attempt"] == attempt.env["DS_ATTEMPT"]
    # A stop during the next attempt: its failed run (143) is a preemption to the sidecar too, not a failure.
    attempt = book.begin()
    assert verdict(tmp_path)["state"] == "starting"
    book.mark_stopped(attempt.number, "w-0")
    book.end(attempt.number, 143, [])
    assert (verdict(tmp_path)["state"], verdict(tmp_path)["reason"]) == ("stopped", causes.STOPPED)


def test_a_stop_mark_stays_inside_the_ledger_whatever_the_host_is_called(tmp_path):
    book = ledger(tmp_path)
    attempt = book.begin()
    assert book.mark_stopped(attempt.number, "../../outside; rm -rf /")
    marks = list((tmp_path / "attempts" / "job-1" / "0001").glob("stopped-*"))
    assert len(marks) == 1 and marks[0].parent == tmp_path / "attempts" / "job-1" / "0001"
    assert book.verdict(attempt.number) == "preemption"
    assert not book.mark_stopped(99, "w-0")  # no such attempt: nothing made


def test_hostile_job_ids_stay_one_path_component(tmp_path):
    for job in ("../../x; rm -rf /", "..", "."):
        attempt = ledger(tmp_path, DS_JOB_UID=job).begin()
        assert isinstance(attempt, Began)
        assert all(c.isalnum() or c in "_.-/" for v in attempt.env.values() for c in v)
    made = [p for p in (tmp_path / "attempts").rglob("*") if p.is_dir()]
    assert made and all(p.parent.parent == tmp_path / "attempts" for p in made if p.name.isdigit())
    assert sorted(p.name for p in (tmp_path / "attempts").iterdir()) == ["_.._x__rm_-rf__", "job"]


@needs_helm
def test_the_charts_pod_failure_policy_and_ledger_place_match_the_ledger():
    """The exit status a stop rule ends the job with fails the Job; a SIGTERM stop (143) spends nothing. The
    launcher mounts a shared claim for the ledger; the ledger is where both modes' owners write it."""
    for values, place in (({"checkpoints": {"existingClaim": "ckpt"}}, "/checkpoints/_job/attempts"),
                          ({}, "/tmp/deepspeed-ranks/attempts"),
                          ({"launchMode": "nossh"}, "/checkpoints/_job/attempts")):
        docs = render_chart(values)
        job = next(d for d in docs if d["kind"] == "Job")
        rules = job["spec"]["podFailurePolicy"]["rules"]
        fail = [r for r in rules if r["action"] == "FailJob"][0]["onExitCodes"]["values"]
        ignore = [r for r in rules if r["action"] == "Ignore" and "onExitCodes" in r][0]["onExitCodes"]["values"]
        assert protocol.EXIT_NOT_RETRIED in fail and protocol.EXIT_STOPPED in ignore
        owner = container(job)
        assert env_of(job)["DS_ATTEMPTS_DIR"] == place and "DS_JOB_UID" in [e["name"] for e in owner["env"]]
        mounts = [m["mountPath"] for m in owner.get("volumeMounts", [])]
        assert (place.startswith("/checkpoints")) == ("/checkpoints" in mounts), (values, mounts)
        assert "podruntime.ledger.py" in one(docs, "ConfigMap", "-scripts")["data"]


def hang(host: str, run: str, rank: int, kind: str, beat: float, where: str) -> dict:
    return protocol.hang_report(host, run, beat + 20, [protocol.hang_rank(rank, host, kind, beat, 200, "training",
                                                                          where)])


def host(report: dict | None = None, name: str = "", run_id: str = "", status: int | None = None,
         ends: tuple = (), step: int | None = None) -> dict:
    """One host's evidence (its hang report's host and run, if given)."""
    return protocol.host_evidence(report["host"] if report else name, report["run"] if report else run_id, status,
                                  report, list(ends), step)


def test_ssh_the_ledger_names_the_culprit_on_the_second_host_from_every_hosts_report(tmp_path):
    """The launcher collects every worker's evidence from pdsh's output after a failed run: the attempt's cause,
    the verdict the sidecar publishes and the next attempt's reason name the stopped rank on worker 1, not worker
    0's rank waiting in all_reduce (whose report comes first)."""
    attempt = began(tmp_path)
    run_id = attempt.env["DS_RUN_ID"]
    victim = hang("w-0", run_id, 0, "in-collective", 1000.0, "waits in a collective: all_reduce")
    culprit = hang("w-1", run_id, 1, "stopped", 990.0, "process stopped (T (stopped))")
    pdsh = "".join(f"{name}: {line}\n" for name, line in (
        ("w-0", f"hang on w-0 ({run_id}): rank 0 made no progress for 12s"),
        ("w-1", '{"v": 2, "kind": "evidence", "hang": {"v": 2, "ranks": "hostile"}}')))
    # A record without its newline runs into the next host's line, as pdsh writes them.
    pdsh += f"w-0: {json.dumps(host(victim))}w-1: {json.dumps(host(culprit))}\n"
    found, others = sshmode.collect(pdsh)
    assert others == [f"w-0: hang on w-0 ({run_id}): rank 0 made no progress for 12s"], others
    cause = ledger(tmp_path).end(attempt.number, 1, found)
    assert verdict(tmp_path)["state"] == "failed" and verdict(tmp_path)["culprit"] == "rank 1 on w-1"
    assert verdict(tmp_path)["reason"].startswith(
        "attempt 1 ended: hang: rank 1 on w-1 is the likely culprit (its process is stopped, after step 200); 1 rank "
        "waits for it in collectives (rank 0 on w-0)")
    assert {k: cause[k] for k in ("status", "cause", "culprit", "step")} == \
        {"status": 1, "cause": "hang", "culprit": "rank 1 on w-1", "step": 200}
    assert verdict(tmp_path)["history"][-1]["cause"] == "hang" and verdict(tmp_path)["causes"] == {"hang": 1}
    reason = verdict(tmp_path)["reason"]
    ledger(tmp_path).begin()  # the retry keeps saying why the attempt before ended
    assert verdict(tmp_path)["reason"] == reason


@pytest.mark.parametrize("reported", ["during", "before", "after"])
def test_the_next_attempt_learns_the_run_before_and_when_it_was_first_reported_hung(tmp_path, reported):
    """The ranks' goodput counts time hung up to the first watchdog's report: the next attempt gets it from the
    ledger (on per-pod volumes the report lies on another pod's). A report dated outside the attempt (the state
    directory is one a rank can write) is no time."""
    import time
    first = began(tmp_path)
    assert first.env["DS_PREVIOUS_RUN_ID"] == first.env["DS_PREVIOUS_RUN_HUNG_AT"] == ""
    run_id, begun = first.env["DS_RUN_ID"], float(first.env["DS_ATTEMPT_BEGUN"])
    at = {"during": time.time(), "before": begun - 600, "after": time.time() + 600}[reported]
    reports = [protocol.hang_report(name, run_id, t, [protocol.hang_rank(rank, name, kind, t - 9, 200, "training",
                                                                         "somewhere")])
               for name, rank, kind, t in (("w-0", 0, "in-collective", at + 1.5), ("w-1", 1, "stopped", at))]
    cause = ledger(tmp_path).end(first.number, 1, [host(r) for r in reports])
    assert cause["cause"] == "hang"
    second = began(tmp_path)
    assert second.env["DS_PREVIOUS_RUN_ID"] == run_id
    assert second.env["DS_PREVIOUS_RUN_HUNG_AT"] == (f"{at:.3f}" if reported == "during" else ""), second.env
    assert second.env["DS_PREVIOUS_RUN_ENDED"] == f"{cause['ended']:.3f}"
    assert second.env["DS_PREVIOUS_RUN_FAILED_AT"] == ""
    third = began(tmp_path)  # the attempt before (no outcome recorded) did not hang, and its end is not known
    assert third.env["DS_PREVIOUS_RUN_HUNG_AT"] == third.env["DS_PREVIOUS_RUN_ENDED"] == "", third.env


@pytest.mark.parametrize("written", ["during", "before", "after"])
def test_the_next_attempt_learns_when_the_first_rank_said_why_the_run_before_ended(tmp_path, written):
    """A fault's loss is split at the first rank's own word of its end (a crash's line): the next attempt gets
    its time from the ledger, only from within the attempt (a rank writes the record)."""
    import time
    first = began(tmp_path)
    run_id, begun = first.env["DS_RUN_ID"], float(first.env["DS_ATTEMPT_BEGUN"])
    at = {"during": time.time(), "before": begun - 600, "after": time.time() + 600}[written]
    crashed = protocol.end_record(run_id, 1, "w-1", "program-error", "RuntimeError: boom", 40, at)
    echo = protocol.end_record(run_id, 0, "w-0", "program-error", "rank 1 failed", 40, at - 1, echo=True)
    cause = ledger(tmp_path).end(first.number, 1, [host(name="w-1", run_id=run_id, ends=(crashed,)),
                                                   host(name="w-0", run_id=run_id, ends=(echo,))])
    assert cause["cause"] == "program-error", cause
    env = began(tmp_path).env
    assert env["DS_PREVIOUS_RUN_FAILED_AT"] == (f"{at:.3f}" if written == "during" else ""), env
    assert env["DS_PREVIOUS_RUN_ENDED"] == f"{cause['ended']:.3f}" and env["DS_PREVIOUS_RUN_HUNG_AT"] == ""


def test_a_killed_rank_that_said_nothing_is_dated_by_its_hosts_launcher_and_the_end_by_the_owners_run(tmp_path):
    """kill -9 leaves no end record: the first host whose DeepSpeed launcher exited (nossh: each host's evidence
    says when) dates the failure; the ranks' end is when the owner's own run returned, before it gathered the
    evidence (a time outside the attempt is none)."""
    import time
    first = began(tmp_path)
    run_id = first.env["DS_RUN_ID"]
    time.sleep(0.01)
    crashed, returned = time.time() - 0.005, time.time()
    evidence = [protocol.host_evidence("w-1", run_id, 137, None, [], 40, returned=crashed),
                protocol.host_evidence("w-0", run_id, 1, None, [], 40, returned=returned)]
    cause = ledger(tmp_path).end(first.number, 1, evidence, returned)
    assert (cause["failed_at"], cause["returned"]) == (crashed, returned), cause
    env = began(tmp_path).env
    assert (env["DS_PREVIOUS_RUN_FAILED_AT"], env["DS_PREVIOUS_RUN_ENDED"]) == (f"{crashed:.3f}", f"{returned:.3f}")
    third = ledger(tmp_path)
    cause = third.end(third.numbered()[-1], 1, [], returned=time.time() + 600)
    assert cause["returned"] is None and began(tmp_path).env["DS_PREVIOUS_RUN_ENDED"] == f"{cause['ended']:.3f}"


def test_once_the_wait_for_the_hosts_is_over_the_attempt_says_its_own_words_again(tmp_path):
    """The launcher waits for its workers after begin() (ssh): the wait's line goes once the ranks start, and a
    retry's reason (why the attempt before ended) is said again."""
    first = began(tmp_path)
    book = ledger(tmp_path)
    book.end(first.number, 1, [host(name="w-1", ends=[protocol.end_record(
        first.env["DS_RUN_ID"], 1, "w-1", "program-error", "ValueError: bad batch", 7, 1.0)])])
    book = ledger(tmp_path)
    book.begin()
    retry = verdict(tmp_path)["reason"]
    assert "ValueError: bad batch" in retry
    book.say_waiting("the launcher waits for 1 of 2 workers (w-1; w-1: SSH failed): 290s more, then the job fails")
    assert verdict(tmp_path)["reason"].startswith("the launcher waits for 1 of 2 workers")
    book.waited()
    assert verdict(tmp_path)["state"] == "starting" and verdict(tmp_path)["reason"] == retry
    assert verdict(tmp_path)["attempt"] == "2"


def test_an_upgrade_keeps_the_jobs_budget_and_a_reinstall_starts_a_fresh_one(tmp_path):
    """The ledger is keyed by the release's install (the sidecar's job.id: the progress ConfigMap's uid, which an
    upgrade keeps), not by the Job's uid, which every revision's Job has anew."""
    state = tmp_path / "ranks"
    state.mkdir()
    (state / protocol.JOB_ID_FILE).write_text("cm-uid-1\n")
    first = ledger(tmp_path, DS_JOB_UID="job-revision-1")
    first.end(first.begin().number, 1, [])
    assert ledger(tmp_path, DS_JOB_UID="job-revision-2").begin().line == "attempt 2 (1 of 3 failures used, 0 " \
                                                                          "preemptions)"  # helm upgrade: a new Job
    (state / protocol.JOB_ID_FILE).write_text("cm-uid-2\n")  # helm uninstall + install: a new ConfigMap
    assert ledger(tmp_path, DS_JOB_UID="job-revision-1").begin().line.startswith("attempt 1 (0 of 3")
    (state / protocol.JOB_ID_FILE).write_text("\n")  # no API (no token): the Job's uid, as before
    assert ledger(tmp_path, DS_JOB_UID="job-3").begin().line.startswith("attempt 1 ")


def test_an_upgrade_after_the_job_failed_gets_a_fresh_budget_and_the_failed_job_stays_failed(tmp_path):
    """The fix for a spent budget is a `helm upgrade` (a new Job of the same install): it counts afresh, from its own
    first attempt, while pods of the Job that spent it keep failing; the attempt numbers and history continue."""
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / protocol.JOB_ID_FILE).write_text("cm-uid-1\n")
    failed = {"DS_JOB_UID": "job-revision-1", "DS_RUN_RETRIES": "1"}
    for _ in range(2):
        book = ledger(tmp_path, **failed)
        book.end(book.begin().number, 1, [])
    assert isinstance(ledger(tmp_path, **failed).begin(), Stopped)
    assert isinstance(ledger(tmp_path, **failed).begin(), Stopped)  # a new pod of that Job
    fixed = {**failed, "DS_JOB_UID": "job-revision-2"}
    attempt = ledger(tmp_path, **fixed).begin()
    assert attempt.line == "attempt 3 (0 of 1 failures used, 0 preemptions)"
    ledger(tmp_path, **fixed).end(attempt.number, 1, [])
    again = ledger(tmp_path, **fixed).begin()
    assert again.line == "attempt 4 (1 of 1 failures used, 0 preemptions)"
    ledger(tmp_path, **fixed).end(again.number, 1, [])
    assert isinstance(ledger(tmp_path, **fixed).begin(), Stopped)  # its own budget, spent in turn
    assert isinstance(ledger(tmp_path, **failed).begin(), Stopped)


def test_the_ledger_moves_into_the_charts_folder_once_and_old_installs_are_pruned(tmp_path):
    """A release upgraded from the layout before _job/ keeps its budget (its ledger is moved, once); the ledgers of
    earlier installs beyond protocol.KEEP_JOBS go."""
    old = tmp_path / "ckpt" / "attempts"
    for job in ("a", "b", "c", "d", "e"):
        (old / job / "0001").mkdir(parents=True)
        (old / job / "0001" / "outcome").write_text("1\n")
        os.utime(old / job, (1000 + ord(job), 1000 + ord(job)))
    moved = tmp_path / "ckpt" / protocol.JOB_DIR / "attempts"
    assert ledger(tmp_path, DS_ATTEMPTS_DIR=str(moved), DS_JOB_UID="e").begin().line.startswith(
        "attempt 2 (1 of 3 failures used")
    assert not old.exists()
    assert sorted(p.name for p in moved.iterdir()) == ["b", "c", "d", "e"]  # the current job and the 3 newest others


def end_attempt(tmp_path: Path, status: int, *hosts, **env: str) -> dict:
    """Begins an attempt and ends it with `status` and the hosts' evidence (each a function of the run's ID): its
    cause."""
    book = ledger(tmp_path, **env)
    attempt = book.begin()
    assert isinstance(attempt, Began), attempt
    return book.end(attempt.number, status, [make(attempt.env["DS_RUN_ID"]) for make in hosts])


def raised(name: str, rank: int, line: str, step: int | None, when: float, cause: str = "program-error",
           status=None, echo: bool = False):
    return lambda run_id: host(name=name, run_id=run_id, status=status, step=step,
                               ends=[protocol.end_record(run_id, rank, name, cause, line, step, when, echo)])


@pytest.mark.parametrize("status, hosts, cause, words", [
    (0, [], "completed", "completed"),
    (1, [raised("w-0", 0, "ZeroDivisionError: division by zero", 57, 100.0),
         raised("w-1", 1, "RuntimeError: Connection closed by peer [10.0.0.1]:4242", 57, 101.0)],
     "program-error", "rank 0 on w-0 at step 57: ZeroDivisionError: division by zero"),
    # kill -9 of rank 1: its node's launcher exits 247 (Python's sys.exit(-9)); its peers' errors follow from it.
    (1, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 57, 101.0, status=1),
         lambda run_id: host(name="w-1", run_id=run_id, status=247, step=57)],
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
         lambda run_id: host(hang("w-1", run_id, 1, "outside-collective", 990.0, "in read_batch (x.py:9)"))],
     "collective-timeout", "Timed out waiting"),
    # A host left mid-attempt without a SIGTERM (its channel dropped: a force delete, a lost node): its peers'
    # connection errors are echoes of it.
    (1, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 57, 101.0),
         lambda run_id: protocol.host_evidence("w-1", run_id, None, None, [], None, lost=True)],
     "node-lost", "node-lost: w-1 left during the attempt without a SIGTERM or a word"),
    # The watchdog reported first: a hang, whatever the ranks raised while they were killed.
    (1, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 30, 1100.0),
         lambda run_id: host(hang("w-1", run_id, 1, "stopped", 950.0, "process stopped"))],
     "hang", "hang: rank 1 on w-1 is the likely culprit"),
])
def test_every_attempt_end_gets_one_cause_from_the_evidence(tmp_path, status, hosts, cause, words):
    found = end_attempt(tmp_path, status, *hosts)
    assert found["cause"] == cause and words in found["reason"], found
    assert found["cause"] in causes.CAUSES and found["ended"] >= found["begun"]
    assert verdict(tmp_path)["cause"] == cause and verdict(tmp_path)["causes"] == {cause: 1}


def test_every_rule_of_the_policy_decides_some_case_and_the_order_is_the_policy():
    """The table is read top to bottom: each row is the first to apply somewhere (none is dead), and moving the
    hang row below the rank's word changes the verdict of a hang reported first."""
    def facts(**changes):
        base = dict(attempt=1, status=1, stopped=False, oom=[], hang=None, hang_time=None, word=None, killed=[])
        return causes.Facts(**{**base, **changes})
    stopped_hang = causes.merge_hang_reports([hang("w-1", "run-0001-a", 1, "stopped", 950.0, "process stopped")])
    word = {**protocol.end_record("run-0001-a", 0, "w-0", "program-error", "RuntimeError: peer gone", 3, 1100.0)}
    cases = {"completed": facts(status=0), "preempted": facts(stopped=True), "oom-killed": facts(oom=[("w", 1)]),
             "hang": facts(hang=stopped_hang, hang_time=970.0, word=word), "node-lost": facts(lost=["w-1"], word=word),
             "a rank's": facts(word=word),
             "program-error": facts(killed=[("w", 9)]), "config-error": facts(status=2)}
    deciders = [next(rule for rule in causes.ATTEMPT_RULES if rule.applies(f)).cause for f in cases.values()]
    assert deciders == list(cases) and [r.cause for r in causes.ATTEMPT_RULES][-1] == "program-error"
    assert causes.decide(cases["hang"])["cause"] == "hang"
    word_row = next(i for i, r in enumerate(causes.ATTEMPT_RULES) if r.cause == "a rank's")
    reordered = (causes.ATTEMPT_RULES[word_row], *(r for i, r in enumerate(causes.ATTEMPT_RULES) if i != word_row))
    assert next(r for r in reordered if r.applies(cases["hang"])).cause == "a rank's"
    assert {r.cause for r in causes.ATTEMPT_RULES} - {"a rank's"} <= set(causes.CAUSES)
    assert {r.cause for r in causes.CLUSTER_RULES} <= set(causes.CAUSES)


def test_a_preemption_is_preempted_whatever_the_ranks_raised(tmp_path):
    book = ledger(tmp_path)
    attempt = book.begin()
    book.mark_stopped(attempt.number, "w-1")
    found = book.end(attempt.number, 143, [raised("w-0", 0, "RuntimeError: Connection closed by peer", 5, 100.0)(
        attempt.env["DS_RUN_ID"])])
    assert found["cause"] == "preempted", found


def test_a_host_whose_pod_got_sigterm_makes_the_attempt_a_preemption_by_its_evidence_alone(tmp_path):
    """Its notice may never have reached the owner (the channel down): its evidence says so."""
    found = end_attempt(tmp_path, 1, lambda run_id: {**host(name="w-1", run_id=run_id, status=143), "stopped": True})
    assert found["cause"] == "preempted", found


def test_the_same_error_at_the_same_step_twice_stops_the_job_after_attempt_2(tmp_path):
    """Deterministic: the budget (3) is not spent on it. The numbers that differ between runs (a port) do not
    make two errors different; another step does."""
    error = "RuntimeError: shape mismatch in layer 3 [10.0.0.1]:{port}"
    end_attempt(tmp_path, 1, raised("w-0", 0, error.format(port=4242), 57, 100.0))
    end_attempt(tmp_path, 1, raised("w-0", 0, error.format(port=5151), 57, 200.0))
    stopped = ledger(tmp_path).begin()
    assert isinstance(stopped, Stopped), stopped
    assert "the same error at step 57 in attempts 1 and 2 (program-error: RuntimeError: shape mismatch" in \
        stopped.line and "deterministic, not retried" in stopped.line and "2 of 3 failures used" in stopped.line
    assert (verdict(tmp_path)["state"], verdict(tmp_path)["cause"]) == ("failed", "program-error")
    # The fix (a later Job of the same install: `helm upgrade`) starts afresh; the stopped Job stays stopped.
    (tmp_path / "ranks" / protocol.JOB_ID_FILE).write_text("job-1\n")  # the install, as the sidecar writes it
    assert isinstance(ledger(tmp_path).begin(), Stopped)
    assert ledger(tmp_path, DS_JOB_UID="job-revision-2").begin().line == "attempt 3 (0 of 3 failures used, 0 " \
                                                                          "preemptions)"


def test_a_nan_that_recurs_at_the_same_step_stops_and_one_at_another_step_is_retried(tmp_path):
    nan = "loss is nan at step {step} (the mean over ranks): stopped before saving this state"
    end_attempt(tmp_path, 1, raised("w-0", 0, nan.format(step=12), 12, 100.0, "loss-nan"))
    end_attempt(tmp_path, 1, raised("w-0", 0, nan.format(step=30), 30, 200.0, "loss-nan"))
    assert isinstance(ledger(tmp_path).begin(), Began)  # another step: retried
    again = tmp_path / "again"
    again.mkdir()
    end_attempt(again, 1, raised("w-0", 0, nan.format(step=12), 12, 100.0, "loss-nan"))
    end_attempt(again, 1, raised("w-0", 0, nan.format(step=12), 12, 200.0, "loss-nan"))
    stopped = ledger(again).begin()
    assert isinstance(stopped, Stopped) and "(loss-nan: loss is nan at step 12" in stopped.line


def test_attempts_without_a_new_step_stop_as_no_progress_and_preemptions_neither_count_nor_break_the_row(tmp_path):
    end_attempt(tmp_path, 1, lambda run_id: host(name="w-0", run_id=run_id, step=40))  # progress: 40
    book = ledger(tmp_path)
    attempt = book.begin()
    book.mark_stopped(attempt.number, "w-0")
    book.end(attempt.number, 143, [])  # a preemption between: skipped
    end_attempt(tmp_path, 1, lambda run_id: host(name="w-0", run_id=run_id, step=40))  # no new step
    fourth = ledger(tmp_path).begin()
    assert isinstance(fourth, Began)  # one in a row: retried
    ledger(tmp_path).end(fourth.number, 1, [])
    stopped = ledger(tmp_path).begin()
    assert isinstance(stopped, Stopped), stopped
    assert "2 failed attempts in a row (3, 4) reached no new step beyond step 40" in stopped.line
    assert verdict(tmp_path)["cause"] == "no-progress"
    # job.noProgressAttempts 0 turns the rule off: the budget (3) decides.
    assert isinstance(ledger(tmp_path, DS_JOB_UID="job-2", DS_NO_PROGRESS_ATTEMPTS="0").begin(), Began)


def test_five_preemptions_spend_nothing_and_stop_nothing(tmp_path):
    for _ in range(5):
        book = ledger(tmp_path)
        attempt = book.begin()
        book.mark_stopped(attempt.number, "w-0")
        book.end(attempt.number, 143, [host(name="w-0", run_id=attempt.env["DS_RUN_ID"])])
    assert ledger(tmp_path).begin().line == "attempt 6 (0 of 3 failures used, 5 preemptions)"


def test_preemptions_past_their_own_budget_stop_the_job_whoever_wrote_the_marks(tmp_path):
    """job.preemptionRetries 3: a program that writes the preemption mark into its own attempt's directory (it can
    reach it) gets three free retries, not endless ones; a fix (a later Job) counts afresh. The legitimate case
    beside it: three real preemptions run the fourth attempt."""
    budget = {"DS_PREEMPTION_RETRIES": "3"}
    for _ in range(3):
        book = ledger(tmp_path, **budget)
        attempt = book.begin()
        (tmp_path / "attempts" / "job-1" / book.name(attempt.number) / "stopped-by-the-program").write_text("x")
        book.end(attempt.number, 143, [host(name="w-0", run_id=attempt.env["DS_RUN_ID"])])
    book = ledger(tmp_path, **budget)
    fourth = book.begin()
    assert fourth.line == "attempt 4 (0 of 3 failures used, 3 preemptions)"
    book.mark_stopped(fourth.number, "w-0")  # a real one this time: the budget counts it all the same
    book.end(fourth.number, 143, [host(name="w-0", run_id=fourth.env["DS_RUN_ID"])])
    stopped = ledger(tmp_path, **budget).begin()
    assert isinstance(stopped, Stopped), stopped
    assert "4 preemptions, job.preemptionRetries=3 allows 3: not retried" in stopped.line, stopped.line
    assert verdict(tmp_path)["cause"] == "preemption-budget-spent"
    (tmp_path / "ranks" / protocol.JOB_ID_FILE).write_text("job-1\n")
    assert isinstance(ledger(tmp_path, DS_JOB_UID="job-revision-2", **budget).begin(), Began)


def test_a_program_that_reports_no_steps_is_stopped_by_its_budget_not_by_no_progress(tmp_path):
    for _ in range(4):
        end_attempt(tmp_path, 1)
    spent = ledger(tmp_path).begin()
    assert isinstance(spent, Stopped) and "failure budget spent: 4 failed attempts" in spent.line
    assert verdict(tmp_path)["cause"] == "budget-spent"


def test_hostile_evidence_is_typed_and_bounded():
    good = host(name="w", run_id="run-0001-a", status=1, step=3,
                ends=[protocol.end_record("run-0001-a", 0, "w", "program-error", "x" * 5000, 3, 1.0)])
    assert protocol.valid_host_evidence(good)["ends"][0]["line"] == "x" * 1000
    for bad in ({**good, "v": 99}, {**good, "status": "rm -rf"}, {**good, "step": True}, {**good, "ends": "x"},
                {**good, "ends": [{"v": 2, "cause": "completed", "rank": 0, "time": 1}]}, {**good, "stopped": "yes"},
                [], None):
        checked = protocol.valid_host_evidence(bad)
        assert checked is None or (checked["status"] is None or isinstance(checked["status"], int)) and \
            all(e["cause"] in protocol.RANK_CAUSES for e in checked["ends"]) and checked["stopped"] is False and \
            (checked["step"] is None or isinstance(checked["step"], int) and not isinstance(checked["step"], bool))
    record = protocol.valid_end_record({"v": 2, "run": "r\x1b[2J", "rank": 0, "host": "h\u202e", "cause":
                                        "collective-timeout", "line": "a\nb", "step": -1, "time": 5})
    assert record["run"] == "r [2J" and record["host"] == "h " and record["line"] == "a b" and record["step"] is None


def test_an_oom_kill_a_hosts_memory_cgroup_counted_is_the_cause_and_only_in_the_attempt_it_happened(tmp_path):
    """The kernel's OOM killer ends a rank (SIGKILL: its node's launcher exits 247); the container's memory cgroup
    counts it (oom_kill), which the host's evidence carries: the attempt is oom-killed, not a plain SIGKILL; the
    next attempt, with the count unchanged, is not; the same OOM twice in a row stops the job."""
    def attempt(kills, step):
        return end_attempt(tmp_path, 1, lambda run_id: {**host(name="w-1", run_id=run_id, status=247, step=step),
                                                        "oom_kills": kills}, DS_RUN_RETRIES="9")
    first = attempt(1, 10)
    assert first["cause"] == "oom-killed" and "container of w-1 (1 kill)" in first["reason"], first
    second = attempt(1, 20)  # the same container, no new kill: a plain SIGKILL (kill -9)
    assert second["cause"] == "program-error" and "killed by SIGKILL" in second["reason"], second
    assert attempt(0, 30)["cause"] == "program-error"  # a new container (its count restarted), not killed
    assert attempt(1, 40)["cause"] == "oom-killed"
    assert attempt(2, 40)["cause"] == "oom-killed"
    stopped = ledger(tmp_path, DS_RUN_RETRIES="9").begin()
    assert isinstance(stopped, Stopped), stopped
    assert "the same error at step 40 in attempts 4 and 5 (oom-killed: the kernel's OOM killer ended a process)" \
        in stopped.line


def test_a_hosts_evidence_is_of_that_run_only_and_reads_through_no_link(tmp_path):
    state = tmp_path / "ranks"
    state.mkdir()
    for rank, run_id in ((0, "run-0002-job1"), (1, "run-0001-job1")):
        (state / f"end-{rank}.json").write_text(json.dumps(protocol.end_record(run_id, rank, "w", "program-error",
                                                                               "boom", 7, 1.0)))
    (state / "end-2.json").symlink_to(state / "end-0.json")  # a link is not followed
    (state / "progress.json").write_text(json.dumps({"run": "run-0002-job1", "step": 9}))
    env = {protocol.STATE_DIR_ENV: str(state)}
    found = evidence.of_run("run-0002-job1", 1, env)
    assert protocol.valid_host_evidence(found) == found
    assert [e["rank"] for e in found["ends"]] == [0] and found["step"] == 9 and found["status"] == 1
    assert evidence.of_run("../../x", 1, env) is None


def test_a_full_ledger_volume_loses_the_record_not_the_verdict(tmp_path, capsys):
    """The checkpoints filled the volume the ledger shares with them (a real tmpfs, filled): one line says so and
    the verdict (the pod's state directory) still carries the cause; nothing raises."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    volume = tmp_path / "attempts"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(volume)], check=True)
    try:
        book = ledger(tmp_path)
        attempt = book.begin()
        with open(volume / "checkpoint", "wb", buffering=0) as fill:  # the checkpoints take the rest
            try:
                while True:
                    fill.write(b"x" * 4096)
            except OSError:
                pass
        record = protocol.end_record(attempt.env["DS_RUN_ID"], 0, "w-0", "storage-error", "checkpoint ...: full",
                                     40, 1.0)
        book.end(attempt.number, 2, [host(name="w-0", run_id=attempt.env["DS_RUN_ID"], ends=[record])])
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
    assert f"attempts: cannot write {volume}/job-1/0001/outcome (No space left on device)" in capsys.readouterr().out
    assert verdict(tmp_path)["cause"] == "storage-error" and "full" in verdict(tmp_path)["reason"]
