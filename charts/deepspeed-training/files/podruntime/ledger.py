"""The job's ledger of attempts and its failure budget: a part of the attempt loop, kept by the ledger's owner
(ssh: the launcher; nossh: worker 0) where a new pod finds it: DS_ATTEMPTS_DIR/<job>/, <job> being the release's
install (the sidecar's job.id: the progress ConfigMap's uid, which an upgrade keeps and a reinstall replaces; else
the Job's uid). DS_ATTEMPTS_DIR is in the release's checkpoint directory when the owner mounts a shared claim,
otherwise in the owner's /tmp (and mirrored to the bucket when there is one). One directory per attempt (0001, ...):

    begun            when it began (epoch seconds)
    outcome          the run's exit status
    cause.json       why it ended (causes.decide: cause, reason, culprit, step, error, begun, ended; hung_at: when
                     a watchdog first reported it hung; failed_at: the first sign of its end, a rank's own word of
                     it or a host's DeepSpeed launcher exiting; returned: when the owner's run ended)
    stopped-<host>   a pod got SIGTERM during the attempt (its notice reached the owner): a preemption
    oom.json         the OOM kills each host's memory cgroup had counted at the attempt's end

An attempt with a stopped-* mark is a preemption, one with outcome 0 a success, any other a failure (a failed run,
or an owner that died before writing the outcome: a lost node). Only failures spend the budget (DS_RUN_RETRIES
failed attempts are started again). Before each attempt the stop rules are read in order (STOP_RULES), then the
budget; a stop ends the job with EXIT_NOT_RETRIED. A Job that finds the budget spent fails and is recorded in
budget.json; a later Job of the install (a `helm upgrade` after the job failed: the fix) counts a fresh budget
from its own first attempt, while an upgrade during a run continues the running budget.

Where the job stands goes to the state directory's VERDICT (the sidecar publishes it) and to the container's
termination message (the final word). Every file here is written and read through tenantfiles.Tree: with a shared
claim the ranks could write beside it.
"""

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from podruntime import causes, host, protocol
from podruntime.tenantfiles import Tree
from podruntime.text import Log, clean

RESUMED = "resumed.json"  # {"from": one of protocol.RESUMED_FROM, "line": the plan's line}: the peer copy's plan
BUDGET_RECORD = "budget.json"  # {"counts_from": N, "opened_by": Job uid, "spent_by": [Job uids]}
ATTEMPT_NAME = re.compile(r"[0-9]{4,9}")
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")  # what the sidecar writes: an object's uid
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def component(text: str, fallback: str) -> str:
    """`text` as one safe path component: never empty, never starting with a dot (so never `.` or `..`)."""
    return _SAFE.sub("_", text).lstrip(".") or fallback


@dataclass
class Began:
    """An attempt the ledger began: its number, the env every rank gets, and its summary line."""
    number: int
    env: dict[str, str]
    line: str


@dataclass
class Stopped:
    """The job stops before another attempt (a stop rule, the budget): the line and the cause."""
    line: str
    cause: str


def job_tree(checkpoints: Tree, subtree: str) -> Tree:
    """`<checkpoints>/_job/<subtree>` (protocol.ATTEMPTS, DIAGNOSTICS, GOODPUT); one still at the layout before _job/
    (`<checkpoints>/<subtree>`, an upgrade of a running release) is moved there first, once (a rename on one
    volume), so that its budget and history carry over."""
    target = f"{protocol.JOB_DIR}/{subtree}"
    if not checkpoints.is_dir(target) and checkpoints.is_dir(subtree):
        checkpoints.rename(subtree, target)
    return checkpoints.subtree(target)


def attempts_tree(env=os.environ, log: Log | None = None) -> Tree:
    """DS_ATTEMPTS_DIR: in the checkpoint directory's _job/ (job_tree), or the pod's /tmp."""
    path = (env.get("DS_ATTEMPTS_DIR") or "/tmp/deepspeed-attempts").rstrip("/")
    parent, name = os.path.split(path)
    if os.path.basename(parent) == protocol.JOB_DIR:
        return job_tree(Tree(os.path.dirname(parent), log), name)
    return Tree(path, log)


def job_id(env=os.environ) -> str:
    """The job: the release's install (the sidecar's JOB_ID_FILE), else the Job's uid, else this pod."""
    state = env.get(protocol.STATE_DIR_ENV)
    written = (Tree(state).read_text(protocol.JOB_ID_FILE, 64) or "").strip() if state else ""
    written = written if JOB_ID.fullmatch(written) else ""  # a uid, or nothing of the sidecar's
    fallback = env.get("DS_JOB_UID", "") or "pod-" + host.hostname()
    return component(written or fallback, "job")


