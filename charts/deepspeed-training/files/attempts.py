"""The job's attempts and its failure budget, kept where a new pod finds them: DS_ATTEMPTS_DIR/<job>/, where
<job> is the release's install (job_dir). DS_ATTEMPTS_DIR is in the release's checkpoint directory when the
attempt's owner mounts a shared claim; otherwise in the pod's /tmp, where the count starts again with each pod.
One directory per attempt (0001, 0002, ...) holding:

    outcome          the run's exit status, written by the attempt's owner (ssh: the launcher; nossh: worker 0)
    cause.json       why it ended, in one line (`reason`), and the culprit of a hang: from every host's hang report
                     (podstate.merge_hang_reports), which reach the owner with the attempt's end (ssh: `collect`,
                     from pdsh; nossh: the start barrier, `record_reports`)
    stopped-<host>   written by a pod script that got SIGTERM during the attempt (eviction, preemption, upgrade,
                     pod deletion), before it stops its ranks, so it is there before the peers' runs fail

An attempt with a stopped-* file is a preemption, one with outcome 0 a success, any other a failure (a failed
run, or an owner that died before writing the outcome: a lost node). Only failures spend the budget
(DS_RUN_RETRIES failed attempts are started again). A Job that finds the budget spent fails, and is recorded in
budget.json; a later Job of the install (a `helm upgrade` after the job failed: the fix) counts a fresh budget from
its own first attempt, while an upgrade during a run continues the running budget.

Each also says where the job stands in the state directory's VERDICT (train/podstate.py: JSON, replaced atomically:
state, reason, culprit and the attempt counter), which the pod's sidecar (sidecar.py) publishes. The hang reports it
merges come from the tenant's containers: they are typed and bounded (podstate.valid_hang_report) before use.

Usage (standard library and the protocol's copy; the pod scripts call it, gang-barrier.py imports it):
  attempts.py begin      starts the next attempt: prints its env (KEY=VALUE lines, for every rank) on stdout and
                         "attempt N (F of B failures used, P preemptions)" on stderr, and exits 0; or says on
                         stderr why the budget is spent and exits podstate.EXIT_BUDGET_SPENT
  attempts.py end RC     records the outcome of the attempt in DS_ATTEMPT_DIR, and why it ended
  attempts.py collect    reads pdsh's output of the workers' hang reports on stdin (`host: line`), keeps each host's
                         report for `end` and passes every other line through to stdout
  attempts.py stopped    marks this pod's attempt as stopped by SIGTERM: DS_ATTEMPT_DIR, or in an ssh worker
                         (which starts no attempt) the one its ranks run in, read from their environment
"""

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "generated"))  # the chart's copy of train/podstate.py
import podstate  # noqa: E402

BUDGET_SPENT = podstate.EXIT_BUDGET_SPENT  # the chart's podFailurePolicy fails the Job on it
ENV_KEYS = tuple(podstate.ATTEMPT_ENV.values())
VERDICT = podstate.VERDICT
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")  # every value is pasted into a remote shell by DeepSpeed's pdsh runner
STOPPED = "stopped by SIGTERM (a preemption: not counted against the failure budget)"


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


def summary(attempt: int, failures: int, preemptions: int) -> str:
    return (f"attempt {attempt} ({failures} of {budget()} failures used, "
            f"{preemptions} preemption{'s' if preemptions != 1 else ''})")


def cause_of(attempt: Path) -> dict:
    """Why an attempt ended, as end() or record_reports() recorded it ({} if neither did)."""
    try:
        cause = json.loads((attempt / "cause.json").read_text())
    except (OSError, ValueError):
        return {}
    return cause if isinstance(cause, dict) else {}


def begin() -> tuple[dict[str, str] | None, str]:
    """The next attempt's env and its summary line, or (None, why) when the failures exceed the budget."""
    directory = job_dir()
    directory.mkdir(parents=True, exist_ok=True)
    podstate.prune(directory.parent, podstate.KEEP_JOBS, spare=directory.name)  # earlier installs' ledgers
    count, failures, preemptions = tally(directory)
    if failures > budget() and not spent(directory, count):
        count, failures, preemptions = tally(directory)
    previous = numbered(directory)[-1:] or [None]
    last = cause_of(previous[0]) if previous[0] and verdict(previous[0]) != "success" else {}
    if failures > budget():
        why = (f"failure budget spent: {failures} failed attempts, job.runRetries={budget()} allows {budget()} "
               f"(preemptions do not count: {preemptions}); failing the job. Attempts: {directory}")
        say("failed", why + (f"; the last ended: {last['reason']}" if last.get("reason") else ""),
            culprit=last.get("culprit"))
        return None, why
    number = count + 1
    while True:  # mkdir is atomic: two owners never share a number (one owner at a time is the rule)
        attempt = directory / f"{number:04d}"
        try:
            attempt.mkdir()
            break
        except FileExistsError:
            number += 1
    # The run's name (diagnostics/<run>) is unique across Jobs of the release: the job's first 8 characters.
    env = {podstate.ATTEMPT_ENV["run"]: podstate.run_id(number, directory.name),
           podstate.ATTEMPT_ENV["attempt_dir"]: str(attempt), podstate.ATTEMPT_ENV["attempt"]: str(number),
           podstate.ATTEMPT_ENV["failures"]: str(failures), podstate.ATTEMPT_ENV["failure_budget"]: str(budget()),
           podstate.ATTEMPT_ENV["preemptions"]: str(preemptions),
           podstate.ATTEMPT_ENV["begun"]: f"{time.time():.3f}"}
    # Why the attempt before ended stays said until this one ends: the reason of a retry.
    say("starting", last.get("reason"), env=env, culprit=last.get("culprit"))
    return env, summary(number, failures, preemptions)


