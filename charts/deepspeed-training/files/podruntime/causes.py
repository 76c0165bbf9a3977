"""Why an attempt ended: the list of causes, and the policy that picks one, as data. Every attempt ends with one
cause from CAUSES, decided from the evidence of every host (ATTEMPT_RULES, in the ledger's owner) and refined by
what only the API server saw (CLUSTER_RULES, in `make why`, read with the person's own access: the pods' tokens stay
narrow). Each rule is one row: the cause it gives, the evidence it reads, when it applies; the first row that applies
decides. Adding a cause is a row in CAUSES, a row in one of the rule tables, and its tests.
"""

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from podruntime.protocol import EXIT_CONFIG_ERROR, exit_signal
from podruntime.text import clean

# cause: (who decides, from what evidence, whether it spends the failure budget)
CAUSES = {
    "completed": ("the ledger's owner", "the program exited 0", "no"),
    "preempted": ("the ledger's owner, told by the pod that got SIGTERM (through the attempt loop's channel, or its "
                  "evidence)", "a SIGTERM during the attempt: an eviction, a spot reclaim, an upgrade, a pod deleted",
                  "never"),
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
    "preemption-budget-spent": ("the ledger", "more preemptions than job.preemptionRetries: stops that keep coming, "
                                "or a program that writes the preemption mark itself", "stops the job"),
    "oom-killed": ("the ledger's owner (a host's memory cgroup counted an OOM kill), make why (a container "
                   "OOMKilled)", "the memory limit", "yes"),
    "evicted": ("make why (DisruptionTarget, an Evicted pod)", "the eviction API or node pressure", "never"),
    "pod-deleted": ("make why (a deleted pod)", "someone or something deleted a pod", "never"),
    "node-lost": ("the ledger (an owner's pod that recorded nothing; a host whose channel to the owner dropped "
                  "mid-attempt without a SIGTERM), make why (a node NotReady, DisruptionTarget)",
                  "the node went away, or a pod was killed outright", "yes"),
    "device-unhealthy": ("make why (a container's allocatedResourcesStatus, Kubernetes 1.36)", "a device given to a "
                         "pod (a GPU) that its device plugin or DRA driver reports Unhealthy: the crash, hang or "
                         "timeout the pods saw was the hardware's", "yes"),
}
# The same error of these causes at the same step in two failed attempts in a row stops the job (deterministic).
REPEATABLE_CAUSES = ("program-error", "loss-nan", "storage-error", "collective-timeout", "oom-killed")
NOT_RETRIED_CAUSES = ("config-error", "storage-error")  # a rank's word that ends the job at once
STOPPED = "stopped by SIGTERM (a preemption: not counted against the failure budget)"


# ---- the culprit of a hang: each host's watchdog reports its ranks; the job's verdict merges every report

# How strongly a rank's state speaks against it, strongest first: it cannot run, did not answer, is stuck outside
# any collective; a rank that waits in a collective waits for a peer (a victim).
CULPRIT_ORDER = ("stopped", "unresponsive", "outside-collective", "in-collective")
CULPRIT_WORDS = {"stopped": "its process is stopped", "unresponsive": "it did not answer for its stack",
                 "outside-collective": "it is stuck outside any collective",
                 "in-collective": "it waits in a collective"}


