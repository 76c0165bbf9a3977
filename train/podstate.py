"""The pods' run-time protocol: one owner for every file, word, env name and exit status that the ranks (the train
package in the tenant's image, or any program through train/rankstate.py) and the chart's pod scripts (in the
chart's ConfigMap) exchange. Standard library only: the pod scripts run it under `python3 -I`, from a copy that
scripts/chart_data.py writes into the chart (files/generated/podstate.py, the same bytes) and keeps from going stale
(its --check, in the tests); the bash scripts source files/generated/podstate.sh, generated from the constants here.
The image and the chart ship apart, so the two sides may speak different versions: every record carries VERSION,
and a pair whose versions differ is refused before training, naming both (check_version).

Files in the pod's state directory (STATE_DIR_ENV, the pod's /tmp emptyDir, shared by its containers), each with
its writer -> its readers: its format:

- `<pid>` (RANK_FILE): every rank (rankstate.report/beat) -> watchdog.py, kill-ranks.sh, the sidecar, rank-log.py:
  `<state> rank=R [step=N] [step_s=S]` (rank_line parses it); its mtime is the heartbeat.
- `<pid>.stacks`: the rank, on DUMP_SIGNAL (faulthandler) -> watchdog.py: every thread's Python stack.
- `<pid>.fr-request`, `<pid>.fr.json`: watchdog.py (a write to the FIFO), the rank (the dump) -> watchdog.py: torch's
  flight recorder, JSON.
- `progress.json` (PROGRESS): rank 0 (rankstate.publish) -> the sidecar: JSON: state, step, steps, loss, ..., goodput
  (GOODPUT_BUCKETS, GOODPUT_TOTALS), the attempt counter (COUNTER_KEYS), `time`.
- `verdict.json` (VERDICT): the ledger's owner (attempts.py; ssh: the launcher, nossh: worker 0) -> the sidecar: JSON:
  `v`, state (LEDGER_STATES), reason, culprit, the attempt counter, `time`.
- `hang-<run>.txt`, `hang-<run>.json` (HANG_TEXT, HANG_JSON): watchdog.py -> the pod's log; attempts.py `evidence`,
  which sends the JSON (one HangReport, hang_report) to the ledger's owner in the host's evidence (host_evidence; ssh:
  pdsh; nossh: the start barrier), kept in `hosts/` (HOST_REPORTS) and merged with the other hosts'
  (merge_hang_reports).
- `attempt.env` (ATTEMPT_ENV_FILE): gang-barrier.py (nossh) -> nossh-worker.sh: KEY=VALUE lines of ATTEMPT_ENV.
- `end-<rank>.json` (END_RECORD): a rank that ends on an error it can name (rankstate.fail: an uncaught exception,
  a non-finite loss, a failed checkpoint write, a refused configuration) -> attempts.py `evidence` on its host, which
  sends it to the ledger's owner with the host's hang report (ssh: pdsh; nossh: the start barrier): an EndRecord
  (end_record: v, run, rank, host, cause, line, step, time).

Every reader in the sidecar (the only container with a token) reads these through StateDir: no symlink is followed,
only regular files are read, and every read is bounded. What the tenant's containers write there is untrusted data.

Every line a rank writes (its stdout and stderr, through the chart's files/rank-log.py) starts with
rank_tag(rank, attempt), which RANK_TAG finds again (`make logs`).

Env: STATE_DIR_ENV; the attempt's (ATTEMPT_ENV: attempts.py gives them to every rank); PROTOCOL_ENV, which the chart
sets to the chart's VERSION. Exit statuses: EXIT_CONFIG_ERROR (2: a configuration error, never retried),
EXIT_NOT_RETRIED (3: the ledger stopped the job: its failure budget spent, the same error twice, no progress),
EXIT_STOPPED (143: stopped by SIGTERM, a preemption).
Run IDs: run_id(attempt, job) / parse_run_id(run).
"""

import json
import os
import re
import signal
import stat
import tempfile
from pathlib import Path

VERSION = 1  # bump it when a reader of one version would misread the files of another

# ---- a rank's state (the first word of its <pid> file)
STATES = ("starting", "restoring", "training", "saving", "stopping")
CHECKPOINT_STATES = ("restoring", "saving")  # judged by the checkpoint budget, not the step budget
NOTHING_TO_SAVE_STATES = ("starting", "restoring")  # no step since the rank started: a stop kills them at once
UNJUDGED_STATES = ("stopping",)  # SIGTERM reached the rank's handler: the pod's grace period bounds it
STEP_MULTIPLE = 10  # a rank's step budget is at least this many of its own recent step times
DUMP_SIGNAL = signal.SIGUSR1  # faulthandler writes every thread's stack to <pid>.stacks

