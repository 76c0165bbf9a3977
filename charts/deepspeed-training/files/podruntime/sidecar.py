"""The progress sidecar of every pod of the release (both launch modes): where a run stands, for `kubectl get` and for
Prometheus, and the scale-down after success. It runs no tenant code (the platform's image, progress.image), and it
is the only container that holds a token: the release's own ServiceAccount's, whose Roles can get and patch one
ConfigMap, <release>-progress, and scale the release's worker StatefulSet (ssh mode), nothing else.

It reads what its own pod knows, in the state directory (protocol.py: its table of files), through tenantfiles.Tree
(no link followed, regular files only, bounded reads): the tenant's containers write there, so everything in it is
untrusted data, typed, bounded and cleaned before it is published.

One writer per key of the ConfigMap, each at most every PATCH_EVERY_S and only on a change, so that the API load
does not grow with the workers:
- node rank 0's sidecar (`--progress`, the pod of rank 0) writes rank 0's progress (PROGRESS_KEYS);
- the ledger's owner's sidecar (`--job`: ssh the launcher pod, nossh worker 0) writes the job's state, the reason
  the last attempt ended (a hang's culprit, merged from every host's report by the ledger), the attempt counter
  and the one-line `summary` (JOB_KEYS), reading rank 0's keys back from the ConfigMap where another pod writes
  them;
- every other sidecar writes nothing (its pod's hang report reaches the ledger's owner with the attempt's end).
With --metrics-port each serves its own pod's part as Prometheus metrics (prometheus_client): every rank's step,
step time and heartbeat age (at most --ranks-per-pod ranks, each below --world-size), rank 0's progress, the
job's state and counter; label values come only from fixed sets, and no `release` label (a PodMonitor adds it
from the pod's own labels). Without API access (no token, no cluster) or without prometheus_client in the image, it
says so once and does the rest.

With --scale-down NAME (the launcher pod of launchMode ssh, launcher.scaleDownWorkers), once the ledger's verdict
says the job is done it scales the StatefulSet NAME to 0, so that finished workers free their GPUs: within a second
of the verdict, or at the latest on the SIGTERM the kubelet sends this native sidecar when the launcher has exited.

Usage: python3 -I <scripts> sidecar [--configmap NAME] [--progress] [--job] [--metrics-port PORT]
       [--scale-down STATEFULSET] [--world-size N] [--ranks-per-pod N]   (runs until SIGTERM, then publishes once more)
"""

import argparse
import json
import os
import signal
import threading
import time
from datetime import UTC, datetime

from podruntime import causes, host, protocol
from podruntime.tenantfiles import Tree
from podruntime.text import Log, clean, duration

POLL_S = 1.0
PATCH_EVERY_S = 2.0  # each writer patches at most this often (a change of the job's state: at once)
API_TIMEOUT = (3, 10)  # connect, read: a stuck API call must not hold the loop, nor the exit after SIGTERM
FINAL_TRIES = 20  # after SIGTERM, 0.5 s apart: a slow API must not lose the last word
METRIC = "deepspeed_training"
PROGRESS_KEYS = ("progressState", "step", "steps", "percent", "loss", "lr", "tokensPerSecond", "mfu", "eta",
                 "checkpointStep", "bucketStep", "uploadLagSteps", "peerStep", "peerLagSteps", "goodput",
                 "lastFault", "progressTime")
JOB_KEYS = ("state", "cause", "reason", "culprit", "history", "attempts", "attempt", "failuresUsed", "failureBudget",
            "preemptions", "run", "updated", "summary")
NUMBERS = {"step": ("step", "{:.0f}"), "steps": ("steps", "{:.0f}"), "loss": ("loss", "{:.4f}"), "lr": ("lr", "{:.3e}"),
           "tokens_per_s": ("tokensPerSecond", "{:.0f}"), "mfu": ("mfu", "{:.1%}"),
           "checkpoint_step": ("checkpointStep", "{:.0f}")}
COUNTERS = {"attempt": "attempt", "failures": "failuresUsed", "failure_budget": "failureBudget",
            "preemptions": "preemptions"}


log = Log(f"sidecar: {host.hostname()}")


