"""`make why` and `make logs`: what happened to a release's run, for a person, from API objects only, read with the
person's own access (the pods' tokens stay narrow): the progress ConfigMap the sidecars keep (the ledger's causes
and attempts, rank 0's progress), the release's pods and Jobs, and their events. Nothing raw from the cluster is
printed: every value goes through cluster.printable().

Who decides which cause (podruntime/causes.py): the pods decide from in-pod evidence (its ATTEMPT_RULES); what only
the API server knows refines an attempt's cause here (its CLUSTER_RULES): a container OOMKilled, a pod's
DisruptionTarget condition (eviction, preemption, a lost node), a pod deleted, a node not ready, each matched to the
attempt that ended near it in time.
"""

import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from podruntime import causes, protocol
from podruntime.text import duration, lines
from scripts.deployctl.cluster import printable
from scripts.deployctl.common import DeployError, manifest_docs
from scripts.deployctl.helm import release_name
from scripts.deployctl.render import Rendered

EVENTS_SHOWN = 5


@dataclass
class Release:
    name: str
    namespace: str
    progress: str  # the progress ConfigMap
    mode: str  # ssh | nossh
    jobs: list[str]  # the release's Jobs (ssh: the launcher; nossh: the workers), hooks left out
    ranks_per_worker: int
    checkpoint_mount: str
    main_containers: tuple[str, ...] = ("launcher", "worker")  # a pod's Killing of these, not of its sidecar
    workloads: tuple[str, ...] = ()  # its Jobs and StatefulSets, hooks included (default: `jobs`): their pods' names
    objects: tuple[str, ...] = ()  # every object it renders

    def owns(self, name: str, uid: str | None, uids: set[str], listed_jobs: tuple[str, ...] = ()) -> bool:
        """Whether an event's object is this release's, by identity, never by a prefix (a project `llama-7b` beside
        `llama`): the uid of one of its pods or Jobs (listed by its instance label), a name it renders, or a pod name
        one of its workloads gives (`<statefulset>-<ordinal>`, `<job>-[<index>-]<5 characters>`: a pod gone since;
        the Jobs listed by its label count too: an earlier revision's launcher)."""
        if uid and uid in uids:
            return True
        if name in (*self.objects, self.progress, *self.jobs, *listed_jobs):
            return True
        return any(re.fullmatch(rf"{re.escape(workload)}-(\d+|(\d+-)?[a-z0-9]{{5}})", name)
                   for workload in (*(self.workloads or self.jobs), *listed_jobs))