def _int(env, name: str, default: int) -> int:
    value = env.get(name, "")
    return int(value) if value.isdigit() else default


def last_word(state: str, cause: str | None, reason: str | None, culprit: str | None = None) -> str:
    """A container's termination message: `state | cause | reason | culprit ...` (the ledger's owner's, and a worker's
    that a stop rule ended, which the Job controller may name instead)."""
    termination = " | ".join(p for p in (state, cause, reason, f"culprit {culprit}" if culprit else "") if p)
    return clean(termination, host.TERMINATION_BYTES)


class Ledger:
    def __init__(self, env=os.environ, log: Log | None = None):
        self.log = log or Log("attempts")
        self.root = attempts_tree(env)  # its refusals are said by keep()
        self.job = job_id(env)
        self.tree = self.root.subtree(self.job)
        self.budget = _int(env, "DS_RUN_RETRIES", 0)
        self.no_progress = _int(env, "DS_NO_PROGRESS_ATTEMPTS", 2)  # 0 turns the rule off
        self.preemption_budget = _int(env, "DS_PREEMPTION_RETRIES", 0)  # 0 (a chart before it): no bound
        self.job_uid = env.get("DS_JOB_UID", "")
        state = env.get(protocol.STATE_DIR_ENV)
        self.state = Tree(state) if state else None
        self.counter: dict[str, str] = {}  # the current attempt's env, published with every verdict
        self.starting: dict = {}  # what begin() said of the current attempt (waited() says it again)

    # ---- reading the ledger

    def numbered(self) -> list[int]:
        return [int(name) for name in self.tree.dirs(pattern=ATTEMPT_NAME)]

    @staticmethod
    def name(number: int) -> str:
        return f"{number:04d}"

    def stopped(self, number: int) -> bool:
        return any(name.startswith("stopped-") for name in self.tree.names(self.name(number)))

    def verdict(self, number: int) -> str:
        """"preemption", "success" or "failure" of an attempt that has ended."""
        if self.stopped(number):
            return "preemption"
        outcome = (self.tree.read_text(f"{self.name(number)}/outcome", 16) or "").strip()
        return "success" if outcome == "0" else "failure"  # no outcome: its owner died with it

    def cause_of(self, number: int) -> dict:
        """Why an attempt ended, as end() recorded it ({} if it did not)."""
        return self.tree.read_json(f"{self.name(number)}/cause.json") or {}

    def budget_record(self) -> dict:
        return self.tree.read_json(BUDGET_RECORD) or {}

    def counts_from(self) -> int:
        first = self.budget_record().get("counts_from", 1)
        return first if isinstance(first, int) else 1

    def tally(self) -> tuple[int, int, int]:
        """(attempts so far, failures and preemptions since the budget counts)."""
        attempts = self.numbered()
        verdicts = [self.verdict(n) for n in attempts if n >= self.counts_from()]
        return len(attempts), verdicts.count("failure"), verdicts.count("preemption")

    def history(self) -> tuple[list[dict], dict[str, int]]:
        """The last protocol.HISTORY attempts that ended ({attempt, cause, step, seconds, ended, culprit}) and every
        ended attempt's count by cause."""
        entries, counts = [], {}
        for number in self.numbered():
            cause = self.cause_of(number)
            if cause.get("cause") not in causes.CAUSES:
                continue
            counts[cause["cause"]] = counts.get(cause["cause"], 0) + 1
            begun, ended = protocol.number(cause.get("begun")), protocol.number(cause.get("ended"))
            seconds = ended - begun if begun is not None and ended is not None and ended >= begun else None
            resumed = (self.tree.read_json(f"{self.name(number)}/{RESUMED}") or {}).get("from")
            entries.append({"attempt": number, "cause": cause["cause"], "step": protocol.count(cause.get("step")),
                            "ended": ended, **({"culprit": cause["culprit"]} if cause.get("culprit") else {}),
                            **({"seconds": round(seconds, 1)} if seconds is not None else {}),
                            **({"resumed": resumed} if resumed in protocol.RESUMED_FROM else {})})
        return entries[-protocol.HISTORY:], counts

    def summary(self, number: int, failures: int, preemptions: int) -> str:
        return (f"attempt {number} ({failures} of {self.budget} failures used, "
                f"{preemptions} preemption{'s' if preemptions != 1 else ''})")

    # ---- writing it

    def keep(self, relpath: str, text: str) -> bool:
        """One of the ledger's files; on a volume that refuses it (full: the checkpoints filled it) one line says so
        and the loop goes on: the verdict and the termination message still say why the attempt ended."""
        if self.tree.write(relpath, text):
            return True
        self.log(f"cannot write {self.tree.path(relpath)} ({self.tree.error}): the ledger keeps no record of this; "
                 "the verdict still says why the attempt ended")
        return False

    def spent(self, count: int) -> bool:
        """Called when the failures exceed the budget: whether this Job fails. A Job that found the budget spent is
        recorded and always fails; a later Job of the install (not among them, not the one that opened this budget)
        is the fix, and opens a fresh budget from its first attempt."""
        record = self.budget_record()
        spenders = [str(uid) for uid in record.get("spent_by", [])] if isinstance(record.get("spent_by"), list) \
            else []
        job = self.job_uid
        if job and spenders and job not in spenders and job != record.get("opened_by"):
            self.keep(BUDGET_RECORD, json.dumps({"counts_from": count + 1, "opened_by": job, "spent_by": spenders}))
            return False
        if job and job not in spenders:
            self.keep(BUDGET_RECORD, json.dumps({**record, "spent_by": [*spenders, job]}))
        return True

    def record_lost(self) -> None:
        """An owner that died with its pod recorded nothing of its attempt: said once, in its cause."""
        for number in self.numbered():
            relpath = self.name(number)
            if self.tree.stat(f"{relpath}/outcome") or self.tree.stat(f"{relpath}/cause.json"):
                continue
            self.keep(f"{relpath}/cause.json", json.dumps({  # `ended` is when the loss was noticed (`noticed`)
                "cause": "preempted" if self.stopped(number) else "node-lost", "ended": time.time(), "noticed": True,
                "reason": f"attempt {number} ended with its owner's pod, which recorded no outcome (a lost node, or "
                          "the pod killed outright: `make why` reads which from the cluster)"}))

    def stop_rule(self) -> tuple[str, str] | None:
        """(cause, line) of the first stop rule that ends the job before its next attempt, or None."""
        return next((found for rule in STOP_RULES if (found := rule(self)) is not None), None)

    def begin(self) -> "Began | Stopped":
        """The next attempt (its number taken with an atomic mkdir: two owners never share one), or why the job
        stops: a stop rule, or the budget spent."""
        self.tree.mkdir()
        self.root.prune("", protocol.KEEP_JOBS, spare=self.job)  # earlier installs' ledgers
        self.record_lost()
        count, failures, preemptions = self.tally()
        rule = self.stop_rule()
        if (failures > self.budget or rule) and not self.spent(count):  # a later Job (the fix) starts afresh
            count, failures, preemptions = self.tally()
            rule = self.stop_rule()
        previous = self.numbered()[-1:]
        last = self.cause_of(previous[0]) if previous and self.verdict(previous[0]) != "success" else {}
        if failures > self.budget or rule:
            return self._stop(rule, failures, preemptions, last)
        number = count + 1
        while not self.tree.mkdir(self.name(number), exclusive=True):
            if not self.tree.is_dir():
                why = f"the ledger {self.tree.path()} cannot be written: no attempt can be numbered; failing the job"
                self.say("failed", why, cause="storage-error")
                return Stopped(why, "storage-error")
            number += 1
        begun = int(time.time() * 1000) / 1000  # as written: never after the end time.time() takes later
        self.keep(f"{self.name(number)}/begun", f"{begun:.3f}\n")
        moments = {key: protocol.number(last.get(key)) for key in ("hung_at", "failed_at")}
        # When its ranks ended, as its owner saw them end (or, before it gathered the evidence, when it recorded the
        # end); not a lost owner's: that is when this owner found the attempt had ended with the pod.
        moments["ended"] = None if last.get("noticed") else protocol.number(last.get("returned", last.get("ended")))
        env = {protocol.ATTEMPT_ENV["run"]: protocol.run_id(number, self.job),
               protocol.ATTEMPT_ENV["attempt"]: str(number), protocol.ATTEMPT_ENV["failures"]: str(failures),
               protocol.ATTEMPT_ENV["failure_budget"]: str(self.budget),
               protocol.ATTEMPT_ENV["preemptions"]: str(preemptions), protocol.ATTEMPT_ENV["begun"]: f"{begun:.3f}",
               protocol.ATTEMPT_ENV["previous_run"]: protocol.run_id(previous[0], self.job) if previous else "",
               **{protocol.ATTEMPT_ENV[f"previous_{key}"]: f"{moment:.3f}" if moment is not None else ""
                  for key, moment in moments.items()}}
        # Why the attempt before ended stays said until this one ends: the reason of a retry.
        self.starting = {"reason": last.get("reason"), "culprit": last.get("culprit"), "cause": last.get("cause")}
        self.say("starting", counter=env, **self.starting)
        return Began(number, env, self.summary(number, failures, preemptions))

    def _stop(self, rule, failures: int, preemptions: int, last: dict) -> Stopped:
        if rule:
            cause, why = rule[0], f"{rule[1]}; failing the job ({failures} of {self.budget} failures used)"
        else:
            cause, why = "budget-spent", (f"failure budget spent: {failures} failed attempts, job.runRetries="
                                          f"{self.budget} allows {self.budget} (preemptions do not count: "
                                          f"{preemptions}); failing the job. Attempts: {self.tree.path()}")
            why += f"; the last ended: {last['reason']}" if isinstance(last.get("reason"), str) else ""
        self.say("failed", why, culprit=last.get("culprit"), cause=cause)
        return Stopped(why, cause)

    def note_resume(self, number: int, resumed: str, line: str) -> None:
        """Where attempt `number`'s checkpoint came from (the peer copy's plan: protocol.RESUMED_FROM), for
        `make why`."""
        self.keep(f"{self.name(number)}/{RESUMED}", json.dumps({"from": resumed, "line": line}))

    def mark_stopped(self, number: int, who: str) -> bool:
        """Marks attempt `number` a preemption (a pod got SIGTERM), unless its outcome is already recorded (the
        SIGTERM came after the run: a scale-down after success stops no attempt)."""
        relpath = self.name(number)
        if not self.tree.is_dir(relpath) or self.tree.stat(f"{relpath}/outcome"):
            return False
        return self.tree.touch(f"{relpath}/stopped-{component(who, 'pod')}")

    def oom_increase(self, number: int, evidence: list[dict]) -> list[tuple[str, int]]:
        """The hosts whose memory cgroup counted OOM kills during the attempt ((host, kills)): counts above those
        the attempt before it recorded (a count that fell is a new container, counted from 0)."""
        counts = {e["host"]: e["oom_kills"] for e in evidence if e.get("oom_kills") is not None}
        before = next((found for earlier in reversed([n for n in self.numbered() if n < number])
                       if (found := self.tree.read_json(f"{self.name(earlier)}/oom.json")) is not None), {})
        recorded = self.tree.read_json(f"{self.name(number)}/oom.json") or {}
        self.keep(f"{self.name(number)}/oom.json", json.dumps({**recorded, **counts}))
        increased = []
        for name, kills in counts.items():
            previous = before.get(name, 0) if isinstance(before.get(name, 0), int) else 0
            base = previous if kills >= previous else 0
            if kills > base:
                increased.append((name, kills - base))
        return increased

    def end(self, number: int, status: int, evidence: list[dict], returned: float | None = None) -> dict:
        """Records the attempt's outcome and why it ended, decided once from every host's evidence
        (causes.ATTEMPT_RULES); says where the job stands. `returned`: when this host's run ended (the ranks' end
        as the owner saw it, before it gathered the evidence)."""
        relpath = self.name(number)
        self.keep(f"{relpath}/outcome", f"{status}\n")
        facts = causes.facts(number, status, evidence, self.stopped(number), self.oom_increase(number, evidence))
        cause = causes.decide(facts)
        begun = protocol.number((self.tree.read_text(f"{relpath}/begun", 64) or "").strip())
        ended = time.time()
        # The first watchdog's report, the first sign of the end and the owner's run returning, each only within the
        # attempt (the first two are the state directory's times, which a rank can write): the next attempt's ranks
        # count the time hung up to the report, and split the fault's loss at them (protocol.ATTEMPT_ENV).
        def within(moment: float | None) -> float | None:
            return moment if moment and begun is not None and begun <= moment <= ended else None
        cause.update(begun=begun, ended=ended, hung_at=within(facts.hang_time), failed_at=within(facts.failed_time),
                     returned=within(returned))
        self.keep(f"{relpath}/cause.json", json.dumps({k: v for k, v in cause.items() if v is not None}))
        if status == 0:
            self.say("done", cause="completed")
        elif cause["cause"] == "preempted":
            self.say("stopped", causes.STOPPED, cause="preempted")
        else:
            self.say("failed", cause["reason"], culprit=cause.get("culprit"), cause=cause["cause"])
        return cause

    def say_waiting(self, reason: str) -> None:
        """The attempt waits for its hosts before its ranks start: for whom, why and how long yet (until waited)."""
        self.say("starting", reason)

    def waited(self) -> None:
        """The wait is over: the attempt's own words again (begin's: why the attempt before ended, if it failed)."""
        self.say("starting", **self.starting)

    def say(self, state: str, reason: str | None = None, counter: dict | None = None, culprit: str | None = None,
            cause: str | None = None) -> None:
        """Where the job stands: the VERDICT for the sidecar (none without a state directory) and the container's
        termination message (the last word, when the container ends). Never raises."""
        counter = counter if counter is not None else self.counter
        entries, counts = self.history()
        record = {"v": protocol.VERSION, "state": state, **({"reason": reason} if reason else {}),
                  **({"culprit": culprit} if culprit else {}), **({"cause": cause} if cause in causes.CAUSES else {}),
                  "time": time.time(), "history": entries, "causes": counts,
                  **{key: counter[protocol.ATTEMPT_ENV[key]] for key in protocol.COUNTER_KEYS
                     if protocol.ATTEMPT_ENV[key] in counter}}
        self.counter = counter
        host.termination_message(last_word(state, cause, reason, culprit))
        if self.state is not None:
            self.state.write(protocol.VERDICT, json.dumps(record))