def progress_fields(progress: dict) -> dict[str, str]:
    """The ConfigMap's keys for rank 0's progress (PROGRESS_KEYS; absent ones left out)."""
    out = {}
    if progress.get("state") in protocol.JOB_STATES:
        out["progressState"] = progress["state"]
    for key, (name, form) in NUMBERS.items():
        if (value := protocol.number(progress.get(key))) is not None and abs(value) < 1e15:
            out[name] = form.format(value)
    if progress.get("loss") in ("nan", "inf", "-inf"):  # rankstate publishes a non-finite loss as its name
        out["loss"] = progress["loss"]
    if (eta := protocol.number(progress.get("eta_s"))) is not None and 0 <= eta < 1e9:
        out["eta"] = duration(eta, "clock")
    step, steps = protocol.number(progress.get("step")), protocol.number(progress.get("steps"))
    if step is not None and steps and 0 <= step <= 1e15:
        out["percent"] = f"{100 * step / steps:.1f}"
    if isinstance(progress.get("goodput_line"), str):  # train/goodput.py's split of the job's wall time
        out["goodput"] = clean(progress["goodput_line"])
    if isinstance(progress.get("fault_line"), str):  # the newest fault's loss by its parts (train/goodput.py)
        out["lastFault"] = clean(progress["fault_line"])
    if (written := protocol.number(progress.get("time"))) is not None:
        out["progressTime"] = f"{written:.3f}"
    return out


def upload_fields(status: dict | None) -> dict[str, str]:
    """The ConfigMap's keys for the bucket (node 0's uploader, objectstore.Uploader.status): the newest step
    committed there and how many steps the newest local checkpoint is ahead of it."""
    out = {}
    for key, name in (("committed_step", "bucketStep"), ("lag_steps", "uploadLagSteps")):
        if status and (value := protocol.number(status.get(key))) is not None and 0 <= value < 1e15:
            out[name] = f"{value:.0f}"
    return out


def peer_fields(status: dict | None) -> dict[str, str]:
    """The ConfigMap's keys for the peer copy (node 0's: peercopy.Replicator.status, written in the tenant's
    image): the newest step of this worker's part that its peer keeps, and how far its newest local one is ahead."""
    out = {}
    for key, name in (("replicated_step", "peerStep"), ("lag_steps", "peerLagSteps")):
        if status and (value := protocol.number(status.get(key))) is not None and 0 <= value < 1e15:
            out[name] = f"{value:.0f}"
    return out


def job_fields(verdict: dict, rank0: dict[str, str]) -> dict[str, str]:
    """The ConfigMap's keys for the job (JOB_KEYS but updated and summary): the ledger's verdict, its state
    refined by rank 0's while an attempt runs (rank 0's report is newer than the attempt's start)."""
    out = {"state": verdict["state"] if verdict.get("state") in protocol.LEDGER_STATES else "pending"}
    rank0_state, rank0_time = rank0.get("progressState"), protocol.number(rank0.get("progressTime"))
    started = protocol.number(verdict.get("time")) or 0.0
    if out["state"] == "starting" and rank0_state in protocol.STATES and rank0_time is not None \
            and rank0_time >= started:
        out["state"] = rank0_state
    if verdict.get("cause") in causes.CAUSES:
        out["cause"] = verdict["cause"]
    if isinstance(verdict.get("reason"), str) and verdict["reason"]:
        out["reason"] = clean(verdict["reason"], 1000)
    if (entries := history_entries(verdict.get("history"))):
        out["history"] = history_line(entries)
        out["attempts"] = json.dumps(entries, separators=(",", ":"))  # for `make why`: typed, bounded
    if isinstance(verdict.get("culprit"), str) and verdict["culprit"]:
        out["culprit"] = clean(verdict["culprit"], 300)
    for key, name in COUNTERS.items():
        if (value := protocol.number(verdict.get(key))) is not None and 0 <= value < 1e9:
            out[name] = f"{value:.0f}"
    if isinstance(verdict.get("run"), str) and protocol.parse_run_id(verdict["run"]):
        out["run"] = verdict["run"]
    return out


