"""The pods' run-time protocol: one owner for every file, word, env name, record and exit status that the ranks (the
train package in the tenant's image, or any program through train/rankstate.py) and the platform's pod programs
(this package, which the chart ships in its scripts ConfigMap) exchange. Both sides import this module; since the
image and the chart ship apart, every record carries VERSION, and a pair whose versions differ is refused before
training, naming both (check_version).

Files in the pod's state directory (STATE_DIR_ENV, in the pod's /tmp emptyDir, shared by its containers), each with
its writer -> its readers: its format. Every platform reader reads them through tenantfiles.Tree (the tenant writes
there).

- `<pid>` (RANK_FILE): every rank (rankstate) -> the watchdog, the rank stopper (ranks.py), the sidecar, the rank
  tagger: `<state> rank=R [step=N] [step_s=S] v=V` (rank_line); its mtime is the heartbeat.
- `<pid>.diag` (DIAG_REQUEST): a FIFO the rank's diagnostics thread reads -> the watchdog writes a request
  (DIAG_STACKS, DIAG_FLIGHT_RECORDER): the thread answers with `<pid>.stacks` (every thread's stack,
  faulthandler's format, appended) and `<pid>.fr.json` (torch's flight recorder). DUMP_SIGNAL (faulthandler, from a
  signal handler) is the fallback for a rank whose thread cannot answer.
- `progress.json` (PROGRESS): rank 0 -> the sidecar: state, step, steps, loss, ..., goodput (GOODPUT_BUCKETS,
  GOODPUT_TOTALS), the attempt counter (COUNTER_KEYS), `time`, `v`.
- `verdict.json` (VERDICT): the ledger's owner (ledger.py) -> the sidecar: `v`, state (LEDGER_STATES), cause,
  reason, culprit, the attempt counter, history, causes, `time`.
- `hang-<run>.txt`, `hang-<run>.json` (HANG_TEXT, HANG_JSON): the watchdog -> the pod's log; this host's evidence
  (evidence.py), which reaches the ledger's owner (a HangReport, hang_report).
- `end-<rank>.json` (END_RECORD): a rank that ends on an error it can name, or the rank tagger for one that died of
  an uncaught exception -> this host's evidence: an EndRecord (end_record).
- `stopping.json` (STOP_NOTICE): an ssh worker's agent, on SIGTERM -> the channel's spoke on that worker, which
  tells the ledger's owner before the ranks stop.
- `job.id` (JOB_ID_FILE): the sidecar -> the ledger and goodput: the release's install.
- `job-peer-step.json` (JOB_PEER_STEP): the ledger owner's sidecar -> the peer copy's plan: `{"step": N}`, the
  newest step the peer copy had copied, as the progress ConfigMap showed it (`peerStep`; the ConfigMap outlives
  every pod): a job whose volumes held checkpoints never starts from step 0 because they were lost.

Every line a rank writes starts with rank_tag(rank, attempt), which tag_of() finds again at a line's start.
Exit statuses: EXIT_CONFIG_ERROR (a configuration error, never retried), EXIT_NOT_RETRIED (the ledger stopped the
job), EXIT_STOPPED (stopped by SIGTERM: a preemption).
"""

import re
import signal

from podruntime.text import clean

VERSION = 2  # bump it when a reader of one version would misread the files or messages of another

# ---- a rank's state (the first word of its <pid> file)
STATES = ("starting", "restoring", "training", "saving", "stopping")
CHECKPOINT_STATES = ("restoring", "saving")  # judged by the checkpoint budget, not the step budget
NOTHING_TO_SAVE_STATES = ("starting", "restoring")  # no step since the rank started: a stop kills them at once
STEP_MULTIPLE = 10  # a rank's step budget is at least this many of its own recent step times
DUMP_SIGNAL = signal.SIGUSR1  # faulthandler writes every thread's stack to <pid>.stacks (the fallback)

# ---- the job's state (the ledger's verdict), and what the sidecar shows before it says anything
LEDGER_STATES = ("starting", "failed", "stopping", "stopped", "done")
JOB_STATES = ("pending", *STATES, *(s for s in LEDGER_STATES if s not in STATES))