# ---- the job's state (the ledger's verdict, attempts.py), and what the sidecar shows before it says anything
LEDGER_STATES = ("starting", "failed", "stopping", "stopped", "done")
JOB_STATES = ("pending", *STATES, *(s for s in LEDGER_STATES if s not in STATES))

# ---- goodput: where the job's wall time went (train/goodput.py), published by rank 0 under these keys
GOODPUT_BUCKETS = ("productive", "startup", "restore", "save", "recomputation", "hung")
GOODPUT_TOTALS = ("wall", "unaccounted")

# ---- files in the state directory
STATE_DIR_ENV = "DS_RANK_STATE_DIR"
STACKS_SUFFIX = ".stacks"
FR_REQUEST_SUFFIX = ".fr-request"
FR_DUMP_SUFFIX = ".fr.json"
PROGRESS = "progress.json"
VERDICT = "verdict.json"
HANG_TEXT = "hang-{run}.txt"
HANG_JSON = "hang-{run}.json"
HOST_REPORTS = "hosts"
END_RECORD = "end-{rank}.json"
END_RECORD_NAME = re.compile(r"end-[0-9]{1,10}\.json")
ATTEMPT_ENV_FILE = "attempt.env"
RANK_FILE = re.compile(r"[0-9]{1,10}")  # a rank's <pid>

# ---- the chart's bookkeeping in the release's checkpoint directory (DS_CHECKPOINT_DIR): one folder, beside the
# program's checkpoints, each subtree with one writer: the ledger's owner (ATTEMPTS: attempts/<job>/NNNN), the
# watchdogs (DIAGNOSTICS: diagnostics/<run>/<host>.txt, the stacks), rank 0 (GOODPUT: goodput/<job>/*.json). Pruned:
# the last KEEP_RUNS runs' diagnostics, the last KEEP_JOBS jobs' ledgers and goodput records.
JOB_DIR = "_job"
ATTEMPTS, DIAGNOSTICS, GOODPUT = "attempts", "diagnostics", "goodput"
KEEP_RUNS = 10
KEEP_JOBS = 3
# The job: the release's install, which upgrades keep and a reinstall replaces: its progress ConfigMap's uid, which
# the sidecar writes here before the pod's main container starts (its startupProbe); without it the Job's uid.
JOB_ID_FILE = "job.id"

# ---- the attempt, for every rank (attempts.py writes them; published in progress.json and verdict.json under the
# left-hand names)
ATTEMPT_ENV = {"run": "DS_RUN_ID", "attempt_dir": "DS_ATTEMPT_DIR", "attempt": "DS_ATTEMPT",
               "failures": "DS_FAILURES", "failure_budget": "DS_FAILURE_BUDGET", "preemptions": "DS_PREEMPTIONS",
               "begun": "DS_ATTEMPT_BEGUN"}
COUNTER_KEYS = ("attempt", "failures", "failure_budget", "preemptions", "run")  # published with every record
PROTOCOL_ENV = "DS_PROTOCOL_VERSION"

# ---- exit statuses
EXIT_CONFIG_ERROR = 2
EXIT_NOT_RETRIED = 3
EXIT_STOPPED = 143