def host_reports(run: str) -> list[dict]:
    """The hang reports of `run` the hosts sent (state directory, hosts/), typed and bounded."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return []
    hosts = podstate.StateDir(Path(directory)).subdir(podstate.HOST_REPORTS)
    reports = []
    for name in hosts.names(re.compile(r"[A-Za-z0-9_.-]+\.json")):
        found = hosts.read_json(name)
        report = podstate.valid_hang_report(found[0]) if found else None
        if report and report["run"] == run:
            reports.append(report)
    return reports


def keep_report(report) -> bool:
    """Keeps one host's hang report in the state directory's hosts/ for end(); False if it is not one."""
    report = podstate.valid_hang_report(report)
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if report is None or not directory:
        return False
    folder = Path(directory) / podstate.HOST_REPORTS
    folder.mkdir(parents=True, exist_ok=True)
    podstate.atomic_write(folder / f"{_SAFE.sub('_', report['host'])[:200] or 'host'}.json", json.dumps(report))
    return True


def record_cause(attempt: Path, status: int, run: str) -> dict:
    """Why the attempt ended (cause.json), from its exit status and the hosts' hang reports of its run."""
    merged = podstate.merge_hang_reports(host_reports(run)) if run else None
    if status == 0:
        cause = {"status": 0, "reason": "completed"}
    elif any(attempt.glob("stopped-*")):
        cause = {"status": status, "reason": STOPPED}
    elif merged:
        culprit = merged["culprit"]
        cause = {"status": status, "reason": f"attempt {attempt.name.lstrip('0')} ended: {merged['reason']}",
                 "culprit": f"rank {culprit['rank']} on {culprit['host']}"}
    elif status == podstate.EXIT_CONFIG_ERROR:
        cause = {"status": status, "reason": f"attempt {attempt.name.lstrip('0')} ended with status {status}, a "
                                             "configuration error (its line is in the ranks' log): not retried"}
    else:
        cause = {"status": status, "reason": f"attempt {attempt.name.lstrip('0')} ended with status {status}"}
    podstate.atomic_write(attempt / "cause.json", json.dumps(cause))
    return cause


def end(status: int) -> None:
    attempt = os.environ.get(podstate.ATTEMPT_ENV["attempt_dir"])
    cause = {}
    if attempt and Path(attempt).is_dir():
        Path(attempt, "outcome").write_text(f"{status}\n")
        cause = record_cause(Path(attempt), status, os.environ.get(podstate.ATTEMPT_ENV["run"], ""))
    if status == 0:
        say("done")
    elif attempt and any(Path(attempt).glob("stopped-*")):  # a preemption: the stop already said why
        say("stopped", STOPPED)
    else:
        say("failed", cause.get("reason") or f"attempt {os.environ.get('DS_ATTEMPT', '?')} ended with status "
            f"{status}", culprit=cause.get("culprit"))


def record_reports(reports: list) -> None:
    """The hosts' hang reports of the attempt that just ended, which arrive after its end (nossh: at the start
    barrier): kept, and its cause recorded again with them."""
    if not any([keep_report(report) for report in reports]):
        return
    attempts = numbered(job_dir())
    if not attempts or not (attempts[-1] / "outcome").exists():
        return
    try:
        status = int((attempts[-1] / "outcome").read_text().strip())
    except ValueError:
        return
    cause = record_cause(attempts[-1], status, podstate.run_id(int(attempts[-1].name), job_dir().name))
    if status != 0 and verdict(attempts[-1]) == "failure":
        say("failed", cause["reason"], env={podstate.ATTEMPT_ENV["attempt"]: attempts[-1].name.lstrip("0")},
            culprit=cause.get("culprit"))


def collect(lines) -> int:
    """pdsh's `host: line` output of every worker's hang report: reports are kept, other lines printed. A host's
    last line without a newline runs into the next host's first (pdsh writes them as they come): what follows a
    report on its line is a line of its own."""
    kept, decoder = 0, json.JSONDecoder()
    pending = [line.rstrip("\n") for line in lines]
    while pending:
        line = pending.pop(0)
        host, _, text = line.partition(": ")
        if text.startswith('{"v"'):
            try:
                report, end = decoder.raw_decode(text[:podstate.MAX_RECORD_BYTES])
                kept += keep_report(report)
                if text[end:].strip():
                    pending.insert(0, text[end:])
            except ValueError:
                pass
        else:
            print(line)
    return kept


def say(state: str, reason: str | None = None, env: dict[str, str] | None = None, culprit: str | None = None) -> None:
    """Where the job stands, for the sidecar; nothing without the state directory. Errors are ignored."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return
    env = env or os.environ
    record = {"v": podstate.VERSION, "state": state, **({"reason": reason} if reason else {}),
              **({"culprit": culprit} if culprit else {}), "time": time.time(),
              **{key: env[podstate.ATTEMPT_ENV[key]] for key in podstate.COUNTER_KEYS
                 if podstate.ATTEMPT_ENV[key] in env}}
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
        env, line = begin()
        if env is None:
            print(line, file=sys.stderr)
            return BUDGET_SPENT
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