def merge_hang_reports(reports: list[dict]) -> dict | None:
    """The job's verdict on a hung attempt from every host's report: the culprit is the rank whose state speaks
    most against it (CULPRIT_ORDER), and among those the one whose last beat is oldest; the ranks waiting in
    collectives are its victims; when every rank reported waits, the culprit is None (on a host that did not report:
    never a waiting rank). None without reports. {"culprit": rank or None, "victims": [ranks], "reason": one line}."""
    ranks = sorted((rank for report in reports for rank in report["ranks"]),
                   key=lambda r: (CULPRIT_ORDER.index(r["kind"]), r["last_beat"], r["rank"]))
    if not ranks:
        return None
    if ranks[0]["kind"] == "in-collective":  # every rank reported waits: what they wait for is on a silent host
        shown = ", ".join(f"rank {r['rank']} on {r['host']}" for r in ranks[:3])
        more = f" and {len(ranks) - 3} more" if len(ranks) > 3 else ""
        return {"culprit": None, "victims": ranks, "reason": clean(
            f"hang: every rank that reported waits in a collective ({shown}{more}): the culprit is on another host, "
            "whose watchdog did not report", 1000)}
    culprit, victims = ranks[0], [r for r in ranks[1:] if r["kind"] == "in-collective"]
    step = f", after step {culprit['step']}" if culprit["step"] is not None else ""
    where = "" if culprit["kind"] == "stopped" else f": {culprit['where']}"
    reason = (f"hang: rank {culprit['rank']} on {culprit['host']} is the likely culprit "
              f"({CULPRIT_WORDS[culprit['kind']]}{where}{step})")
    if victims:
        shown = ", ".join(f"rank {v['rank']} on {v['host']}" for v in victims[:3])
        more = f" and {len(victims) - 3} more" if len(victims) > 3 else ""
        many = len(victims) != 1
        reason += (f"; {len(victims)} rank{'s' if many else ''} wait{'' if many else 's'} for it in collectives "
                   f"({shown}{more})")
    return {"culprit": culprit, "victims": victims, "reason": clean(reason, 1000)}


# ---- the pods' policy: what every host's evidence says of one attempt's end

@dataclass
class Facts:
    """What the ledger's owner knows of an ended attempt, from its exit status and every host's evidence."""
    attempt: int
    status: int
    stopped: bool  # a pod got SIGTERM during the attempt (its notice, a stopped-* mark, its evidence)
    oom: list[tuple[str, int]]  # hosts whose memory cgroup counted OOM kills during it: (host, kills)
    hang: dict | None  # the merged hang reports (merge_hang_reports)
    hang_time: float | None  # the first watchdog's report
    word: dict | None  # the first rank's own word of its end (an end record), by rule below
    killed: list[tuple[str, int]]  # (host, signal) of launchers whose rank a signal killed (not SIGTERM)
    step: int | None = None
    lost: list[str] = field(default_factory=list)  # hosts that left during the attempt without a SIGTERM
    failed_time: float | None = None  # the first sign of the end: a rank's end record, a host's launcher exiting
    extra: dict = field(default_factory=dict)


def facts(attempt: int, status: int, evidence: list[dict], stopped: bool, oom: list[tuple[str, int]]) -> Facts:
    """Facts from every host's evidence (protocol.host_evidence, already typed)."""
    ends = sorted((r for e in evidence for r in e["ends"]), key=lambda r: r["time"])
    hangs = [e["hang"] for e in evidence if e["hang"]]
    steps = [s for s in (*(e["step"] for e in evidence), *(r["step"] for r in ends),
                         *(r["step"] for h in hangs for r in h["ranks"])) if s is not None]
    killed = [(e["host"], sig) for e in evidence if e["status"] is not None
              and (sig := exit_signal(e["status"])) not in (None, signal.SIGTERM)]
    if not killed and exit_signal(status) not in (None, signal.SIGTERM):
        killed = [("", exit_signal(status))]
    merged = merge_hang_reports(hangs)
    ends = [r for r in ends if not r["echo"]] or ends  # a rank that failed because another did says less
    said = [r for r in ends if r["cause"] in ("config-error", "storage-error", "loss-nan")]
    word = (said or ([] if killed and not merged else ends))[:1]
    first = min((*(r["time"] for r in ends), *(e["returned"] for e in evidence if e.get("returned"))), default=None)
    return Facts(attempt, status, stopped or any(e.get("stopped") for e in evidence), oom, merged,
                 min((h["time"] for h in hangs), default=None), word[0] if word else None, killed,
                 max(steps, default=None), [e["host"] for e in evidence if e.get("lost")], failed_time=first)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _completed(f: Facts) -> dict:
    return {"cause": "completed", "reason": "completed"}


def _preempted(f: Facts) -> dict:
    return {"cause": "preempted", "reason": STOPPED}