# ---- why an attempt ended: one cause from this list per attempt (attempts.py's cause.json and verdict, the progress
# ConfigMap's `cause`, the metric by cause), each decided by one component from the evidence it holds. The pods decide
# from in-pod evidence (exit statuses, signals, the watchdogs' reports, the ranks' end records); what only the API
# server knows (a container OOMKilled, a DisruptionTarget condition, a deleted pod, a lost node) is read by `make why`
# with the person's own read access, which refines the pods' cause of that attempt: the pods' tokens stay narrow.
# cause: (who decides, from what evidence, whether it spends the failure budget)
CAUSES = {
    "completed": ("the ledger's owner", "the program exited 0", "no"),
    "preempted": ("every pod script, on SIGTERM (a stopped-* file)", "a SIGTERM during the attempt: an eviction, "
                  "a spot reclaim, an upgrade, a pod deleted", "never"),
    "hang": ("the watchdogs, merged by the ledger's owner", "a rank without a step within its budget; the culprit "
             "by evidence (stopped, unresponsive, outside any collective, oldest beat)", "yes"),
    "collective-timeout": ("the rank (its exception)", "a collective that timed out "
                           "(deepspeed.collectiveTimeoutMinutes): a peer that never came", "yes"),
    "program-error": ("the rank (its exception's last line), or the ledger's owner from an exit status (a rank "
                      "killed by a signal)", "the program raised, or a rank died without a word", "yes"),
    "config-error": ("the rank (exit status 2 and its line)", "bad arguments, inputs or layout", "stops the job"),
    "loss-nan": ("the train package", "a non-finite mean loss, before any checkpoint of it is saved", "yes"),
    "storage-error": ("the train package", "the local checkpoint volume failed (full, read-only); an unreachable "
                      "bucket is upload lag, not an end", "stops the job"),
    "budget-spent": ("the ledger", "more failed attempts than job.runRetries", "stops the job"),
    "no-progress": ("the ledger", "job.noProgressAttempts failed attempts in a row without a new step",
                    "stops the job"),
    "oom-killed": ("the ledger's owner (a host's memory cgroup counted an OOM kill), make why (a container "
                   "OOMKilled)", "the memory limit", "yes"),
    "evicted": ("make why (DisruptionTarget, an Evicted pod)", "the eviction API or node pressure", "never"),
    "pod-deleted": ("make why (a deleted pod)", "someone or something deleted a pod", "never"),
    "node-lost": ("the ledger (an owner's pod that recorded nothing), make why (a node NotReady, DisruptionTarget)",
                  "the node went away, or a pod was killed outright", "yes"),
}
RANK_CAUSES = ("program-error", "collective-timeout", "config-error", "loss-nan", "storage-error")  # in end records
# The same error of these causes at the same step in two failed attempts in a row stops the job (deterministic).
REPEATABLE_CAUSES = ("program-error", "loss-nan", "storage-error", "collective-timeout", "oom-killed")
HISTORY = 10  # attempts the verdict's history keeps


def exit_signal(status: int) -> int | None:
    """The signal that killed a rank, from an exit status: 128+N (a shell's), or 256-N (Python's sys.exit(-N),
    DeepSpeed's launcher passing on a rank's returncode -N); None for a plain exit."""
    if 192 < status < 256:
        return 256 - status
    if 128 < status <= 192:
        return status - 128
    return None


def classify_exception(type_name: str, message: str) -> str:
    """A rank's uncaught exception as a cause: a collective that timed out (gloo: "Timed out waiting ... for recv",
    NCCL's watchdog: "Watchdog caught collective operation timeout", torch's DistBackendError, a store's
    DistStoreError timeout), or any other program error."""
    text = f"{type_name} {message}"
    if re.search(r"(?i)timed? ?out|timeout", text) and re.search(
            r"(?i)gloo|nccl|collective|watchdog|Dist(Backend|Store|Network)?Error|ProcessGroup|c10d", text):
        return "collective-timeout"
    return "program-error"


def end_record(run: str, rank: int, host: str, cause: str, line: str, step: int | None, time_: float,
               echo: bool = False) -> dict:
    """What a rank says of its own end (END_RECORD): an EndRecord. `echo`: it ends because another rank failed (its
    line says so; the other rank's says why)."""
    return {"v": VERSION, "run": clean(run, 64), "rank": int(rank), "host": clean(host, 253),
            "cause": cause if cause in RANK_CAUSES else "program-error", "line": clean(line, 1000),
            "step": step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 10**15 else None,
            "time": time_, "echo": echo is True}


