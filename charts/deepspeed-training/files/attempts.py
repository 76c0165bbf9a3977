"""The job's attempts and its failure budget, kept where a new pod finds them: DS_ATTEMPTS_DIR/<job>/, where
<job> is the release's install (job_dir). DS_ATTEMPTS_DIR is in the release's checkpoint directory when the
attempt's owner mounts a shared claim; otherwise in the pod's /tmp, where the count starts again with each pod.
One directory per attempt (0001, 0002, ...) holding:

    begun            when it began (epoch seconds)
    outcome          the run's exit status, written by the attempt's owner (ssh: the launcher; nossh: worker 0)
    cause.json       why it ended: its `cause` (one of podstate.CAUSES), one line (`reason`), the culprit of a hang,
                     the last step it reached, its error line, when it began and ended (decide()): from every host's
                     evidence (podstate.host_evidence: its exit status, its watchdog's hang report, its ranks' end
                     records), which reaches the owner with the attempt's end (ssh: `collect`, from pdsh; nossh: the
                     start barrier, `record_evidence`)
    stopped-<host>   written by a pod script that got SIGTERM during the attempt (eviction, preemption, upgrade,
                     pod deletion), before it stops its ranks, so it is there before the peers' runs fail

An attempt with a stopped-* file is a preemption, one with outcome 0 a success, any other a failure (a failed
run, or an owner that died before writing the outcome: a lost node). Only failures spend the budget
(DS_RUN_RETRIES failed attempts are started again). The stop rules (stop_rule(), checked before each attempt
begins), each said in the verdict's line: the same error (program-error, loss-nan, ...) at the same step in two
failed attempts in a row stops the job (deterministic: a retry would spend the budget on it again);
DS_NO_PROGRESS_ATTEMPTS failed attempts in a row without a new step stop it as no-progress (only for a program that
reports steps); more failures than the budget stop it as budget-spent; preemptions neither count nor break a row.
A Job that finds the budget spent fails, and is recorded in budget.json; a later Job of the install (a `helm
upgrade` after the job failed: the fix) counts a fresh budget from its own first attempt, while an upgrade during a
run continues the running budget.

Each also says where the job stands in the state directory's VERDICT (train/podstate.py: JSON, replaced atomically:
state, cause, reason, culprit, the attempt counter, the last attempts' history and the count by cause), which the
pod's sidecar (sidecar.py) publishes, and in the container's termination message (the final word, for `kubectl
describe` and `make why`). The evidence it merges comes from the tenant's containers: typed and bounded
(podstate.valid_host_evidence) before use.

Usage (standard library and the protocol's copy; the pod scripts call it, gang-barrier.py imports it):
  attempts.py begin      starts the next attempt: prints its env (KEY=VALUE lines, for every rank) on stdout and
                         "attempt N (F of B failures used, P preemptions)" on stderr, and exits 0; or says on
                         stderr which stop rule ends the job and exits podstate.EXIT_NOT_RETRIED
  attempts.py end RC     records the outcome of the attempt in DS_ATTEMPT_DIR, and why it ended
  attempts.py evidence RUN
                         prints this host's evidence of run RUN (one JSON line; ssh: run on every worker over pdsh)
  attempts.py collect    reads pdsh's output of the workers' evidence on stdin (`host: line`), keeps each host's
                         for `end` and passes every other line through to stdout
  attempts.py stopped    marks this pod's attempt as stopped by SIGTERM: DS_ATTEMPT_DIR, or in an ssh worker
                         (which starts no attempt) the one its ranks run in, read from their environment
"""

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "generated"))  # the chart's copy of train/podstate.py
import podstate  # noqa: E402

NOT_RETRIED = podstate.EXIT_NOT_RETRIED  # a stop rule ended the job: the chart's podFailurePolicy fails the Job on it
ENV_KEYS = tuple(podstate.ATTEMPT_ENV.values())
VERDICT = podstate.VERDICT
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")  # every value is pasted into a remote shell by DeepSpeed's pdsh runner
STOPPED = "stopped by SIGTERM (a preemption: not counted against the failure budget)"
TERMINATION_LOG = "/dev/termination-log"  # the kubelet's default terminationMessagePath (mode 0666 in the container)