# ---- goodput: where the job's wall time went (train/goodput.py), published by rank 0 under these keys
GOODPUT_BUCKETS = ("productive", "startup", "restore", "save", "recomputation", "hung")
GOODPUT_TOTALS = ("wall", "unaccounted")
# A fault's loss by its parts (train/goodput.py fault_parts): from the failed attempt's last progress to the end of
# the next attempt's first step, and the steps that attempt trains again; published for the newest fault.
FAULT_PARTS = ("detect", "stop", "reschedule", "start", "rendezvous", "load", "first_step", "recompute")

# ---- files in the state directory
STATE_DIR_ENV = "DS_RANK_STATE_DIR"
RANK_FILE = re.compile(r"[0-9]{1,10}")  # a rank's <pid>
STACKS_SUFFIX = ".stacks"
DIAG_REQUEST_SUFFIX = ".diag"
FR_DUMP_SUFFIX = ".fr.json"
RANK_SUFFIXES = (STACKS_SUFFIX, DIAG_REQUEST_SUFFIX, FR_DUMP_SUFFIX)
DIAG_STACKS, DIAG_FLIGHT_RECORDER = b"s", b"f"  # the requests, one byte each
PROGRESS = "progress.json"
VERDICT = "verdict.json"
HANG_TEXT = "hang-{run}.txt"
HANG_JSON = "hang-{run}.json"
END_RECORD = "end-{rank}.json"
END_RECORD_NAME = re.compile(r"end-[0-9]{1,10}\.json")
STOP_NOTICE = "stopping.json"
JOB_ID_FILE = "job.id"
JOB_PEER_STEP = "job-peer-step.json"

# ---- the chart's bookkeeping in the release's checkpoint directory (DS_CHECKPOINT_DIR): one folder beside the
# program's checkpoints, each subtree with one writer: the ledger's owner (ATTEMPTS: attempts/<job>/NNNN), the
# watchdogs (DIAGNOSTICS: diagnostics/<run>/<host>.txt), rank 0 (GOODPUT: goodput/<job>/*.json). Pruned: the last
# KEEP_RUNS runs' diagnostics, the last KEEP_JOBS jobs' ledgers and goodput records.
JOB_DIR = "_job"
ATTEMPTS, DIAGNOSTICS, GOODPUT = "attempts", "diagnostics", "goodput"
# On per-worker volumes (peercopy.py): PEER/<node>/ the copy of another worker's part that this volume keeps (one
# writer: this pod's keeper), ASIDE/ the tags newer than the one the workers agreed to resume from, RESTORED where
# the last restore came from (the bucket's restore container writes it).
PEER, ASIDE, RESTORED = "peer", "aside", "restored.json"
RESUMED_FROM = ("own volumes", "peer copy", "bucket")  # where an attempt's checkpoint came from (the verdict's history)
PEER_STATUS = "peer-copy.json"  # in the pod's state directory: the peer copy's status, which the sidecar publishes
KEEP_RUNS = 10
KEEP_JOBS = 3

# ---- the attempt, for every rank (the ledger gives them; published in progress.json and verdict.json under the
# left-hand names)
ATTEMPT_ENV = {"run": "DS_RUN_ID", "attempt": "DS_ATTEMPT", "failures": "DS_FAILURES",
               "failure_budget": "DS_FAILURE_BUDGET", "preemptions": "DS_PREEMPTIONS", "begun": "DS_ATTEMPT_BEGUN",
               # the attempt before this one ("" for the first), when a watchdog first reported it hung, when its
               # first rank's own word of its end was written, and when it ended ("" where not known): where a
               # rank's goodput learns these times on any storage (a report may be on another pod's volume), to
               # count the time hung and split a fault's loss by its parts
               "previous_run": "DS_PREVIOUS_RUN_ID", "previous_hung_at": "DS_PREVIOUS_RUN_HUNG_AT",
               "previous_failed_at": "DS_PREVIOUS_RUN_FAILED_AT", "previous_ended": "DS_PREVIOUS_RUN_ENDED"}
COUNTER_KEYS = ("attempt", "failures", "failure_budget", "preemptions", "run")  # published with every record
PROTOCOL_ENV = "DS_PROTOCOL_VERSION"