def history_entries(entries) -> list[dict]:
    """The ledger's last attempts (the verdict's history, written in the tenant's image), typed and bounded: each
    {attempt, cause, step?, seconds?, ended?, culprit?, resumed?}."""
    if not isinstance(entries, list):
        return []
    out = []
    for entry in entries[-protocol.HISTORY:]:
        if not isinstance(entry, dict) or entry.get("cause") not in causes.CAUSES:
            continue
        attempt = protocol.number(entry.get("attempt"))
        if attempt is None or not 0 < attempt < 1e9:
            continue
        checked = {"attempt": int(attempt), "cause": entry["cause"]}
        for key, top in (("step", 1e15), ("seconds", 1e9), ("ended", 1e11)):
            if (value := protocol.number(entry.get(key))) is not None and 0 <= value < top:
                checked[key] = int(value) if key == "step" else round(value, 1)
        if isinstance(entry.get("culprit"), str) and entry["culprit"]:
            checked["culprit"] = clean(entry["culprit"], 300)
        if entry.get("resumed") in protocol.RESUMED_FROM:
            checked["resumed"] = entry["resumed"]
        out.append(checked)
    return out


def history_line(entries: list[dict]) -> str:
    """history_entries() in one line: `1 hang at step 98 (2m03s); 2 completed at step 300 (41s)`."""
    parts = []
    for entry in entries:
        part = f"{entry['attempt']} {entry['cause']}" + (f" at step {entry['step']}" if "step" in entry else "")
        parts.append(part + (f" ({duration(entry['seconds'])})" if "seconds" in entry else ""))
    return "; ".join(parts)


def summary(data: dict[str, str]) -> str:
    """One line: `training | step 120/300 (40.0%) | loss 0.4064 | 6,100 tokens/s | eta 0:00:18 | ...`."""
    parts = [data.get("state", "pending")]
    if "step" in data:
        parts.append(f"step {data['step']}" + (f"/{data['steps']}" if "steps" in data else "")
                     + (f" ({data['percent']}%)" if "percent" in data else ""))
    if "loss" in data:
        parts.append(f"loss {data['loss']}")
    if (tokens := protocol.number(data.get("tokensPerSecond"))) is not None:
        parts.append(f"{tokens:,.0f} tokens/s")
    parts += [f"{label} {data[key]}" for key, label in (("mfu", "mfu"), ("eta", "eta"),
                                                        ("checkpointStep", "checkpoint at step")) if key in data]
    if "bucketStep" in data:
        parts.append(f"bucket at step {data['bucketStep']}" + (f" ({data['uploadLagSteps']} steps behind)" if
                                                                data.get("uploadLagSteps", "0") != "0" else ""))
    if "peerStep" in data:
        parts.append(f"peer copy at step {data['peerStep']}" + (f" ({data['peerLagSteps']} steps behind)" if
                                                                 data.get("peerLagSteps", "0") != "0" else ""))
    if data.get("goodput"):
        parts.append(data["goodput"].split(" | ")[0])  # "goodput 91.2%"
    if "attempt" in data:
        preemptions = data.get("preemptions", "?")
        parts.append(f"attempt {data['attempt']} ({data.get('failuresUsed', '?')} of {data.get('failureBudget', '?')}"
                     f" failures used, {preemptions} preemption{'' if preemptions == '1' else 's'})")
    if data.get("reason") and data.get("state") != "done":  # why the last attempt ended: moot once the job is done
        parts.append(data["reason"])
    return " | ".join(parts)