def ledger_root() -> Path:
    """DS_ATTEMPTS_DIR: in the release's checkpoint directory's _job/ (moved there from the layout before it once,
    podstate.job_path), or the pod's /tmp."""
    root = Path(os.environ.get("DS_ATTEMPTS_DIR") or "/tmp/deepspeed-attempts")
    if root.parent.name == podstate.JOB_DIR:
        podstate.job_path(root.parent.parent, root.name)
    return root


def job_dir() -> Path:
    """The job's ledger: keyed by the release's install (the sidecar's job.id), so that an upgrade keeps the
    budget and a reinstall starts a fresh one; without it by the Job's uid."""
    fallback = os.environ.get("DS_JOB_UID", "") or "pod-" + socket.gethostname()
    return ledger_root() / podstate.job_id(os.environ.get(podstate.STATE_DIR_ENV), fallback)


def numbered(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("[0-9][0-9][0-9][0-9]") if p.is_dir())


def verdict(attempt: Path) -> str:
    """"preemption", "success" or "failure" of an attempt that has ended."""
    if any(attempt.glob("stopped-*")):
        return "preemption"
    try:
        return "success" if (attempt / "outcome").read_text().strip() == "0" else "failure"
    except OSError:
        return "failure"  # its owner died with it


BUDGET_RECORD = "budget.json"  # {"counts_from": N, "opened_by": Job uid, "spent_by": [Job uids]}