# ---- exit statuses
EXIT_CONFIG_ERROR = 2
EXIT_NOT_RETRIED = 3
EXIT_STOPPED = 143

# ---- bounds of what a reader takes in
MAX_LINE_BYTES = 1024  # a rank's state line
HISTORY = 10  # attempts the verdict's history keeps
RANK_CAUSES = ("program-error", "collective-timeout", "config-error", "loss-nan", "storage-error")  # end records


def number(value) -> float | None:
    """A finite number from the other side, or None (a program's own writer may put anything there)."""
    if isinstance(value, bool):
        return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if result == result and abs(result) != float("inf") else None


def count(value, top: int = 10**15) -> int | None:
    """A whole number in [0, top) from the other side, or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < top else None


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
    NCCL's watchdog, torch's DistBackendError, a store's DistStoreError timeout), or any other program error."""
    text = f"{type_name} {message}"
    if re.search(r"(?i)timed? ?out|timeout", text) and re.search(
            r"(?i)gloo|nccl|collective|watchdog|Dist(Backend|Store|Network)?Error|ProcessGroup|c10d", text):
        return "collective-timeout"
    return "program-error"


# ---- a rank's state line and its log tag

def rank_line(text: str) -> tuple[str, dict[str, str]]:
    """A rank's state line (RANK_FILE): its state word ("" when it is none of STATES) and its key=value fields."""
    words = text.split()
    return (words[0] if words and words[0] in STATES else ""), dict(w.split("=", 1) for w in words[1:] if "=" in w)


# A tag counts only at a line's start, or after pdsh's `host: ` (the ssh launcher's log): never inside a line.
_TAG = re.compile(r"(?:[A-Za-z0-9_.-]{1,253}: )?\[rank (\d{1,7})(?: attempt (\d{1,9}))?\] ")


def rank_tag(rank: str, attempt: str) -> str:
    """What the rank tagger puts before every line a rank writes: `[rank 3 attempt 2] ` (`[rank 3] ` outside the
    chart's attempts)."""
    return f"[rank {rank}{f' attempt {attempt}' if attempt.isdigit() else ''}] "


def tag_of(line: str) -> tuple[int, int | None] | None:
    """(rank, attempt or None) of a line the tagger wrote, or None."""
    found = _TAG.match(line)
    return (int(found[1]), int(found[2]) if found[2] else None) if found else None


# ---- attempts

def run_id(attempt: int, job: str) -> str:
    """The attempt's name, unique across the Jobs of a release: `run-0003-1a2b3c4d`."""
    return f"run-{attempt:04d}-{re.sub(r'[^A-Za-z0-9]', '', job)[:8] or 'local'}"


def parse_run_id(run: str) -> tuple[int, str] | None:
    """(attempt, job) of a run ID, or None."""
    match = re.fullmatch(r"run-(\d{4,9})-([A-Za-z0-9]{1,8})", run or "")
    return (int(match[1]), match[2]) if match else None


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


# ---- records: each typed and bounded on the way in (what a tenant's container wrote is untrusted)

def end_record(run: str, rank: int, host: str, cause: str, line: str, step: int | None, time_: float,
               echo: bool = False) -> dict:
    """What a rank says of its own end (END_RECORD): an EndRecord. `echo`: it ends because another rank failed (its
    line says so; the other rank's says why)."""
    return {"v": VERSION, "run": clean(run, 64), "rank": int(rank), "host": clean(host, 253),
            "cause": cause if cause in RANK_CAUSES else "program-error", "line": clean(line, 1000),
            "step": count(step), "time": time_, "echo": echo is True}


def valid_end_record(record) -> dict | None:
    """`record` typed and bounded, or None."""
    if not isinstance(record, dict) or record.get("v") != VERSION or record.get("cause") not in RANK_CAUSES:
        return None
    rank, moment = count(record.get("rank"), 10**7), number(record.get("time"))
    if rank is None or moment is None:
        return None
    return end_record(str(record.get("run", "")), rank, str(record.get("host", "")), record["cause"],
                      str(record.get("line", "")), record.get("step"), moment, record.get("echo") is True)


