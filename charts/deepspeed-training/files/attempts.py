"""The job's attempts and its failure budget, kept where a new pod finds them: DS_ATTEMPTS_DIR/<job>/, where
<job> is the Job's uid (DS_JOB_UID; a reinstall is a new Job with a fresh budget). DS_ATTEMPTS_DIR is in the
release's checkpoint directory when the attempt's owner mounts a shared claim; otherwise in the pod's /tmp, where
the count starts again with each pod. One directory per attempt (0001, 0002, ...) holding:

    outcome          the run's exit status, written by the attempt's owner (ssh: the launcher; nossh: worker 0)
    stopped-<host>   written by a pod script that got SIGTERM during the attempt (eviction, preemption, upgrade,
                     pod deletion), before it stops its ranks, so it is there before the peers' runs fail

An attempt with a stopped-* file is a preemption, one with outcome 0 a success, any other a failure (a failed
run, or an owner that died before writing the outcome: a lost node). Only failures spend the budget
(DS_RUN_RETRIES failed attempts are started again).

Each of the three also says where the job stands in DS_RANK_STATE_DIR/VERDICT (JSON, replaced atomically: state,
reason and the attempt counter), which the pod's progress sidecar (progress.py) puts into the progress ConfigMap.

Usage (standard library only; the pod scripts call it, gang-barrier.py imports it):
  attempts.py begin      starts the next attempt: prints its env (KEY=VALUE lines, for every rank) on stdout and
                         "attempt N (F of B failures used, P preemptions)" on stderr, and exits 0; or says on
                         stderr why the budget is spent and exits BUDGET_SPENT
  attempts.py end RC     records the outcome of the attempt in DS_ATTEMPT_DIR
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

BUDGET_SPENT = 3  # the chart's podFailurePolicy fails the Job on it: the budget is the job's, not the pod's
ENV_KEYS = ("DS_RUN_ID", "DS_ATTEMPT_DIR", "DS_ATTEMPT", "DS_FAILURES", "DS_FAILURE_BUDGET", "DS_PREEMPTIONS",
            "DS_ATTEMPT_BEGUN")  # BEGUN: the wall clock at its start, for train/goodput.py
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")  # every value is pasted into a remote shell by DeepSpeed's pdsh runner
VERDICT = "verdict.json"  # in DS_RANK_STATE_DIR, for progress.py
STOPPED = "stopped by SIGTERM (a preemption: not counted against the failure budget)"
# The attempt counter in VERDICT, named as train/rankstate.py's ATTEMPT_ENV names it in rank 0's progress.
VERDICT_ENV = {"attempt": "DS_ATTEMPT", "failures": "DS_FAILURES", "failure_budget": "DS_FAILURE_BUDGET",
               "preemptions": "DS_PREEMPTIONS", "run": "DS_RUN_ID"}


def job_dir() -> Path:
    job = _SAFE.sub("_", os.environ.get("DS_JOB_UID", "")) or "pod-" + _SAFE.sub("_", socket.gethostname())
    return Path(os.environ.get("DS_ATTEMPTS_DIR") or "/tmp/deepspeed-attempts") / job


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


def tally(directory: Path) -> tuple[int, int, int]:
    """(attempts, failures, preemptions) so far."""
    attempts = numbered(directory)
    verdicts = [verdict(a) for a in attempts]
    return len(attempts), verdicts.count("failure"), verdicts.count("preemption")


def budget() -> int:
    return int(os.environ.get("DS_RUN_RETRIES") or 0)


def summary(attempt: int, failures: int, preemptions: int) -> str:
    return (f"attempt {attempt} ({failures} of {budget()} failures used, "
            f"{preemptions} preemption{'s' if preemptions != 1 else ''})")


def begin() -> tuple[dict[str, str] | None, str]:
    """The next attempt's env and its summary line, or (None, why) when the failures exceed the budget."""
    directory = job_dir()
    directory.mkdir(parents=True, exist_ok=True)
    count, failures, preemptions = tally(directory)
    if failures > budget():
        why = (f"failure budget spent: {failures} failed attempts, job.runRetries={budget()} allows {budget()} "
               f"(preemptions do not count: {preemptions}); failing the job. Attempts: {directory}")
        say("failed", why)
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
    env = {"DS_RUN_ID": f"run-{number:04d}-{directory.name[:8]}", "DS_ATTEMPT_DIR": str(attempt),
           "DS_ATTEMPT": str(number), "DS_FAILURES": str(failures), "DS_FAILURE_BUDGET": str(budget()),
           "DS_PREEMPTIONS": str(preemptions), "DS_ATTEMPT_BEGUN": f"{time.time():.3f}"}
    say("starting", env=env)
    return env, summary(number, failures, preemptions)


def end(status: int) -> None:
    attempt = os.environ.get("DS_ATTEMPT_DIR")
    if attempt and Path(attempt).is_dir():
        Path(attempt, "outcome").write_text(f"{status}\n")
    if status == 0:
        say("done")
    elif attempt and any(Path(attempt).glob("stopped-*")):  # a preemption: the stop already said why
        say("stopped", STOPPED)
    else:
        say("failed", f"attempt {os.environ.get('DS_ATTEMPT', '?')} ended with status {status}")


def say(state: str, reason: str | None = None, env: dict[str, str] | None = None) -> None:
    """Where the job stands, for the progress sidecar; nothing without DS_RANK_STATE_DIR. Errors are ignored."""
    directory = os.environ.get("DS_RANK_STATE_DIR")
    if not directory:
        return
    env = env or os.environ
    verdict = {"state": state, **({"reason": reason} if reason else {}), "time": time.time(),
               **{key: env[name] for key, name in VERDICT_ENV.items() if name in env}}
    try:
        path = Path(directory, VERDICT)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)
    except OSError:
        pass


def _ranks_attempts() -> set[str]:
    """DS_ATTEMPT_DIR of this user's processes (an ssh worker's ranks get it from the launcher)."""
    found, me = set(), os.getuid()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != me:
                continue
            for entry in (proc / "environ").read_bytes().split(b"\0"):
                if entry.startswith(b"DS_ATTEMPT_DIR="):
                    found.add(entry.split(b"=", 1)[1].decode(errors="replace"))
        except OSError:
            continue
    return found


def stopped() -> list[str]:
    """Marks the running attempt(s) of this pod as preempted; the ones marked. Only inside DS_ATTEMPTS_DIR, and
    not once the owner recorded an outcome (the SIGTERM came after the run)."""
    root = Path(os.environ.get("DS_ATTEMPTS_DIR") or "/tmp/deepspeed-attempts").resolve()
    own = os.environ.get("DS_ATTEMPT_DIR")
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