def budget_record(directory: Path) -> dict:
    try:
        record = json.loads((directory / BUDGET_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def tally(directory: Path) -> tuple[int, int, int]:
    """(attempts so far, failures and preemptions since the budget counts)."""
    attempts = numbered(directory)
    first = budget_record(directory).get("counts_from", 1)
    verdicts = [verdict(a) for a in attempts if int(a.name) >= first]
    return len(attempts), verdicts.count("failure"), verdicts.count("preemption")


def spent(directory: Path, count: int) -> bool:
    """Called when the failures exceed the budget: whether this Job fails. A Job that found the budget spent is
    recorded and always fails; a later Job of the install (not among them, not the one that opened this budget) is the
    fix, and opens a fresh budget from its first attempt."""
    job = os.environ.get("DS_JOB_UID", "")
    record = budget_record(directory)
    spenders = [str(uid) for uid in record.get("spent_by", [])]
    if job and spenders and job not in spenders and job != record.get("opened_by"):
        podstate.atomic_write(directory / BUDGET_RECORD, json.dumps(
            {"counts_from": count + 1, "opened_by": job, "spent_by": spenders}) + "\n")
        return False
    if job and job not in spenders:
        podstate.atomic_write(directory / BUDGET_RECORD, json.dumps({**record, "spent_by": [*spenders, job]}) + "\n")
    return True


def budget() -> int:
    return int(os.environ.get("DS_RUN_RETRIES") or 0)


def no_progress_attempts() -> int:
    """DS_NO_PROGRESS_ATTEMPTS (job.noProgressAttempts): failed attempts in a row without a new step that stop the
    job; 0 turns the rule off."""
    value = os.environ.get("DS_NO_PROGRESS_ATTEMPTS", "2")
    return int(value) if value.isdigit() else 2


def signature(cause: dict) -> tuple | None:
    """What makes two attempts' errors the same: the cause, its line with the numbers that differ from run to run
    (ports, pids, addresses) left out, and the step; None when it is no repeatable error, or its step is unknown."""
    if cause.get("cause") not in podstate.REPEATABLE_CAUSES or not cause.get("error") or cause.get("step") is None:
        return None  # no step known: "at the same step" cannot be said
    return cause["cause"], re.sub(r"0x[0-9a-f]+|\d+", "#", cause["error"]), cause.get("step")


def stop_rule(directory: Path, first: int) -> tuple[str, str] | None:
    """(cause, line) of the stop rule that ends the job before its next attempt, or None: the same error at the same
    step in the last two failed attempts; no_progress_attempts() failed attempts in a row without a new step.
    Preemptions are skipped: they neither count nor break a row."""
    counted = [a for a in numbered(directory) if int(a.name) >= first]
    failed = []  # the failures since the last success or the budget's start, preemptions skipped
    for attempt in counted:
        outcome = verdict(attempt)
        if outcome == "success":
            failed = []
        elif outcome == "failure":
            failed.append(attempt)
    if len(failed) >= 2:
        (a, before), (b, last) = [(p, cause_of(p)) for p in failed[-2:]]
        same = signature(last)
        if same and same == signature(before):
            at = f" at step {last['step']}" if last.get("step") is not None else ""
            return last["cause"], (f"the same error{at} in attempts {int(a.name)} and {int(b.name)} ({last['cause']}: "
                                   f"{last['error']}): deterministic, not retried (stop rule: the same error at the "
                                   f"same step twice in a row)")
    rule = no_progress_attempts()
    steps = {p.name: cause_of(p).get("step") for p in counted}
    if rule and len(failed) >= rule and any(s is not None for s in steps.values()):
        row = failed[-rule:]
        before = [s for name, s in steps.items() if name < row[0].name and s is not None]
        best, progressed = max(before, default=-1), False
        for attempt in row:
            step = steps[attempt.name]
            if step is not None and step > best:
                progressed, best = True, step
        if not progressed:
            reached = f" beyond step {max(before)}" if before else ""
            return "no-progress", (f"{rule} failed attempts in a row ({', '.join(str(int(p.name)) for p in row)}) "
                                   f"reached no new step{reached}: not retried (stop rule: job.noProgressAttempts="
                                   f"{rule})")
    return None


def summary(attempt: int, failures: int, preemptions: int) -> str:
    return (f"attempt {attempt} ({failures} of {budget()} failures used, "
            f"{preemptions} preemption{'s' if preemptions != 1 else ''})")


def cause_of(attempt: Path) -> dict:
    """Why an attempt ended, as end() or record_evidence() recorded it ({} if neither did)."""
    try:
        cause = json.loads((attempt / "cause.json").read_text())
    except (OSError, ValueError):
        return {}
    return cause if isinstance(cause, dict) else {}


def begin() -> tuple[dict[str, str] | None, str, str]:
    """(the next attempt's env, its summary line, ""), or (None, why, the cause) when a stop rule ends the job."""
    directory = job_dir()
    directory.mkdir(parents=True, exist_ok=True)
    podstate.prune(directory.parent, podstate.KEEP_JOBS, spare=directory.name)  # earlier installs' ledgers
    for lost in numbered(directory):  # an owner that died with its pod recorded nothing: say so, once
        if not (lost / "outcome").exists() and not (lost / "cause.json").exists():
            keep(lost / "cause.json", json.dumps({
                "cause": "preempted" if any(lost.glob("stopped-*")) else "node-lost", "ended": time.time(),
                "reason": f"attempt {int(lost.name)} ended with its owner's pod, which recorded no outcome (a lost "
                          "node, or the pod killed outright: `make why` reads which from the cluster)"}))
    count, failures, preemptions = tally(directory)
    if failures > budget() and not spent(directory, count):
        count, failures, preemptions = tally(directory)
    previous = numbered(directory)[-1:] or [None]
    last = cause_of(previous[0]) if previous[0] and verdict(previous[0]) != "success" else {}
    rule = stop_rule(directory, budget_record(directory).get("counts_from", 1))
    if rule and failures <= budget() and not spent(directory, count):  # a later Job (the fix) starts afresh
        count, failures, preemptions = tally(directory)
        rule = stop_rule(directory, budget_record(directory).get("counts_from", 1))
    if failures > budget() or rule:
        if rule:
            cause, why = rule[0], f"{rule[1]}; failing the job ({failures} of {budget()} failures used)"
        else:
            cause, why = "budget-spent", (f"failure budget spent: {failures} failed attempts, job.runRetries="
                                          f"{budget()} allows {budget()} (preemptions do not count: {preemptions}); "
                                          f"failing the job. Attempts: {directory}")
            why += f"; the last ended: {last['reason']}" if last.get("reason") else ""
        say("failed", why, culprit=last.get("culprit"), cause=cause)
        return None, why, cause
    number = count + 1
    while True:  # mkdir is atomic: two owners never share a number (one owner at a time is the rule)
        attempt = directory / f"{number:04d}"
        try:
            attempt.mkdir()
            break
        except FileExistsError:
            number += 1
    begun = time.time()
    keep(attempt / "begun", f"{begun:.3f}\n")
    # The run's name (diagnostics/<run>) is unique across Jobs of the release: the job's first 8 characters.
    env = {podstate.ATTEMPT_ENV["run"]: podstate.run_id(number, directory.name),
           podstate.ATTEMPT_ENV["attempt_dir"]: str(attempt), podstate.ATTEMPT_ENV["attempt"]: str(number),
           podstate.ATTEMPT_ENV["failures"]: str(failures), podstate.ATTEMPT_ENV["failure_budget"]: str(budget()),
           podstate.ATTEMPT_ENV["preemptions"]: str(preemptions),
           podstate.ATTEMPT_ENV["begun"]: f"{begun:.3f}"}
    # Why the attempt before ended stays said until this one ends: the reason of a retry.
    say("starting", last.get("reason"), env=env, culprit=last.get("culprit"), cause=last.get("cause"))
    return env, summary(number, failures, preemptions), ""


def host_evidence(run: str) -> list[dict]:
    """The evidence of `run` the hosts sent (state directory, hosts/), typed and bounded."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return []
    hosts = podstate.StateDir(Path(directory)).subdir(podstate.HOST_REPORTS)
    found = []
    for name in hosts.names(re.compile(r"[A-Za-z0-9_.-]+\.json")):
        record = hosts.read_json(name)
        evidence = podstate.valid_host_evidence(record[0]) if record else None
        if evidence and evidence["run"] == run:
            found.append(evidence)
    return found


def keep_evidence(evidence) -> bool:
    """Keeps one host's evidence in the state directory's hosts/ for end(); False if it is none."""
    evidence = podstate.valid_host_evidence(evidence)
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if evidence is None or not directory:
        return False
    folder = Path(directory) / podstate.HOST_REPORTS
    folder.mkdir(parents=True, exist_ok=True)
    podstate.atomic_write(folder / f"{_SAFE.sub('_', evidence['host'])[:200] or 'host'}.json", json.dumps(evidence))
    return True


def evidence(run: str, status: int | None = None) -> dict | None:
    """This host's evidence of `run` (podstate.host_evidence), from its state directory: its watchdog's hang report,
    its ranks' end records, the last step rank 0 published (if it is here; the steps in the records decide() reads
    from them); None without a state directory."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory or not podstate.parse_run_id(run):
        return None
    state = podstate.StateDir(Path(directory))
    found = state.read_json(podstate.HANG_JSON.format(run=run))
    hang = podstate.valid_hang_report(found[0]) if found else None
    ends = []
    for name in state.names(podstate.END_RECORD_NAME, limit=64):
        found = state.read_json(name)
        record = podstate.valid_end_record(found[0]) if found else None
        if record and record["run"] == run:
            ends.append(record)
    found = state.read_json(podstate.PROGRESS)
    step = found[0].get("step") if found and found[0].get("run") == run else None
    return podstate.valid_host_evidence(podstate.host_evidence(socket.gethostname(), run, status, hang, ends, step,
                                                               oom_kills()))


# The OOM kills the container's memory cgroup counted: cgroup v2, then v1 (runc mounts the container's own).
OOM_COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))