def valid_end_record(record) -> dict | None:
    """`record` typed and bounded (a tenant's container wrote it), or None."""
    if not isinstance(record, dict) or record.get("v") != VERSION or record.get("cause") not in RANK_CAUSES:
        return None
    rank, moment = record.get("rank"), number(record.get("time"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 10**7 or moment is None:
        return None
    return end_record(str(record.get("run", "")), rank, str(record.get("host", "")), record["cause"],
                      str(record.get("line", "")), record.get("step"), moment, record.get("echo") is True)


def host_evidence(host: str, run: str, status: int | None, hang: dict | None, ends: list[dict],
                  step: int | None, oom_kills: int | None = None) -> dict:
    """What one host knows of how an attempt ended (attempts.py `evidence`): its DeepSpeed launcher's exit status
    (nossh; ssh has pdsh's), its watchdog's HangReport, its ranks' EndRecords, the last step rank 0 published there
    (if rank 0 is there) and the OOM kills its memory cgroup has counted (since the container started)."""
    return {"v": VERSION, "kind": "evidence", "host": clean(host, 253), "run": clean(run, 64),
            "status": status, "hang": hang, "ends": ends, "step": step, "oom_kills": oom_kills}


def valid_host_evidence(evidence) -> dict | None:
    """`evidence` typed and bounded (a worker sent it), or None."""
    if not isinstance(evidence, dict) or evidence.get("v") != VERSION or evidence.get("kind") != "evidence":
        return None
    status, step, kills = evidence.get("status"), evidence.get("step"), evidence.get("oom_kills")
    ends = [e for e in (valid_end_record(r) for r in (evidence.get("ends") or [])[:64]
                        if isinstance(evidence.get("ends"), list)) if e]
    return host_evidence(str(evidence.get("host", "")), str(evidence.get("run", "")),
                         status if isinstance(status, int) and not isinstance(status, bool) and 0 <= status < 256
                         else None,
                         valid_hang_report(evidence.get("hang")) if evidence.get("hang") else None, ends,
                         step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 10**15 else None,
                         kills if isinstance(kills, int) and not isinstance(kills, bool) and 0 <= kills < 10**9
                         else None)

# ---- bounds of what a reader takes in
MAX_RECORD_BYTES = 64 * 1024  # progress.json, verdict.json, a HangReport
MAX_LINE_BYTES = 1024  # a rank's state line
MAX_NAMES = 4096  # entries of the state directory a reader looks at
MAX_TEXT = 400  # characters of one published string


def rank_line(text: str) -> tuple[str, dict[str, str]]:
    """A rank's state line (RANK_FILE): its state word ("" when it is none of STATES) and its key=value fields."""
    words = text.split()
    return (words[0] if words and words[0] in STATES else ""), dict(w.split("=", 1) for w in words[1:] if "=" in w)


RANK_TAG = re.compile(r"\[rank (\d+)(?: attempt (\d+))?\] ")  # rank_tag's, found again in a log line


def rank_tag(rank: str, attempt: str) -> str:
    """What files/rank-log.py puts before every line a rank writes: `[rank 3 attempt 2] ` (`[rank 3] ` outside the
    chart's attempts)."""
    return f"[rank {rank}{f' attempt {attempt}' if attempt.isdigit() else ''}] "


def run_id(attempt: int, job: str) -> str:
    """The attempt's name, unique across the Jobs of a release: `run-0003-1a2b3c4d`."""
    return f"run-{attempt:04d}-{re.sub(r'[^A-Za-z0-9]', '', job)[:8] or 'local'}"


def parse_run_id(run: str) -> tuple[int, str] | None:
    """(attempt, job) of a run ID, or None."""
    match = re.fullmatch(r"run-(\d{4,})-([A-Za-z0-9]{1,8})", run or "")
    return (int(match[1]), match[2]) if match else None


def job_path(checkpoint_dir: Path, subtree: str) -> Path:
    """`<checkpoint_dir>/_job/<subtree>`; a subtree still at the layout before _job (`<checkpoint_dir>/<subtree>`,
    an upgrade of a running release) is moved there first, once (a rename on one volume), so that its budget and
    history carry over."""
    new, old = Path(checkpoint_dir) / JOB_DIR / subtree, Path(checkpoint_dir) / subtree
    if not new.exists() and old.is_dir() and not old.is_symlink():
        try:
            new.parent.mkdir(parents=True, exist_ok=True)
            os.rename(old, new)
        except OSError:
            pass  # another writer moved it first, or it cannot be moved: the new place starts empty
    return new


def prune(directory: Path, keep: int, spare: str = "") -> None:
    """Removes all but the `keep` newest entries (by mtime) of `directory`, never `spare`; errors are ignored."""
    import shutil

    try:
        entries = sorted((p for p in Path(directory).iterdir() if p.name != spare and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for stale in entries[keep:]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() and not stale.is_symlink() else \
            stale.unlink(missing_ok=True)


def job_id(state_dir: str | None, fallback: str) -> str:
    """The job's identity (JOB_ID_FILE, the sidecar's), else `fallback` (the Job's uid): one path component."""
    found = StateDir(Path(state_dir)).read(JOB_ID_FILE, 64) if state_dir else None
    text = found[0].decode(errors="replace").strip() if found else ""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text or fallback)


class VersionSkew(Exception):
    """The two sides of the protocol speak different versions."""


def check_version(chart_version: str | int | None, where: str) -> None:
    """Refuses a chart whose protocol VERSION (PROTOCOL_ENV) differs from this side's; no env: outside the chart."""
    if chart_version in (None, ""):
        return
    if str(chart_version) != str(VERSION):
        raise VersionSkew(f"{where}: the chart's pod scripts speak run-state protocol version {chart_version}, this "
                          f"image's train package version {VERSION}: upgrade the chart and the image together (or "
                          "pin the image the chart was released with)")


def atomic_write(path: Path, text: str) -> None:
    """Replaces `path` whole: a reader sees the old file or the new one, never half of either."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def clean(value, limit: int = MAX_TEXT) -> str:
    """A string from the other side, for a person or an API object: one line, no control, format or separator
    characters, at most `limit` characters."""
    text = re.sub(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]+", " ", str(value))
    return text[:limit]


def number(value) -> float | None:
    """A finite number from the other side, or None (a program's own writer may put anything there)."""
    if isinstance(value, bool):
        return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if result == result and abs(result) != float("inf") else None


class StateDir:
    """A state directory read by a process that must not trust it (the sidecar holds the release's token; the
    tenant's containers write here): the directory is opened without following a symlink in its last component
    (its parent, the pod's /tmp, is a mount point the tenant cannot replace), each file relative to it without
    following symlinks and without blocking (a FIFO or device answers at once, and is refused), only regular files
    are read, each read is bounded, and nothing raises: an entry that cannot be read safely is as if absent."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def _open(self) -> int | None:
        try:
            parent = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.open(self.path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=parent)
        except OSError:
            return None
        finally:
            os.close(parent)

    def names(self, pattern: re.Pattern | None = None, limit: int = MAX_NAMES) -> list[str]:
        """The entries' names (those `pattern` matches whole), at most `limit` of them, sorted."""
        fd = self._open()
        if fd is None:
            return []
        found = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if pattern is None or pattern.fullmatch(entry.name):
                        found.append(entry.name)
                        if len(found) >= limit:
                            break
        except OSError:
            pass
        finally:
            os.close(fd)
        return sorted(found)

    def read(self, name: str, limit: int = MAX_RECORD_BYTES) -> tuple[bytes, float] | None:
        """(up to `limit` bytes, mtime) of the regular file `name`, or None."""
        if "/" in name or name in ("", ".", ".."):
            return None
        fd = self._open()
        if fd is None:
            return None
        try:
            try:
                file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                               dir_fd=fd)
            except OSError:
                return None
            try:
                info = os.fstat(file)
                if not stat.S_ISREG(info.st_mode):
                    return None
                chunks, left = [], limit
                while left > 0:
                    chunk = os.read(file, min(left, 65536))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks), info.st_mtime
            except OSError:
                return None
            finally:
                os.close(file)
        finally:
            os.close(fd)

    def read_json(self, name: str, limit: int = MAX_RECORD_BYTES) -> tuple[dict, float] | None:
        """(the JSON object in `name`, mtime), or None: a larger file, another type or bad JSON is refused whole."""
        found = self.read(name, limit + 1)
        if found is None or len(found[0]) > limit:
            return None
        try:
            value = json.loads(found[0].decode("utf-8", "replace"))
        except ValueError:
            return None
        return (value, found[1]) if isinstance(value, dict) else None

    def mtime(self, name: str) -> float | None:
        fd = self._open()
        if fd is None:
            return None
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            return info.st_mtime if stat.S_ISREG(info.st_mode) else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def write(self, name: str, text: str) -> bool:
        """Replaces the file `name` with `text`, through the directory opened without following a link (made if
        absent) and a fresh temporary file beside it: a link planted there is replaced, never written through."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        fd = self._open()
        if fd is None:
            return False
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            try:
                os.write(out, text.encode())
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            return True
        except OSError:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            return False
        finally:
            os.close(fd)

    def subdir(self, name: str) -> "StateDir":
        return StateDir(self.path / name)


# ---- hang reports: what each host's watchdog found, and the job's verdict from all of them

# How a rank of a hung attempt was found. The first three are evidence against the rank itself (it cannot run,
# did not answer, or is stuck outside any collective); the last says it waits for a peer.
KINDS = ("stopped", "unresponsive", "outside-collective", "in-collective")


def hang_rank(rank: int | str, host: str, kind: str, last_beat: float, step: int | None, state: str,
              where: str) -> dict:
    return {"rank": int(rank) if str(rank).isdigit() else -1, "host": clean(host, 253), "kind": kind,
            "last_beat": last_beat, "step": step, "state": clean(state, 32), "where": clean(where)}


def hang_report(host: str, run: str, time_: float, ranks: list[dict]) -> dict:
    """What one host's watchdog found: a HangReport (JSON: v, host, run, time, ranks)."""
    return {"v": VERSION, "host": clean(host, 253), "run": clean(run, 64), "time": time_, "ranks": ranks}


def valid_hang_report(report) -> dict | None:
    """`report` typed and bounded (it comes from a tenant's container), or None."""
    if not isinstance(report, dict) or report.get("v") != VERSION or not isinstance(report.get("ranks"), list):
        return None
    ranks = []
    for rank in report["ranks"][:64]:
        if not isinstance(rank, dict) or rank.get("kind") not in KINDS or number(rank.get("last_beat")) is None:
            continue
        step = rank.get("step") if isinstance(rank.get("step"), int) and not isinstance(rank.get("step"), bool) \
            else None
        ranks.append(hang_rank(rank.get("rank", -1), str(rank.get("host", "")), rank["kind"],
                               number(rank["last_beat"]), step, str(rank.get("state", "")),
                               str(rank.get("where", ""))))
    if not ranks:
        return None
    return hang_report(str(report.get("host", "")), str(report.get("run", "")), number(report.get("time")) or 0.0,
                       ranks)


def merge_hang_reports(reports: list[dict]) -> dict | None:
    """The job's verdict on a hung attempt from every host's report: the culprit is the rank with evidence against
    itself (stopped, unresponsive, stuck outside a collective) before any that waits in a collective, and among
    those the one whose last beat is oldest; the ranks waiting in collectives are its victims. None without reports.
    Returns {"culprit": rank, "victims": [ranks], "reason": one line}."""
    ranks = [rank for report in reports for rank in report["ranks"]]
    if not ranks:
        return None
    ranks.sort(key=lambda r: (r["kind"] == "in-collective", r["last_beat"], r["rank"]))
    culprit = ranks[0]
    victims = [r for r in ranks[1:] if r["kind"] == "in-collective"]
    step = f", after step {culprit['step']}" if culprit["step"] is not None else ""
    words = {"stopped": "its process is stopped", "unresponsive": "it did not answer for its stack",
             "outside-collective": "it is stuck outside any collective", "in-collective": "it waits in a collective"}
    where = "" if culprit["kind"] == "stopped" else f": {culprit['where']}"
    reason = (f"hang: rank {culprit['rank']} on {culprit['host']} is the likely culprit ({words[culprit['kind']]}"
              f"{where}{step})")
    if victims:
        shown = ", ".join(f"rank {v['rank']} on {v['host']}" for v in victims[:3])
        more = f" and {len(victims) - 3} more" if len(victims) > 3 else ""
        many = len(victims) != 1
        reason += f"; {len(victims)} rank{'s' if many else ''} wait{'' if many else 's'} for it in collectives " \
                  f"({shown}{more})"
    return {"culprit": culprit, "victims": victims, "reason": clean(reason, 1000)}


def chart_constants() -> dict:
    """files/generated/podstate.json: what the chart's templates need of this module (the Job's failure policy, the
    version the chart's scripts speak)."""
    return {"version": VERSION, "protocolEnv": PROTOCOL_ENV, "exitConfigError": EXIT_CONFIG_ERROR,
            "exitNotRetried": EXIT_NOT_RETRIED, "exitStopped": EXIT_STOPPED, "stateDirEnv": STATE_DIR_ENV,
            "jobDir": JOB_DIR, "attempts": ATTEMPTS, "jobIdFile": JOB_ID_FILE}


def shell_constants() -> str:
    """files/generated/podstate.sh: what the bash pod scripts need of this module, as shell variables."""
    values = {"PODSTATE_VERSION": VERSION, "NOTHING_TO_SAVE_STATES": " ".join(NOTHING_TO_SAVE_STATES),
              "STATE_TRAINING": "training", "EXIT_CONFIG_ERROR": EXIT_CONFIG_ERROR,
              "EXIT_NOT_RETRIED": EXIT_NOT_RETRIED, "EXIT_STOPPED": EXIT_STOPPED,
              "HANG_TEXT_PATTERN": HANG_TEXT.format(run="%s"),
              "ATTEMPT_ENV_FILE": ATTEMPT_ENV_FILE}
    lines = [f"{name}={json.dumps(str(value))}" for name, value in values.items()]
    return "\n".join(["# shellcheck disable=SC2034 # read by the scripts that source it", *lines]) + "\n"