# ---- the stop rules, read in order before each attempt: each (cause, line) or None

def _counted_failures(ledger: Ledger) -> tuple[list[int], list[int]]:
    """(the attempts the budget counts, the failures among them since the last success; preemptions skipped: they
    neither count nor break a row)."""
    counted = [n for n in ledger.numbered() if n >= ledger.counts_from()]
    failed = []
    for number in counted:
        outcome = ledger.verdict(number)
        if outcome == "success":
            failed = []
        elif outcome == "failure":
            failed.append(number)
    return counted, failed


def signature(cause: dict) -> tuple | None:
    """What makes two attempts' errors the same: the cause, its line with the numbers that differ from run to run
    (ports, pids, addresses) left out, and the step; None when it is no repeatable error, or its step is unknown."""
    if cause.get("cause") not in causes.REPEATABLE_CAUSES or not isinstance(cause.get("error"), str) \
            or protocol.count(cause.get("step")) is None:
        return None
    return cause["cause"], re.sub(r"0x[0-9a-f]+|\d+", "#", cause["error"]), cause["step"]


def same_error_twice(ledger: Ledger) -> tuple[str, str] | None:
    """The same error at the same step in the last two failed attempts: deterministic, a retry would spend the
    budget on it again."""
    _, failed = _counted_failures(ledger)
    if len(failed) < 2:
        return None
    (a, before), (b, last) = [(n, ledger.cause_of(n)) for n in failed[-2:]]
    same = signature(last)
    if not same or same != signature(before):
        return None
    return last["cause"], (f"the same error at step {last['step']} in attempts {a} and {b} ({last['cause']}: "
                           f"{last['error']}): deterministic, not retried (stop rule: the same error at the same "
                           "step twice in a row)")