def oom_kills() -> int | None:
    for path in OOM_COUNTERS:
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill" and value.strip().isdigit():
                    return int(value)
        except OSError:
            continue
    return None


def oom_increase(attempt: Path, found: list[dict]) -> list[tuple[str, int]]:
    """The hosts whose memory cgroup counted OOM kills during `attempt` ((host, kills)): counts above those the
    attempt before it recorded (its oom.json; a count that fell is a new container, counted from 0). Writes this
    attempt's oom.json."""
    counts = {e["host"]: e["oom_kills"] for e in found if e.get("oom_kills") is not None}
    before = {}
    for earlier in reversed([a for a in numbered(attempt.parent) if a.name < attempt.name]):
        try:
            before = json.loads((earlier / "oom.json").read_text())
            break
        except (OSError, ValueError):
            continue
    before = before if isinstance(before, dict) else {}
    try:
        recorded = json.loads((attempt / "oom.json").read_text())
    except (OSError, ValueError):
        recorded = {}
    keep(attempt / "oom.json", json.dumps({**(recorded if isinstance(recorded, dict) else {}), **counts}))
    increased = []
    for host, count in counts.items():
        previous = before.get(host, 0) if isinstance(before.get(host, 0), int) else 0
        if count > (previous if count >= previous else 0):
            increased.append((host, count - (previous if count >= previous else 0)))
    return increased


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def decide(attempt: Path, status: int, found: list[dict]) -> dict:
    """Why the attempt ended (cause.json), from its exit status and every host's evidence: completed; preempted (a
    stopped-* file); an OOM kill a host's memory cgroup counted; else the first thing that went wrong, by time: a
    hang (the watchdogs' reports, merged: the culprit) or what a rank said of its own end (its exception, a refused
    configuration, a failed checkpoint volume, a non-finite loss; a rank that failed because another did says
    less); a rank killed by a signal, which says nothing, comes before its peers' errors, which follow from it; then
    exit status 2 (a configuration error), and any other exit."""
    number = int(attempt.name)
    ends = sorted((r for e in found for r in e["ends"]), key=lambda r: r["time"])
    hangs = [e["hang"] for e in found if e["hang"]]
    steps = [s for s in (*(e["step"] for e in found), *(r["step"] for r in ends),
                         *(r["step"] for h in hangs for r in h["ranks"])) if s is not None]
    cause = {"status": status, "step": max(steps, default=None)}
    merged = podstate.merge_hang_reports(hangs)
    killed = [(e["host"], sig) for e in found if e["status"] is not None
              and (sig := podstate.exit_signal(e["status"])) not in (None, signal.SIGTERM)]
    if not killed and podstate.exit_signal(status) not in (None, signal.SIGTERM):
        killed = [("", podstate.exit_signal(status))]
    ends = [r for r in ends if not r["echo"]] or ends  # a rank that failed because another did says less
    said = [r for r in ends if r["cause"] in ("config-error", "storage-error", "loss-nan")]
    first = (said or ([] if killed and not merged else ends))[:1]
    oom = oom_increase(attempt, found)
    if status == 0:
        cause.update(cause="completed", reason="completed")
    elif any(attempt.glob("stopped-*")):
        cause.update(cause="preempted", reason=STOPPED)
    elif oom:
        hosts = ", ".join(f"{host} ({kills} kill{'s' if kills != 1 else ''})" for host, kills in oom[:3])
        cause.update(cause="oom-killed", error="the kernel's OOM killer ended a process", reason=(
            f"attempt {number} ended: oom-killed: the kernel's OOM killer ended a process in the container of "
            f"{hosts}: raise worker.resources.limits.memory, or lower the memory a rank needs"))
    elif merged and not (first and first[0]["time"] < min(h["time"] for h in hangs)):
        culprit = merged["culprit"]
        cause.update(cause="hang", reason=f"attempt {number} ended: {merged['reason']}",
                     culprit=f"rank {culprit['rank']} on {culprit['host']}")
    elif first:
        record = first[0]
        at = f" at step {record['step']}" if record["step"] is not None else ""
        culprit = merged["culprit"] if merged else record
        cause.update(cause=record["cause"], error=record["line"],
                     culprit=f"rank {culprit['rank']} on {culprit['host']}",
                     reason=f"attempt {number} ended: {record['cause']}: rank {record['rank']} on {record['host']}{at}"
                            f": {record['line']}" + (f"; {merged['reason']}" if merged else "")
                            + ("; not retried" if record["cause"] in ("config-error", "storage-error") else ""))
    elif killed:
        host, sig = killed[0]
        where = f" on {host}" if host else ""
        cause.update(cause="program-error", error=f"killed by {signal_name(sig)}",
                     reason=f"attempt {number} ended: program-error: a rank{where} was killed by {signal_name(sig)}"
                            + (" (kill -9, or the kernel's OOM killer: `make why` reads which from the pod)"
                               if sig == signal.SIGKILL else ""))
    elif status == podstate.EXIT_CONFIG_ERROR:
        cause.update(cause="config-error", reason=f"attempt {number} ended with status {status}, a configuration "
                                                  "error (its line is in the ranks' log): not retried")
    else:
        cause.update(cause="program-error", reason=f"attempt {number} ended: program-error: exit status {status} "
                                                   "(no rank said why: the ranks' log has it)")
    try:
        cause["begun"] = float((attempt / "begun").read_text())
    except (OSError, ValueError):
        pass
    cause["ended"] = time.time()
    keep(attempt / "cause.json", json.dumps({k: v for k, v in cause.items() if v is not None}))
    return cause