# How a rank of a hung attempt was found. The first three are evidence against the rank itself (it cannot run,
# did not answer, or is stuck outside any collective); the last says it waits for a peer.
KINDS = ("stopped", "unresponsive", "outside-collective", "in-collective")


def hang_rank(rank: int | str, host: str, kind: str, last_beat: float, step: int | None, state: str,
              where: str) -> dict:
    return {"rank": int(rank) if str(rank).isdigit() else -1, "host": clean(host, 253), "kind": kind,
            "last_beat": last_beat, "step": count(step), "state": clean(state, 32), "where": clean(where)}


def hang_report(host: str, run: str, time_: float, ranks: list[dict]) -> dict:
    """What one host's watchdog found: a HangReport (JSON: v, host, run, time, ranks)."""
    return {"v": VERSION, "host": clean(host, 253), "run": clean(run, 64), "time": time_, "ranks": ranks}


def valid_hang_report(report) -> dict | None:
    """`report` typed and bounded, or None."""
    if not isinstance(report, dict) or report.get("v") != VERSION or not isinstance(report.get("ranks"), list):
        return None
    ranks = [hang_rank(rank.get("rank", -1), str(rank.get("host", "")), rank["kind"], number(rank["last_beat"]),
                       rank.get("step"), str(rank.get("state", "")), str(rank.get("where", "")))
             for rank in report["ranks"][:64]
             if isinstance(rank, dict) and rank.get("kind") in KINDS and number(rank.get("last_beat")) is not None]
    if not ranks:
        return None
    return hang_report(str(report.get("host", "")), str(report.get("run", "")), number(report.get("time")) or 0.0,
                       ranks)


def host_evidence(host: str, run: str, status: int | None, hang: dict | None, ends: list[dict],
                  step: int | None, oom_kills: int | None = None, stopped: bool = False, lost: bool = False,
                  returned: float | None = None) -> dict:
    """What one host knows of how an attempt ended (evidence.py): its DeepSpeed launcher's exit status (nossh; ssh
    has pdsh's), its watchdog's HangReport, its ranks' EndRecords, the last step rank 0 published there (if rank 0 is
    there), the OOM kills its memory cgroup has counted (since the container started) and whether its pod was
    stopped by SIGTERM during the attempt. `lost`: the ledger's owner's word of a host that left during the attempt
    without a SIGTERM (its channel dropped: a lost node, a pod killed outright). `returned`: when its DeepSpeed
    launcher exited (nossh: each host runs its own; ssh gathers the evidence after the run, and gives none)."""
    return {"v": VERSION, "kind": "evidence", "host": clean(host, 253), "run": clean(run, 64),
            "status": status, "hang": hang, "ends": ends, "step": count(step), "oom_kills": oom_kills,
            "stopped": stopped is True, "lost": lost is True, "returned": number(returned)}


def valid_host_evidence(evidence) -> dict | None:
    """`evidence` typed and bounded (a host sent it), or None."""
    if not isinstance(evidence, dict) or evidence.get("v") != VERSION or evidence.get("kind") != "evidence":
        return None
    ends = evidence.get("ends") if isinstance(evidence.get("ends"), list) else []
    return host_evidence(str(evidence.get("host", "")), str(evidence.get("run", "")),
                         count(evidence.get("status"), 256),
                         valid_hang_report(evidence.get("hang")) if evidence.get("hang") else None,
                         [e for e in (valid_end_record(r) for r in ends[:64]) if e], evidence.get("step"),
                         count(evidence.get("oom_kills"), 10**9), evidence.get("stopped") is True,
                         evidence.get("lost") is True, number(evidence.get("returned")))


def chart_constants() -> dict:
    """files/generated/protocol.json: what the chart's templates need of this module (the Job's failure policy, the
    version the chart's pod programs speak, the paths the probes and the ledger use)."""
    return {"version": VERSION, "protocolEnv": PROTOCOL_ENV, "exitConfigError": EXIT_CONFIG_ERROR,
            "exitNotRetried": EXIT_NOT_RETRIED, "exitStopped": EXIT_STOPPED, "stateDirEnv": STATE_DIR_ENV,
            "jobDir": JOB_DIR, "attempts": ATTEMPTS, "jobIdFile": JOB_ID_FILE}