def release_of(r: Rendered, manifests: str) -> Release:
    docs = manifest_docs(manifests)
    progress = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"
                and d["metadata"]["name"].endswith("-progress")]
    if not progress:
        raise DeployError(f"release {release_name(r)} renders no progress ConfigMap (progress.enabled is false): "
                          "make why and make logs read it")
    jobs = [d["metadata"]["name"] for d in docs if d["kind"] == "Job"
            and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]
    workers = int(r.effective["worker"]["replicas"])
    mains = tuple(sorted({d["spec"]["template"]["spec"]["containers"][0]["name"] for d in docs
                          if d["kind"] in ("Job", "StatefulSet")
                          and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})}))
    workloads = tuple(d["metadata"]["name"] for d in docs if d["kind"] in ("Job", "StatefulSet"))
    return Release(release_name(r), r.settings["deploy"]["namespace"], progress[0], r.effective["launchMode"], jobs,
                   max(1, r.world_size // max(1, workers)), r.effective["checkpoints"]["mountPath"], mains, workloads,
                   tuple(d["metadata"]["name"] for d in docs))


def epoch(value) -> float | None:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return None


def clock(seconds: float | None) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%H:%M:%SZ") if seconds else "?"


def read(core, batch, release: Release) -> dict:
    """The API objects `why` reads, as plain data: four requests, whatever the number of workers."""
    selector = f"app.kubernetes.io/instance={release.name}"
    progress = core.read_namespaced_config_map(release.progress, release.namespace).data or {}
    pods, uids = [], set()
    for pod in core.list_namespaced_pod(release.namespace, label_selector=selector).items:
        uids.add(pod.metadata.uid)
        statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
        terminated = [(c.name, t.reason, t.exit_code, epoch(t.finished_at), t.message) for c in statuses
                      for t in (c.state.terminated if c.state else None,
                                c.last_state.terminated if c.last_state else None) if t]
        disruption = [(c.reason, c.message, epoch(c.last_transition_time)) for c in pod.status.conditions or []
                      if c.type == "DisruptionTarget" and c.status == "True"]
        # Device health per container (Kubernetes 1.36, beta): a device its plugin or DRA driver calls Unhealthy.
        devices = [(c.name, r.name, h.resource_id, h.message) for c in statuses
                   for r in (c.allocated_resources_status or []) for h in (r.resources or [])
                   if h.health == "Unhealthy"]
        # Why a pod does not run: the scheduler's word (an unbound claim says so there too), a container that
        # waits (an image that cannot be pulled, a crash loop), an init container's last failed run.
        unschedulable = [c.message or c.reason or "" for c in pod.status.conditions or []
                         if c.type == "PodScheduled" and c.status == "False"]
        inits = {c.name for c in pod.status.init_container_statuses or []}
        waiting = [(c.name, c.name in inits, c.state.waiting.reason or "", c.state.waiting.message or "", c.image or "",
                    (c.last_state.terminated.message or "") if c.last_state and c.last_state.terminated else "")
                   for c in statuses if c.state and c.state.waiting
                   and c.state.waiting.reason not in (None, "ContainerCreating", "PodInitializing")]
        pods.append({"name": pod.metadata.name, "phase": pod.status.phase, "reason": pod.status.reason,
                     "unschedulable": unschedulable[0] if unschedulable else None, "waiting": waiting,
                     "message": pod.status.message, "deleted": epoch(pod.metadata.deletion_timestamp),
                     "created": epoch(pod.metadata.creation_timestamp), "node": pod.spec.node_name,
                     "terminated": terminated, "disruption": disruption, "devices": devices,
                     "restarts": sum(c.restart_count or 0 for c in statuses)})
    listed_jobs = batch.list_namespaced_job(release.namespace, label_selector=selector).items
    uids |= {job.metadata.uid for job in listed_jobs}
    events = [{"object": e.involved_object.name, "kind": e.involved_object.kind, "type": e.type, "reason": e.reason,
               "message": e.message, "time": epoch(e.last_timestamp) or epoch(e.event_time)
               or epoch(e.first_timestamp), "count": e.count or 1}
              for e in core.list_namespaced_event(release.namespace).items
              if release.owns(e.involved_object.name or "", e.involved_object.uid, uids - {None},
                              tuple(job.metadata.name for job in listed_jobs))]
    jobs = []
    for job in listed_jobs:
        if job.metadata.name in release.jobs:
            conditions = [(c.type, c.reason, c.message) for c in job.status.conditions or [] if c.status == "True"]
            jobs.append({"name": job.metadata.name, "conditions": conditions, "active": job.status.active or 0,
                         "failed": job.status.failed or 0, "succeeded": job.status.succeeded or 0,
                         "suspended": bool(job.spec.suspend)})
    job_uids = {job.metadata.uid for job in listed_jobs if job.metadata.name in release.jobs}
    return {"progress": progress, "pods": pods, "events": events, "jobs": jobs,
            "admission": admission(custom_objects(core, release.namespace), job_uids, release)}


# Where a job waits to be admitted: (group, version, plural, what it is). Kueue's Workload is owned by the Job it
# admits; a gang's PodGroup (Volcano's, Kubernetes' own) is one the chart rendered, by name.
ADMISSION_APIS = (("kueue.x-k8s.io", "v1beta1", "workloads", "Kueue workload"),
                  ("kueue.x-k8s.io", "v1beta2", "workloads", "Kueue workload"),
                  ("scheduling.volcano.sh", "v1beta1", "podgroups", "Volcano PodGroup"),
                  ("scheduling.k8s.io", "v1alpha2", "podgroups", "PodGroup"),
                  ("scheduling.k8s.io", "v1alpha1", "workloads", "Workload"))
ADMITTED = ("Admitted", "Scheduled", "PodGroupScheduled")  # a condition True of these: nothing to say


def custom_objects(core, namespace: str) -> list[tuple[str, dict]]:
    """(what it is, object) of every admission API the cluster serves and the reader may list (the rest: none)."""
    from kubernetes import client  # noqa: PLC0415

    if getattr(core, "api_client", None) is None:  # a client of the core API alone: no custom objects to read
        return []
    custom, found = client.CustomObjectsApi(core.api_client), []
    for group, version, plural, what in ADMISSION_APIS:
        try:
            listed = custom.list_namespaced_custom_object(group, version, namespace, plural, _request_timeout=10)
        except Exception:  # noqa: BLE001 - an API the cluster does not serve, or may not be read: nothing to say
            continue
        found += [(what, item) for item in listed.get("items", []) if isinstance(item, dict)]
    return found


def admission(objects: list[tuple[str, dict]], job_uids: set[str], release: "Release") -> list[dict]:
    """What keeps the release's pods from being admitted or scheduled as a gang: {what, name, phase, message} of
    each of its admission objects (owned by its Jobs, or rendered by it, by exact name) that is not admitted."""
    waiting = []
    for what, item in objects:
        meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
        owners = {o.get("uid") for o in meta.get("ownerReferences") or [] if isinstance(o, dict)}
        ours = owners & job_uids if what.startswith("Kueue") else meta.get("name") in release.objects
        if not ours:
            continue
        status = item.get("status") if isinstance(item.get("status"), dict) else {}
        conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
        if any(c.get("type") in ADMITTED and c.get("status") == "True" for c in conditions):
            continue
        said = [c for c in conditions if c.get("message") and (c.get("status") == "False" or "Unschedulable" in
                                                                str(c.get("type", "")))]
        phase = status.get("phase") if isinstance(status.get("phase"), str) else ""
        if not said and phase not in ("Pending", "Inqueue"):
            continue
        waiting.append({"what": what, "name": str(meta.get("name", "")), "phase": phase,
                        "message": str(said[0].get("message", "")) if said else ""})
    return waiting


def admission_lines(waiting: list[dict], p) -> list[str]:
    return [f"Not admitted: {w['what']} {p(w['name'])}" + (f" ({p(w['phase'])})" if w["phase"] else "")
            + (f": {p(w['message'], 500).rstrip('.')}" if w["message"] else ": waiting") + "." for w in waiting]


def observations(pods: list[dict], events: list[dict], mains: tuple[str, ...]) -> list[dict]:
    """What the API server saw of the release's pods, as causes.CLUSTER_RULES read it: {kind, reason, message,
    main, time, text}, kind one of container (a terminated container), disruption (a DisruptionTarget condition),
    evicted (an Evicted pod), deletion (a pod being deleted), device (an Unhealthy device: no time, the API keeps
    none; it speaks for the newest attempt), event. A `Killing` of a pod's main container (`mains`) is a deletion;
    of its sidecar alone, the pod's normal end."""
    found = []
    for pod in pods:
        for container, resource, device, message in pod.get("devices", []):
            found.append({"kind": "device", "reason": "Unhealthy", "message": message or "", "time": None,
                          "text": f"pod {pod['name']}, container {container}: {resource} {device} Unhealthy"
                                  + (f" ({message})" if message else "")})
        for container, reason, code, finished, _ in pod["terminated"]:
            found.append({"kind": "container", "reason": reason, "message": "", "time": finished,
                          "text": f"pod {pod['name']}, container {container}: {reason} (exit {code}) at "
                                  f"{clock(finished)}"})
        for reason, message, when in pod["disruption"]:
            found.append({"kind": "disruption", "reason": reason, "message": message, "time": when,
                          "text": f"pod {pod['name']}: DisruptionTarget {reason} at {clock(when)}"
                                  + (f" ({message})" if message else "")})
        if pod["reason"] == "Evicted":
            found.append({"kind": "evicted", "reason": "Evicted", "message": pod["message"], "time": pod["deleted"]
                          or pod["created"], "text": f"pod {pod['name']}: evicted ({pod['message']})"})
        elif pod["deleted"] and not pod["disruption"]:
            found.append({"kind": "deletion", "reason": "", "message": "", "time": pod["deleted"],
                          "text": f"pod {pod['name']}: being deleted since {clock(pod['deleted'])}"})
    for event in events:
        stopped = re.fullmatch(r"Stopping container (\S+)", event["message"] or "")
        found.append({"kind": "event", "reason": event["reason"] or "", "message": event["message"] or "",
                      "main": bool(event["kind"] == "Pod" and stopped and stopped[1] in mains), "time": event["time"],
                      "text": f"{(event['kind'] or '').lower()} {event['object']}: {event['reason']} at "
                              f"{clock(event['time'])} ({event['message']})"})
    return found


def cluster_evidence(pods: list[dict], events: list[dict], mains: tuple[str, ...] = ("launcher", "worker")
                     ) -> list[dict]:
    """What the API server saw that the pods could not: {time, cause, text}, each one line, the cause the first
    causes.CLUSTER_RULES row gives (observations no rule names are left out)."""
    return [{"time": o["time"], "cause": cause, "text": o["text"]}
            for o in observations(pods, events, mains) if (cause := causes.cluster_cause(o))]


# Where an attempt's checkpoint came from (protocol.RESUMED_FROM: the peer copy's plan), as the paragraph says it.
RESUMED_FROM = dict(zip(protocol.RESUMED_FROM, ("the workers' own volumes", "the peer copy", "the bucket"),
                        strict=True))


def attempts_of(progress: dict) -> list[dict]:
    """The ledger's last attempts, from the ConfigMap's `attempts` (JSON, the sidecar's); [] if absent or not JSON."""
    try:
        entries = json.loads(progress.get("attempts", "[]"))
    except ValueError:
        return []
    return [e for e in entries if isinstance(e, dict) and e.get("cause") in causes.CAUSES
            and isinstance(e.get("attempt"), int)] if isinstance(entries, list) else []


def refine(entries: list[dict], evidence: list[dict]) -> list[dict]:
    """Each attempt with the cluster's cause where the pods' is one the cluster may explain better
    (causes.refines) and some evidence lies near its end: {**entry, seen: cause the pods gave, by: the evidence's
    line}."""
    out, newest = [], max((e["attempt"] for e in entries), default=None)
    for entry in entries:
        ended = entry.get("ended")
        near = [e for e in evidence if causes.refines(e["cause"], entry["cause"]) and (
            (ended and e["time"] and ended - causes.BEFORE_S <= e["time"] <= ended + causes.AFTER_S)
            or (e["time"] is None and entry["attempt"] == newest))]  # a device's health now: the newest attempt's
        if near:
            best = min(near, key=lambda e: (causes.strength(e["cause"]), abs(ended - e["time"]) if ended and e["time"]
                                            else 0.0))
            if best["cause"] != entry["cause"]:
                entry = {**entry, "seen": entry["cause"], "cause": best["cause"], "by": best["text"]}
        out.append(entry)
    return out


def stacks_path(release: Release, progress: dict, attempt: int, culprit: str) -> str:
    """Where the watchdog of the culprit's host wrote its ranks' stacks of that attempt (on that host's volume)."""
    job = protocol.parse_run_id(progress.get("run", ""))
    host = culprit.rsplit(" on ", 1)[-1] if " on " in culprit else ""
    if not job or not host:
        return ""
    return (f"{release.checkpoint_mount}/{protocol.JOB_DIR}/{protocol.DIAGNOSTICS}/"
            f"{protocol.run_id(attempt, job[1])}/{host}.txt")


def why_text(release: Release, observed: dict) -> str:
    """One paragraph: the state now, each attempt with its cause and the time it cost, the budget used and left,
    the culprit and its stacks, the last committed checkpoint, what the cluster saw."""
    progress, p = observed["progress"], lambda value, limit=400: printable(value, limit)
    state = progress.get("state", "pending")
    lines = [f"Release {p(release.name)} in namespace {p(release.namespace)} ({release.mode} mode): {p(state)}"
             + (f", cause {p(progress['cause'])}" if progress.get("cause") else "") + "."]
    if progress.get("reason") and state != "done":
        lines.append(f"Why: {p(progress['reason'], 1000)}")
    evidence = cluster_evidence(observed["pods"], observed["events"], release.main_containers)
    entries = refine(attempts_of(progress), evidence)
    if entries:
        shown = []
        for e in entries:
            text = f"{e['attempt']} {p(e['cause'])}" + (f" at step {e['step']}" if isinstance(e.get("step"), int)
                                                        else "")
            text += f", {duration(e['seconds'])}" if "seconds" in e else ""
            if e.get("resumed") in RESUMED_FROM:
                text += f", resumed from {RESUMED_FROM[e['resumed']]}"
            if e.get("by"):
                text += f" (the pods saw {p(e['seen'])}; the cluster: {p(e['by'])})"
            elif e["cause"] == "preempted":  # a SIGTERM the cluster shows no reason for (or the program's own mark)
                text += " (nothing the cluster kept shows why)"
            if e.get("culprit") and e["cause"] in ("hang", "collective-timeout", "program-error"):
                where = stacks_path(release, progress, e["attempt"], e["culprit"])
                text += f" (culprit {p(e['culprit'])}" + (f"; its stacks: {p(where)} on its host's checkpoint "
                                                          "volume" if where and e["cause"] != "program-error"
                                                          else "") + ")"
            shown.append(text)
        lines.append("Attempts: " + "; ".join(shown) + ".")
    counts = {k: progress.get(k) for k in ("failuresUsed", "failureBudget", "preemptions", "attempt")}
    if counts["failuresUsed"] and counts["failureBudget"]:
        used, budget = int(counts["failuresUsed"]), int(counts["failureBudget"])
        lines.append(f"Failure budget: {used} of {budget} used, {max(0, budget - used)} left; "
                     f"{p(counts['preemptions'] or 0)} preemption(s), never counted; attempt {p(counts['attempt'])} "
                     "is the latest.")
    if progress.get("culprit") and not entries:
        lines.append(f"Culprit: {p(progress['culprit'])}.")
    if progress.get("checkpointStep"):
        bucket = f" (the bucket's: step {p(progress['bucketStep'])})" if progress.get("bucketStep") else ""
        lines.append(f"Last committed checkpoint: step {p(progress['checkpointStep'])}{bucket}.")
    if progress.get("goodput"):
        lines.append(f"Where the time went: {p(progress['goodput'], 600)}.")
    if progress.get("lastFault"):  # the newest fault's loss by its parts (train/goodput.py)
        lines.append(f"The last fault: {p(progress['lastFault'], 600)}.")
    if progress.get("summary"):
        lines.append(f"Now: {p(progress['summary'], 1000)}.")
    for job in observed["jobs"]:
        conditions = ", ".join(f"{p(t)}" + (f" ({p(r)}: {p(m, 300)})" if r else "") for t, r, m in job["conditions"])
        state = conditions or ("suspended (not admitted yet: no pod is created)" if job.get("suspended") else "running")
        lines.append(f"Job {p(job['name'])}: {state}; {job['active']} active, {job['failed']} failed, "
                     f"{job['succeeded']} succeeded pods.")
    unexplained = [e for e in evidence if not any(e["text"] == a.get("by") for a in entries)]
    for e in sorted(unexplained, key=lambda e: -(e["time"] or 0))[:EVENTS_SHOWN]:
        lines.append(f"The cluster saw: {p(e['text'], 500)} ({p(e['cause'])}).")
    lines += admission_lines(observed.get("admission", []), p)
    lines += not_running(observed["pods"], p)
    phases = {}
    for pod in observed["pods"]:
        phases[pod["phase"]] = phases.get(pod["phase"], 0) + 1
    if phases:
        lines.append("Pods: " + ", ".join(f"{n} {p(phase)}" for phase, n in sorted(phases.items())) + ".")
    return "\n".join(lines)


NOT_RUNNING_SHOWN = 3  # pods named per reason; the rest are counted


def not_running(pods: list[dict], p) -> list[str]:
    """A line for each reason a pod cannot start or run, with the cluster's words, naming its pods (a hundred
    unschedulable workers are one line)."""
    said: dict[str, list[str]] = {}
    for pod in pods:
        if pod.get("unschedulable") is not None and pod["phase"] == "Pending":
            said.setdefault(f"not scheduled: {p(pod['unschedulable'], 500).rstrip('.')}", []).append(pod["name"])
        for container, init, reason, message, image, last in pod.get("waiting", []):
            what = f"{'init container' if init else 'container'} {p(container)}"
            if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"):
                text = f"{what}: its image {p(image)} cannot be pulled ({p(reason)}: {p(message, 300)})"
            else:
                tail = [line for line in (last or "").splitlines() if line.strip()][-1:]
                text = f"{what}: waits: {p(reason)}" + (f" ({p(message, 300)})" if message else "") + (
                    f"; its last run ended: {p(tail[0], 300)}" if tail else "")
            said.setdefault(text, []).append(pod["name"])
    lines = []
    for text, names in said.items():
        shown = ", ".join(p(name) for name in names[:NOT_RUNNING_SHOWN])
        more = f" and {len(names) - NOT_RUNNING_SHOWN} more" if len(names) > NOT_RUNNING_SHOWN else ""
        lines.append(f"Not running: pod{'s' if len(names) > 1 else ''} {shown}{more}: {text}.")
    return lines


def api(context: str | None):
    from kubernetes import client, config  # noqa: PLC0415 - only for a cluster command

    try:
        config.load_kube_config(context=context)
    except Exception as err:  # no kubeconfig, no cluster: one line
        raise DeployError(f"cannot reach the cluster: {type(err).__name__}: {err}") from None
    return client.CoreV1Api(), client.BatchV1Api()


def why(r: Rendered, context: str | None, dry_run: bool, manifests: str) -> int:
    release = release_of(r, manifests)
    print(f"+ read configmap {release.namespace}/{release.progress}, the release's pods and jobs "
          f"(app.kubernetes.io/instance={release.name}) and the namespace's events", flush=True)
    if dry_run:
        return 0
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    core, batch = api(context)
    try:
        observed = read(core, batch, release)
    except ApiException as err:
        raise DeployError(f"{release.namespace}: {err.status} {err.reason} (is release {release.name} installed, "
                          "and may you read its ConfigMap, pods, jobs and events?)") from None
    print(why_text(release, observed))
    return 0


DEPLOY_CHECK_S = 30  # make deploy's closing look at the pods
SETTLED_S = 10  # the same reasons this long: the cluster's word, not a pod on its way


def pods_check(r: Rendered, context: str | None, dry_run: bool, manifests: str) -> None:
    """`make deploy`'s closing check (settled): it never fails the deploy, the job goes on (a pod may wait for a node
    the autoscaler brings)."""
    release = release_of(r, manifests)
    print(f"+ then up to {DEPLOY_CHECK_S}s for the pods of release {release.name} to run (each that cannot says why)",
          flush=True)
    if dry_run:
        return
    core, batch = api(context)
    for line in settled(release, core, batch):
        print(f"deploy: {line}", flush=True)


def settled(release: Release, core, batch, limit: float = DEPLOY_CHECK_S, poll: float = 2.0,
            settle: float = SETTLED_S) -> list[str]:
    """Up to `limit` seconds for the release's pods to run, or for the reasons they cannot to hold for `settle`:
    a line counting them by phase, and one for each reason a pod cannot run (`not_running`, as `make why` says
    it)."""
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    deadline, said, since = time.monotonic() + limit, None, time.monotonic()
    while True:
        try:
            observed = read(core, batch, release)
            pods = observed["pods"]
        except ApiException as err:
            return [f"cannot read the release's pods ({err.status} {printable(err.reason)}): `make why` says more "
                    "with read access to its pods and events"]
        except Exception as err:  # noqa: BLE001 - the deploy is done: a look that fails is one line, not its end
            return [f"cannot read the release's pods ({type(err).__name__}): `make why` says more"]
        reasons = admission_lines(observed["admission"], printable) + not_running(pods, printable)
        if reasons != said:
            said, since = reasons, time.monotonic()
        running = bool(pods) and all(pod["phase"] in ("Running", "Succeeded") for pod in pods)
        if running or (reasons and time.monotonic() - since >= settle) or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    phases: dict[str, int] = {}
    for pod in pods:
        phases[pod["phase"]] = phases.get(pod["phase"], 0) + 1
    counted = ", ".join(f"{n} {printable(phase)}" for phase, n in sorted(phases.items())) or "none yet"
    return [f"pods of {printable(release.name)}: {counted}" + (
        "; training starts (`make status WATCH=1` follows it)" if running and not reasons else ""), *reasons]


def rank_lines(text: str, rank: int, attempt: int | None) -> list[str]:
    """The lines of one log that the rank tagger (podruntime/ranklog.py) tagged with `rank` (and `attempt`): split
    as the tagger splits (the newline alone), the tag counted only at a line's start (protocol.tag_of)."""
    return [line for line in lines(text) if (tag := protocol.tag_of(line)) and tag[0] == rank
            and (attempt is None or tag[1] == attempt)]


def rank_pods(core, release: Release, rank: int) -> list:
    """The pods whose log holds global rank `rank`'s lines, oldest first: ssh, the launcher's (pdsh relays every rank
    there); nossh, its worker's (rank // ranks per worker)."""
    if release.mode == "ssh":
        selector = "app.kubernetes.io/component=launcher"
    else:
        selector = f"batch.kubernetes.io/job-completion-index={rank // release.ranks_per_worker}"
    return sorted(core.list_namespaced_pod(release.namespace, label_selector=f"{selector},app.kubernetes.io/instance="
                                           f"{release.name}").items, key=lambda pod: pod.metadata.creation_timestamp)


def follow_rank(core, release: Release, rank: int, attempt: int | None) -> int:
    """`make logs FOLLOW=1`: the rank's lines in the newest pod that holds them, from its start and as they come,
    until that container ends (its exit: 0 when it succeeded)."""
    from kubernetes import watch  # noqa: PLC0415

    pods = rank_pods(core, release, rank)
    if not pods:
        raise DeployError(f"no pod of release {release.name} holds rank {rank}'s log yet (is it installed?)")
    pod = pods[-1]
    main = pod.spec.containers[0].name
    print(f"== pod {printable(pod.metadata.name)}, container {printable(main)}: following", flush=True)
    for line in watch.Watch().stream(core.read_namespaced_pod_log, pod.metadata.name, release.namespace,
                                     container=main, follow=True):
        for kept in rank_lines(line, rank, attempt):
            print(printable(kept, 4000), flush=True)
    ended = core.read_namespaced_pod(pod.metadata.name, release.namespace).status.container_statuses or []
    state = next((c.state.terminated for c in ended if c.name == main and c.state), None)
    return 0 if state is None or state.exit_code == 0 else 1


def rank_log(core, release: Release, rank: int, attempt: int | None) -> list[str]:
    """Global rank `rank`'s lines (of attempt `attempt`, or all), under a header per pod log that holds them: ssh,
    the launcher's (pdsh relays every rank there); nossh, its worker's (rank // ranks per worker). Every pod of that
    role, oldest first, and each container's previous log when it restarted: what the kubelet still keeps."""
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    pods = rank_pods(core, release, rank)
    out, found = [], 0
    for pod in pods:
        main = pod.spec.containers[0].name
        restarted = any((c.restart_count or 0) > 0 for c in pod.status.container_statuses or [] if c.name == main)
        for previous in ((True, False) if restarted else (False,)):
            try:
                text = core.read_namespaced_pod_log(pod.metadata.name, release.namespace, container=main,
                                                    previous=previous)
            except ApiException as err:
                out.append(f"== pod {printable(pod.metadata.name)}: no log ({err.status} {printable(err.reason)})")
                continue
            lines = rank_lines(text, rank, attempt)
            found += len(lines)
            out.append(f"== pod {printable(pod.metadata.name)}, container {printable(main)}"
                       f"{' (before its restart)' if previous else ''}: {len(lines)} lines")
            out += [printable(line, 4000) for line in lines]
    if not found:
        out.append(f"no line of rank {rank}" + (f" in attempt {attempt}" if attempt else "") + " in what the kubelet "
                   "keeps (the current log file of each container, and the previous container's)")
    return out


def logs(r: Rendered, context: str | None, dry_run: bool, manifests: str, rank: int, attempt: int | None,
         follow: bool = False) -> int:
    release = release_of(r, manifests)
    if rank >= r.world_size:
        raise DeployError(f"RANK={rank}: the release has ranks 0 to {r.world_size - 1}")
    where = ("the launcher's log (pdsh relays every rank there)" if release.mode == "ssh"
             else f"worker {rank // release.ranks_per_worker}'s log")
    print(f"+ rank {rank}" + (f", attempt {attempt}" if attempt else "") + f": {where}, in {release.namespace}"
          + (", followed" if follow else ""), flush=True)
    if dry_run:
        return 0
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    core, _ = api(context)
    try:
        if follow:
            return follow_rank(core, release, rank, attempt)
        print("\n".join(rank_log(core, release, rank, attempt)))
    except KeyboardInterrupt:
        return 130
    except ApiException as err:
        raise DeployError(f"{release.namespace}: {err.status} {err.reason} (is release {release.name} installed, and "
                          "may you read its pods and their logs?)") from None
    return 0