def no_progress(ledger: Ledger) -> tuple[str, str] | None:
    """job.noProgressAttempts failed attempts in a row without a new step (only for a program that reports steps)."""
    rule = ledger.no_progress
    counted, failed = _counted_failures(ledger)
    steps = {n: protocol.count(ledger.cause_of(n).get("step")) for n in counted}
    if not rule or len(failed) < rule or all(s is None for s in steps.values()):
        return None
    row = failed[-rule:]
    before = [s for n, s in steps.items() if n < row[0] and s is not None]
    best = max(before, default=-1)
    for number in row:
        if steps[number] is not None and steps[number] > best:
            return None
    reached = f" beyond step {max(before)}" if before else ""
    return "no-progress", (f"{rule} failed attempts in a row ({', '.join(str(n) for n in row)}) reached no new step"
                           f"{reached}: not retried (stop rule: job.noProgressAttempts={rule})")


def preemptions_spent(ledger: Ledger) -> tuple[str, str] | None:
    """More preemptions than job.preemptionRetries since the budget counts: whatever the program writes (the
    preemption mark is a file in the attempt's directory, which its ranks may reach), the retries end."""
    _, _, preemptions = ledger.tally()
    if not ledger.preemption_budget or preemptions <= ledger.preemption_budget:
        return None
    return "preemption-budget-spent", (
        f"{preemptions} preemptions, job.preemptionRetries={ledger.preemption_budget} allows "
        f"{ledger.preemption_budget}: not retried (`make why` says which of them the cluster saw)")


STOP_RULES: tuple[Callable[[Ledger], tuple[str, str] | None], ...] = (same_error_twice, no_progress,
                                                                      preemptions_spent)