def _oom(f: Facts) -> dict:
    hosts = ", ".join(f"{host} ({kills} kill{'s' if kills != 1 else ''})" for host, kills in f.oom[:3])
    return {"cause": "oom-killed", "error": "the kernel's OOM killer ended a process",
            "reason": f"attempt {f.attempt} ended: oom-killed: the kernel's OOM killer ended a process in the "
                      f"container of {hosts}: raise worker.resources.limits.memory, or lower the memory a rank needs"}


def _hang_first(f: Facts) -> bool:
    return f.hang is not None and not (f.word and f.hang_time is not None and f.word["time"] < f.hang_time)


def _hang(f: Facts) -> dict:
    culprit = f.hang["culprit"]
    return {"cause": "hang", "reason": f"attempt {f.attempt} ended: {f.hang['reason']}",
            **({"culprit": f"rank {culprit['rank']} on {culprit['host']}"} if culprit else {})}


def _lost(f: Facts) -> dict:
    hosts = ", ".join(f.lost[:3]) + (f" (+{len(f.lost) - 3} more)" if len(f.lost) > 3 else "")
    return {"cause": "node-lost", "reason": f"attempt {f.attempt} ended: node-lost: {hosts} left during the attempt "
                                            "without a SIGTERM or a word (its connection to the ledger's owner "
                                            "dropped): a lost node, or its pod killed outright (a force delete: "
                                            "`make why` reads which from the cluster)"}


def _rank_word(f: Facts) -> dict:
    record = f.word
    at = f" at step {record['step']}" if record["step"] is not None else ""
    culprit = f.hang["culprit"] if f.hang and f.hang["culprit"] else record
    return {"cause": record["cause"], "error": record["line"],
            "culprit": f"rank {culprit['rank']} on {culprit['host']}",
            "reason": f"attempt {f.attempt} ended: {record['cause']}: rank {record['rank']} on {record['host']}{at}: "
                      f"{record['line']}" + (f"; {f.hang['reason']}" if f.hang else "")
                      + ("; not retried" if record["cause"] in NOT_RETRIED_CAUSES else "")}


def _killed(f: Facts) -> dict:
    host, sig = f.killed[0]
    where = f" on {host}" if host else ""
    return {"cause": "program-error", "error": f"killed by {signal_name(sig)}",
            "reason": f"attempt {f.attempt} ended: program-error: a rank{where} was killed by {signal_name(sig)}"
                      + (" (kill -9, or the kernel's OOM killer: `make why` reads which from the pod)"
                         if sig == signal.SIGKILL else "")}


def _config_error(f: Facts) -> dict:
    return {"cause": "config-error", "reason": f"attempt {f.attempt} ended with status {f.status}, a configuration "
                                               "error (its line is in the ranks' log): not retried"}


def _exit_status(f: Facts) -> dict:
    return {"cause": "program-error", "reason": f"attempt {f.attempt} ended: program-error: exit status {f.status} "
                                                "(no rank said why: the ranks' log has it)"}


@dataclass(frozen=True)
class Rule:
    cause: str  # what it gives ("a rank's" when the evidence names it)
    evidence: str
    applies: Callable[[Facts], bool]
    gives: Callable[[Facts], dict]


# The order is the policy: the first rule that applies decides.
ATTEMPT_RULES = (
    Rule("completed", "the run's exit status is 0", lambda f: f.status == 0, _completed),
    Rule("preempted", "a pod got SIGTERM during the attempt", lambda f: f.stopped, _preempted),
    Rule("oom-killed", "a host's memory cgroup counted an OOM kill during the attempt", lambda f: bool(f.oom), _oom),
    Rule("hang", "a watchdog's hang report, earlier than any rank's word", _hang_first, _hang),
    Rule("node-lost", "a host left during the attempt without a SIGTERM: its channel to the ledger's owner dropped "
         "(its peers' errors are echoes of it)", lambda f: bool(f.lost), _lost),
    Rule("a rank's", "a rank's end record: its exception, a refused configuration, a failed checkpoint write, a "
         "non-finite loss (one that failed because another did says less)", lambda f: f.word is not None, _rank_word),
    Rule("program-error", "a rank killed by a signal, which says nothing", lambda f: bool(f.killed), _killed),
    Rule("config-error", f"exit status {EXIT_CONFIG_ERROR}", lambda f: f.status == EXIT_CONFIG_ERROR, _config_error),
    Rule("program-error", "any other exit status", lambda f: True, _exit_status),
)