def keep(path: Path, text: str) -> bool:
    """Writes one of the ledger's files (atomically); on a volume that refuses it (full: the checkpoints filled it)
    says so in one line and goes on: the verdict (the pod's own state directory) and the termination message
    still say why the attempt ended."""
    try:
        podstate.atomic_write(path, text)
        return True
    except OSError as err:
        print(f"attempts: cannot write {path} ({err.strerror}): the ledger keeps no record of this; the verdict "
              "still says why the attempt ended", file=sys.stderr)
        return False


def end(status: int) -> None:
    attempt = os.environ.get(podstate.ATTEMPT_ENV["attempt_dir"])
    run = os.environ.get(podstate.ATTEMPT_ENV["run"], "")
    cause = {}
    if attempt and Path(attempt).is_dir():
        keep(Path(attempt, "outcome"), f"{status}\n")
        own = evidence(run) if status != 0 else None  # this host's ranks (nossh worker 0's; none in ssh)
        if own:
            keep_evidence(own)
        cause = decide(Path(attempt), status, host_evidence(run) if run else [])
    if status == 0:
        say("done", cause="completed")
    elif attempt and any(Path(attempt).glob("stopped-*")):  # a preemption: the stop already said why
        say("stopped", STOPPED, cause="preempted")
    else:
        say("failed", cause.get("reason") or f"attempt {os.environ.get('DS_ATTEMPT', '?')} ended with status "
            f"{status}", culprit=cause.get("culprit"), cause=cause.get("cause", "program-error"))