class Pod:
    """This pod's state directory, read through tenantfiles.Tree (the tenant writes there)."""

    def __init__(self, state: Tree, world_size: int, ranks_per_pod: int):
        self.dir = state
        self.world_size, self.ranks_per_pod = world_size, ranks_per_pod

    def record(self, name: str) -> dict | None:
        return self.dir.read_json(name)

    def ranks(self) -> list[dict]:
        """This pod's ranks (their state lines: `<state> rank=R step=N step_s=S`) and heartbeat ages: at most
        ranks_per_pod of them, each rank below world_size, the newest heartbeat where two files claim one rank."""
        newest: dict[int, dict] = {}
        for name in self.dir.names(pattern=protocol.RANK_FILE):
            found = self.dir.read_with_mtime(name, protocol.MAX_LINE_BYTES)
            if not found:
                continue
            state, fields = protocol.rank_line(found[0].decode("utf-8", "replace"))
            rank = fields.get("rank", "")
            if not (rank.isdigit() and int(rank) < self.world_size):
                continue
            step, step_s = protocol.number(fields.get("step")), protocol.number(fields.get("step_s"))
            entry = {"rank": str(int(rank)), "state": state,
                     "age": max(0.0, time.time() - found[1]), "mtime": found[1],
                     "step": step if step is not None and 0 <= step < 1e15 else None,
                     "step_s": step_s if step_s is not None and 0 <= step_s < 86400 else None}
            if int(rank) not in newest or newest[int(rank)]["mtime"] < entry["mtime"]:
                newest[int(rank)] = entry
        return sorted(newest.values(), key=lambda r: -r["mtime"])[:self.ranks_per_pod]


class Api:
    """The API server, through this pod's token (in a cluster) or $KUBECONFIG (elsewhere); raises when there is
    none (no token, no cluster, no client)."""

    def __init__(self, namespace: str):
        from kubernetes import client, config  # noqa: PLC0415 - only where a token is mounted

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
        self.core, self.apps, self.namespace = client.CoreV1Api(), client.AppsV1Api(), namespace
        self.requests = 0  # made by this process (bench/scale.py reads the log line at exit)