def decide(f: Facts) -> dict:
    """{status, step, cause, reason[, error, culprit]} of the attempt: the first rule of ATTEMPT_RULES that
    applies."""
    rule = next(rule for rule in ATTEMPT_RULES if rule.applies(f))
    return {"status": f.status, "step": f.step, **rule.gives(f)}


# ---- make why's refinement: what the API server saw that the pods could not

@dataclass(frozen=True)
class ClusterRule:
    cause: str
    evidence: str  # what in the API objects
    matches: Callable[[dict], bool]  # an observation: {kind, reason, message, container?, main?}


_DISRUPTIONS = {"EvictionByEvictionAPI": "evicted", "TerminationByKubelet": "evicted",
                "PreemptionByScheduler": "preempted", "DeletionByTaintManager": "node-lost",
                "DeletionByPodGC": "node-lost"}

# Strongest first: one attempt's end may leave several observations; the strongest near it refines its cause.
CLUSTER_RULES = (
    ClusterRule("oom-killed", "a container terminated OOMKilled; an OOMKilling event",
                lambda o: o["reason"] in ("OOMKilled", "OOMKilling")),
    ClusterRule("device-unhealthy", "a device in a container's allocatedResourcesStatus with health Unhealthy",
                lambda o: o["kind"] == "device" and o["reason"] == "Unhealthy"),
    ClusterRule("node-lost", "DisruptionTarget DeletionByTaintManager/DeletionByPodGC; a NodeNotReady or "
                "TaintManagerEviction event",
                lambda o: (o["kind"] == "disruption" and _DISRUPTIONS.get(o["reason"]) == "node-lost")
                or o["reason"] in ("NodeNotReady", "TaintManagerEviction")),
    ClusterRule("evicted", "DisruptionTarget EvictionByEvictionAPI/TerminationByKubelet; an Evicted pod or event",
                lambda o: (o["kind"] == "disruption" and _DISRUPTIONS.get(o["reason"]) == "evicted")
                or o["reason"] == "Evicted"),
    ClusterRule("preempted", "DisruptionTarget PreemptionByScheduler; a Preempted event",
                lambda o: (o["kind"] == "disruption" and _DISRUPTIONS.get(o["reason"]) == "preempted")
                or o["reason"] == "Preempted"),
    ClusterRule("pod-deleted", "a pod being deleted (without a DisruptionTarget); a Killing event of a pod's main "
                "container; any other DisruptionTarget",
                lambda o: o["kind"] in ("deletion", "disruption") or (
                    o["reason"] == "Killing" and bool(re.fullmatch(r"Stopping container (\S+)", o["message"] or ""))
                    and o.get("main", False))),
)
REFINABLE = ("program-error", "node-lost", "preempted", "collective-timeout")  # the pods' causes it may refine
DEVICE_REFINABLE = (*REFINABLE, "hang")  # a device gone bad also explains a hang (nothing else near one does)
BEFORE_S, AFTER_S = 900, 120  # an observation this long before an attempt's recorded end, or after it, is its


def cluster_cause(observation: dict) -> str | None:
    """The cause an API observation shows (the first CLUSTER_RULES row that matches), or None."""
    return next((rule.cause for rule in CLUSTER_RULES if rule.matches(observation)), None)


def refines(cluster: str, seen: str) -> bool:
    """Whether the cluster's cause `cluster` may replace the pods' `seen` (REFINABLE; DEVICE_REFINABLE for a
    device)."""
    return seen in (DEVICE_REFINABLE if cluster == "device-unhealthy" else REFINABLE)


def strength(cause: str) -> int:
    return [rule.cause for rule in CLUSTER_RULES].index(cause)