def record_evidence(found: list) -> None:
    """The hosts' evidence of the attempt that just ended, which arrives after its end (nossh: at the start
    barrier): kept, and its cause decided again with it."""
    if not any([keep_evidence(e) for e in found]):
        return
    attempts = numbered(job_dir())
    if not attempts or not (attempts[-1] / "outcome").exists():
        return
    try:
        status = int((attempts[-1] / "outcome").read_text().strip())
    except ValueError:
        return
    cause = decide(attempts[-1], status, host_evidence(podstate.run_id(int(attempts[-1].name), job_dir().name)))
    if status != 0 and verdict(attempts[-1]) == "failure":
        say("failed", cause["reason"], env={podstate.ATTEMPT_ENV["attempt"]: attempts[-1].name.lstrip("0")},
            culprit=cause.get("culprit"), cause=cause["cause"])


def collect(lines) -> int:
    """pdsh's `host: line` output of every worker's evidence: evidence is kept, other lines printed. A host's last
    line without a newline runs into the next host's first (pdsh writes them as they come): what follows a record on
    its line is a line of its own."""
    kept, decoder = 0, json.JSONDecoder()
    pending = [line.rstrip("\n") for line in lines]
    while pending:
        line = pending.pop(0)
        host, _, text = line.partition(": ")
        if text.startswith('{"v"'):
            try:
                record, end = decoder.raw_decode(text[:podstate.MAX_RECORD_BYTES])
                kept += keep_evidence(record)
                if text[end:].strip():
                    pending.insert(0, text[end:])
            except ValueError:
                pass
        else:
            print(line)
    return kept