class Writer:
    """This pod's keys of the progress ConfigMap: a JSON merge patch of the keys that changed (null removes one),
    at most every PATCH_EVERY_S unless `urgent`; no read-modify-write, so writers of other keys never conflict."""

    def __init__(self, api: Api, name: str, keys: tuple[str, ...]):
        self.api, self.name, self.keys = api, name, keys
        self.written: dict[str, str] = {}
        self.next_at, self.last_error = 0.0, ""

    def write(self, fields: dict[str, str], urgent: bool = False) -> bool:
        """Patches what changed; False when the API refused (kept for the next call)."""
        changed = {k: fields.get(k) for k in self.keys if fields.get(k) != self.written.get(k)}
        if not changed or (not urgent and time.monotonic() < self.next_at):
            return True
        try:
            self.api.requests += 1
            self.api.core.patch_namespaced_config_map(self.name, self.api.namespace, {"data": changed},
                                                      _request_timeout=API_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - the API may be away for a while: keep it, try again
            if str(err) != self.last_error:
                self.last_error = str(err)
                log(f"could not patch ConfigMap {self.name} (trying again): {type(err).__name__}: "
                    f"{self.last_error.splitlines()[0] if self.last_error else ''}")
            return False
        self.written.update({k: v for k, v in changed.items() if v is not None})
        for key in [k for k, v in changed.items() if v is None]:
            self.written.pop(key, None)
        self.next_at, self.last_error = time.monotonic() + PATCH_EVERY_S, ""
        return True

    def read(self) -> dict[str, str]:
        """The ConfigMap's data now (another pod's keys), at most every PATCH_EVERY_S; {} when unreadable."""
        try:
            self.api.requests += 1
            found = self.api.core.read_namespaced_config_map(self.name, self.api.namespace,
                                                             _request_timeout=API_TIMEOUT)
            return {k: v for k, v in (found.data or {}).items() if isinstance(v, str)}
        except Exception:  # noqa: BLE001 - the summary waits for the next read
            return {}


class ScaleDown:
    """Scales the release's worker StatefulSet to 0 once the ledger's verdict says the job is done."""

    def __init__(self, api: Api, name: str, pod: Pod):
        self.api, self.name, self.pod, self.done, self.last_error = api, name, pod, False, ""

    def pending(self) -> bool:
        return not self.done and (self.pod.record(protocol.VERDICT) or {}).get("state") == "done"

    def run(self) -> None:
        if not self.pending():
            return
        try:
            self.api.requests += 1
            self.api.apps.patch_namespaced_stateful_set_scale(self.name, self.api.namespace,
                                                              {"spec": {"replicas": 0}}, _request_timeout=API_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - the API may be away for a while: try again
            if str(err) != self.last_error:
                self.last_error = str(err)
                log(f"could not scale statefulset {self.name} down (trying again): {type(err).__name__}: "
                    f"{self.last_error.splitlines()[0] if self.last_error else ''}")
            return
        self.done = True
        log(f"scaled statefulset {self.api.namespace}/{self.name} to 0 replicas: the run succeeded")


class Publisher:
    """What this pod writes: rank 0's progress (`progress`), the job's record (`job`), or nothing."""

    def __init__(self, pod: Pod, api: Api | None, name: str, progress: bool, job: bool, uploads: dict | None = None):
        self.pod, self.progress, self.job, self.uploads = pod, progress, job, uploads
        self.progress_writer = Writer(api, name, PROGRESS_KEYS) if api and progress else None
        self.job_writer = Writer(api, name, JOB_KEYS) if api and job else None
        self.rank0: dict[str, str] = {}  # rank 0's keys as the ConfigMap (or this pod) has them
        self.next_read = 0.0
        self.peer_step: int | None = None  # the step noted for the peer copy's plan

    def step(self, final: bool = False) -> bool:
        """One look and the patches it calls for; False while something is left to write."""
        done = True
        local = {**progress_fields(self.pod.record(protocol.PROGRESS) or {}), **upload_fields(self.uploads),
                 **peer_fields(self.pod.record(protocol.PEER_STATUS))} if self.progress else {}
        if self.progress_writer:
            done &= self.progress_writer.write(local, urgent=final)
        if self.job_writer:
            if self.progress:
                self.rank0 = local
            elif final or time.monotonic() >= self.next_read:  # rank 0 is another pod's: read its keys back
                self.rank0 = {k: v for k, v in self.job_writer.read().items() if k in PROGRESS_KEYS} or self.rank0
                self.next_read = time.monotonic() + PATCH_EVERY_S
            self.peer_step = note_peer_step(self.pod, self.rank0.get("peerStep"), self.peer_step)
            fields = job_fields(self.pod.record(protocol.VERDICT) or {}, self.rank0)
            fields["summary"] = summary({**self.rank0, **fields})
            written = self.job_writer.written
            if any(fields.get(k) != written.get(k) for k in JOB_KEYS if k != "updated"):
                urgent = final or fields["state"] != written.get("state")
                fields["updated"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                done &= self.job_writer.write(fields, urgent=urgent)
        return done


# Every metric a sidecar serves, the one list (docs/observability.md's table is generated from it): (name after
# METRIC_, label, what it is, which pod serves it, the record's key). The label's values come from fixed sets
# (protocol's goodput buckets and job states, ranks below --world-size); `release` comes from the pod's own labels.
METRICS = (
    ("step", "", "the last step rank 0 reported", "node rank 0", "step"),
    ("steps", "", "the steps the run trains for", "node rank 0", "steps"),
    ("loss", "", "rank 0's last logged loss (the mean over ranks)", "node rank 0", "loss"),
    ("learning_rate", "", "the last logged learning rate", "node rank 0", "lr"),
    ("tokens_per_second", "", "tokens a second over the last logged interval", "node rank 0", "tokens_per_s"),
    ("mfu_ratio", "", "model FLOPs utilisation over the last logged interval", "node rank 0", "mfu"),
    ("eta_seconds", "", "seconds left at the recent pace", "node rank 0", "eta_s"),
    ("checkpoint_step", "", "the step of the last complete checkpoint", "node rank 0", "checkpoint_step"),
    ("checkpoint_save_seconds", "", "seconds the steps waited for the last checkpoint save (a background save: "
     "while the state was copied)", "node rank 0", "checkpoint_save_s"),
    ("checkpoint_write_seconds", "", "seconds from the last committed checkpoint's save to its commit (written, "
     "durable on every rank)", "node rank 0", "checkpoint_write_s"),
    ("progress_age_seconds", "", "seconds since rank 0 last reported", "node rank 0", "time"),
    ("goodput_seconds", "bucket", "the job's wall time so far, by where it went (all attempts; bucket wall is the "
     "whole)", "node rank 0", "goodput"),
    ("fault_seconds", "part", "the newest fault's loss by its parts, from the last step before it to the end of "
     "the first step after it, and the steps trained again (part total is the sum)", "node rank 0", "fault"),
    ("attempt", "", "the job's attempt number", "the ledger's owner", "attempt"),
    ("failures", "", "failed attempts so far (the failure budget used)", "the ledger's owner", "failures"),
    ("failure_budget", "", "failed attempts the job may retry", "the ledger's owner", "failure_budget"),
    ("preemptions", "", "attempts stopped by SIGTERM (not failures)", "the ledger's owner", "preemptions"),
    ("state", "state", "the job's state (1 for the current one)", "the ledger's owner", "state"),
    ("attempts_ended", "cause", "the job's attempts that ended, by cause (causes.CAUSES)", "the ledger's owner",
     "causes"),
    ("rank_step", "rank", "the last step this rank finished", "every worker", "step"),
    ("rank_step_seconds", "rank", "this rank's recent seconds per step", "every worker", "step_s"),
    ("rank_heartbeat_age_seconds", "rank", "seconds since this rank's last report", "every worker", "age"),
    ("checkpoint_uploaded_step", "", "the newest checkpoint step this pod put in the bucket", "with objectStore",
     "uploaded_step"),
    ("checkpoint_committed_step", "", "the newest checkpoint step committed in the bucket (node 0's)",
     "with objectStore", "committed_step"),
    ("checkpoint_upload_lag_steps", "", "steps between this pod's newest complete checkpoint and the bucket's",
     "with objectStore", "lag_steps"),
    ("checkpoint_upload_seconds", "", "seconds the last upload of this pod's part took", "with objectStore",
     "seconds"),
    ("checkpoint_upload_bytes_per_second", "", "the last upload's rate", "with objectStore", "bytes_per_s"),
    ("checkpoint_upload_failures", "", "uploads that failed and are retried (the store away, a full quota)",
     "with objectStore", "failures"),
    ("checkpoint_peer_step", "", "the newest checkpoint step of this pod's part that its peer keeps (peer copy)",
     "with peerCopy", "replicated_step"),
    ("checkpoint_peer_lag_steps", "", "steps between this pod's newest complete checkpoint and its peer's copy",
     "with peerCopy", "lag_steps"),
    ("checkpoint_peer_copy_seconds", "", "seconds the last copy of this pod's part to its peer took", "with peerCopy",
     "seconds"),
    ("checkpoint_peer_copy_bytes_per_second", "", "the last peer copy's rate", "with peerCopy", "bytes_per_s"),
    ("checkpoint_peer_copy_failures", "", "copies to the peer that failed and are retried", "with peerCopy",
     "failures"),
)


LABEL_VALUES = {"goodput_seconds": (*protocol.GOODPUT_BUCKETS, *protocol.GOODPUT_TOTALS),
                "fault_seconds": (*protocol.FAULT_PARTS, "total"), "attempts_ended": causes.CAUSES}


def sample_bound() -> dict[str, int]:
    """The most samples one pod serves: `fixed` + `perRank` x its ranks (every metric once, a labelled one once per
    value of its fixed set, `state` once; a rank's per rank). The PodMonitor's sampleLimit, generated from here
    (scripts/chart_data.py: files/generated/protocol.json)."""
    per_rank = sum(1 for m in METRICS if m[3] == "every worker")
    fixed = sum(len(LABEL_VALUES.get(m[0], ("",))) for m in METRICS if m[3] != "every worker")
    return {"fixed": fixed, "perRank": per_rank}


def samples(pod: Pod, progress: bool, job: bool, uploads: dict | None = None):
    """(name, label, doc, [(label value, value)]) of every metric this pod serves now; `uploads`: the object-store
    uploader's status (objectstore.Uploader.status), when the release has one."""
    record = (pod.record(protocol.PROGRESS) or {}) if progress else {}
    verdict = (pod.record(protocol.VERDICT) or {}) if job else {}
    ranks = pod.ranks()
    statuses = {"with objectStore": uploads, "with peerCopy": pod.record(protocol.PEER_STATUS)}
    for name, label, doc, where, key in METRICS:
        if where == "node rank 0" and not progress or where == "the ledger's owner" and not job:
            continue
        if where in statuses:  # the uploader's status, or the peer copy's (read once per scrape)
            status = statuses[where] or {}
            if (value := protocol.number(status.get(key))) is not None and (where != "with peerCopy"
                                                                            or 0 <= value < 1e15):
                yield name, label, doc, [("", value)]
            continue
        if where == "every worker":
            values = [(r["rank"], r[key]) for r in ranks if r[key] is not None]
        elif name in ("goodput_seconds", "fault_seconds"):
            split = record.get(key) if isinstance(record.get(key), dict) else {}
            values = [(label, v) for label in LABEL_VALUES[name]
                      if (v := protocol.number(split.get(label))) is not None]
        elif name == "progress_age_seconds":
            published = protocol.number(record.get(key))
            values = [("", max(0.0, time.time() - published))] if published is not None else []
        elif name == "attempts_ended":
            counts = verdict.get(key) if isinstance(verdict.get(key), dict) else {}
            values = [(cause, v) for cause in LABEL_VALUES[name]
                      if (v := protocol.number(counts.get(cause))) is not None and 0 <= v < 1e9]
        elif name == "state":
            values = [(job_fields(verdict, progress_fields(record) if progress else {})["state"], 1)]
        else:
            value = protocol.number((record if where == "node rank 0" else verdict).get(key))
            values = [("", value)] if value is not None else []
        yield name, label, doc, values


def serve_metrics(pod: Pod, port: int, progress: bool, job: bool, uploads: dict | None = None) -> bool:
    try:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415
    except ImportError as err:
        log(f"no metrics: {err} (the image needs the prometheus_client package)")
        return False

    class Collector:
        def collect(self):
            for name, label, doc, values in samples(pod, progress, job, uploads):
                if not values and not label:
                    continue
                family = GaugeMetricFamily(f"{METRIC}_{name}", doc, labels=[label] if label else [])
                for label_value, value in values:
                    family.add_metric([label_value] if label else [], value)
                yield family

    registry = CollectorRegistry()
    registry.register(Collector())
    try:
        start_http_server(port, registry=registry)
    except OSError as err:  # the port is taken: the ConfigMap is still kept
        log(f"no metrics: port {port}: {err}")
        return False
    log(f"serving metrics on :{port}/metrics")
    return True


def write_job_id(pod: Pod, api: Api | None, configmap: str | None) -> None:
    """The job's identity for the ledger (protocol.JOB_ID_FILE): the progress ConfigMap's uid, which Helm keeps
    across upgrades and a reinstall replaces; empty without API access (the ledger then keys by the Job's uid).
    Written before anything else: the pod's main container waits for it (the chart's startupProbe)."""
    uid, data = "", {}
    if api and configmap:
        try:
            api.requests += 1
            found = api.core.read_namespaced_config_map(configmap, api.namespace, _request_timeout=API_TIMEOUT)
            uid, data = found.metadata.uid, found.data or {}
        except Exception as err:  # noqa: BLE001 - the ledger falls back to the Job's uid
            log(f"no job identity from ConfigMap {configmap} ({type(err).__name__}): the ledger keys by the Job")
    note_peer_step(pod, data.get("peerStep"))  # before job.id: the main container waits for that one
    if not pod.dir.write(protocol.JOB_ID_FILE, f"{uid}\n"):
        log(f"could not write {protocol.JOB_ID_FILE} in {pod.dir.path()}")


def note_peer_step(pod: Pod, shown, written: int | None = None) -> int | None:
    """The peer copy's newest copied step as the progress ConfigMap shows it (`shown`), for the peer copy's plan
    (protocol.JOB_PEER_STEP), where it is a step and not the one `written` before; the step written."""
    step = int(shown) if isinstance(shown, str) and shown.isdigit() and len(shown) < 16 else None
    if step is None or step == written:
        return written
    return step if pod.dir.write(protocol.JOB_PEER_STEP, json.dumps({"step": step})) else written


def start_uploads():
    """With checkpoints.objectStore, this pod's uploads (objectstore.py) in a thread of their own: a slow or absent
    store never holds the progress loop. The uploader (its status is what the metrics read); None without one."""
    if not os.environ.get("DS_OBJECT_STORE_BUCKET"):
        return None
    from podruntime import objectstore  # noqa: PLC0415 - only with a bucket: it imports the store's client

    try:
        uploader = objectstore.Uploader(objectstore.Settings())
    except Exception as err:  # noqa: BLE001 - no client in the image: say so, publish progress anyway
        log(f"no checkpoint uploads: {type(err).__name__}: {err}")
        return None
    uploader.stop = threading.Event()
    uploader.thread = threading.Thread(target=uploader.run, args=(uploader.stop,), daemon=True, name="uploads")
    uploader.thread.start()
    log(f"uploading checkpoints to {uploader.settings.bucket} under {uploader.settings.prefix}")
    return uploader


def last_uploads(uploader) -> None:
    """On SIGTERM (a native sidecar gets it after its pod's main container has ended): one more round, so that
    what the pod wrote last (a preemption marked in the ledger, a checkpoint saved on SIGTERM) reaches the bucket
    while the grace period lasts."""
    uploader.stop.set()
    uploader.thread.join(timeout=30)
    uploader.next_try = 0.0
    uploader.step()


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sidecar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configmap", help="the progress ConfigMap to patch")
    parser.add_argument("--progress", action="store_true", help="this pod holds rank 0 (node rank 0)")
    parser.add_argument("--job", action="store_true", help="this pod holds the ledger (ssh: launcher; nossh: worker 0)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--scale-down", metavar="STATEFULSET", help="scale it to 0 once the job is done")
    parser.add_argument("--world-size", type=int, default=1 << 20, help="ranks of the job (rank labels below it)")
    parser.add_argument("--ranks-per-pod", type=int, default=64, help="the most rank series this pod serves")
    return parser.parse_args(argv)


def connect(args, progress: bool, job: bool) -> "Api | None":
    """The API, when this pod publishes or scales down; None (said once) without a token, a cluster or a client."""
    wanted = [what for what in (args.configmap and (progress or job) and f"publishing to ConfigMap {args.configmap}",
                                args.scale_down and f"scaling {args.scale_down} down") if what]
    if not wanted:
        return None
    try:
        api = Api(os.environ.get("POD_NAMESPACE", "default"))
    except Exception as err:  # noqa: BLE001 - no token, no cluster, no client: the metrics still work
        log(f"no API access: not {' nor '.join(wanted)}: {type(err).__name__}: {err}")
        return None
    log(", ".join(wanted) + (" once the job is done" if args.scale_down else ""))
    return api


def main(argv: list[str]) -> int:
    args = arguments(argv)
    # A pod's role may hang on its index, which the pod learns at run time (the workers share one template).
    node_rank = os.environ.get("DS_NODE_RANK", "")
    progress, job = args.progress and node_rank in ("", "0"), args.job and node_rank in ("", "0")
    pod = Pod(Tree(os.environ.get(protocol.STATE_DIR_ENV, "/tmp/deepspeed-ranks"), log), args.world_size,
              args.ranks_per_pod)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    uploader = start_uploads()
    if args.metrics_port:
        serve_metrics(pod, args.metrics_port, progress, job, uploader and uploader.status)
    api = connect(args, progress, job)
    write_job_id(pod, api, args.configmap)
    publisher = Publisher(pod, api, args.configmap or "", progress, job, uploader and uploader.status)
    scale_down = ScaleDown(api, args.scale_down, pod) if api and args.scale_down else None
    final_tries = FINAL_TRIES
    while True:
        final = bool(stopping)
        if uploader:  # the newest local checkpoint, even while an upload waits on a store that is away
            uploader.update_lag()
        done = publisher.step(final)
        if scale_down:
            scale_down.run()
        if final and uploader and not uploader.stop.is_set():
            last_uploads(uploader)
        if not final:
            time.sleep(POLL_S)
            continue
        final_tries -= 1
        if (done and not (scale_down and scale_down.pending())) or final_tries <= 0:
            if api:
                log(f"stopping after {api.requests} API requests")
            return 0
        time.sleep(0.5)