def history(directory: Path) -> tuple[list[dict], dict[str, int]]:
    """The last podstate.HISTORY attempts that ended ({attempt, cause, step, seconds}) and every ended attempt's count
    by cause."""
    entries, counts = [], {}
    for attempt in numbered(directory):
        cause = cause_of(attempt)
        if not cause.get("cause"):
            continue
        counts[cause["cause"]] = counts.get(cause["cause"], 0) + 1
        seconds = podstate.number(cause.get("ended", 0)) - (podstate.number(cause.get("begun")) or 0) \
            if cause.get("begun") else None
        entries.append({"attempt": int(attempt.name), "cause": cause["cause"], "step": cause.get("step"),
                        "ended": cause.get("ended"), **({"culprit": cause["culprit"]} if cause.get("culprit") else {}),
                        **({"seconds": round(seconds, 1)} if seconds is not None and seconds >= 0 else {})})
    return entries[-podstate.HISTORY:], counts


def say(state: str, reason: str | None = None, env: dict[str, str] | None = None, culprit: str | None = None,
        cause: str | None = None) -> None:
    """Where the job stands, for the sidecar (nothing without the state directory) and the container's termination
    message (the last word, when the container ends). Errors are ignored."""
    env = env or os.environ
    try:
        entries, counts = history(job_dir())
    except OSError:
        entries, counts = [], {}
    record = {"v": podstate.VERSION, "state": state, **({"reason": reason} if reason else {}),
              **({"culprit": culprit} if culprit else {}), **({"cause": cause} if cause in podstate.CAUSES else {}),
              "time": time.time(), "history": entries, "causes": counts,
              **{key: env[podstate.ATTEMPT_ENV[key]] for key in podstate.COUNTER_KEYS
                 if podstate.ATTEMPT_ENV[key] in env}}
    termination = " | ".join(p for p in (state, cause, reason, f"culprit {culprit}" if culprit else "") if p)
    try:  # never created: outside a container (a test, the e2e harness) there is none to write
        fd = os.open(TERMINATION_LOG, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "w") as out:
            out.write(podstate.clean(termination, 4000) + "\n")
    except OSError:
        pass
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return
    try:
        path = Path(directory, VERDICT)
        path.parent.mkdir(parents=True, exist_ok=True)
        podstate.atomic_write(path, json.dumps(record))
    except OSError:
        pass


def _ranks_attempts() -> set[str]:
    """DS_ATTEMPT_DIR of this user's processes (an ssh worker's ranks get it from the launcher)."""
    found, me = set(), os.getuid()
    name = podstate.ATTEMPT_ENV["attempt_dir"].encode() + b"="
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != me:
                continue
            for entry in (proc / "environ").read_bytes().split(b"\0"):
                if entry.startswith(name):
                    found.add(entry.split(b"=", 1)[1].decode(errors="replace"))
        except OSError:
            continue
    return found


def stopped() -> list[str]:
    """Marks the running attempt(s) of this pod as preempted; the ones marked. Only inside DS_ATTEMPTS_DIR, and
    not once the owner recorded an outcome (the SIGTERM came after the run)."""
    root = ledger_root().resolve()
    own = os.environ.get(podstate.ATTEMPT_ENV["attempt_dir"])
    marked = []
    for attempt in sorted({own} if own else _ranks_attempts()):
        path = Path(attempt).resolve()
        if path.is_relative_to(root) and path.is_dir() and not (path / "outcome").exists():
            try:
                (path / f"stopped-{_SAFE.sub('_', socket.gethostname())}").touch()
                marked.append(str(path))
            except OSError:
                pass
    return marked


def main(argv: list[str]) -> int:
    if argv[:1] == ["begin"]:
        env, line, _ = begin()
        if env is None:
            print(line, file=sys.stderr)
            return NOT_RETRIED
        print(f"attempts: {line}", file=sys.stderr)
        for key in ENV_KEYS:
            print(f"{key}={env[key]}")
        return 0
    if argv[:1] == ["end"] and len(argv) == 2 and argv[1].isdigit():
        end(int(argv[1]))
        return 0
    if argv == ["collect"]:
        collect(sys.stdin)
        return 0
    if argv[:1] == ["evidence"] and len(argv) == 2:
        found = evidence(argv[1])
        if found:
            print(json.dumps(found, separators=(",", ":")))
        return 0
    if argv == ["stopped"]:
        marked = stopped()
        if marked:  # not after the run's outcome (a scale-down after success stops no attempt)
            say("stopping", STOPPED)
        for path in marked:
            print(f"attempts: {path}: stopped by SIGTERM (a preemption: not counted against the failure budget)")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
