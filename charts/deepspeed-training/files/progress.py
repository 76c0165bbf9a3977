"""The progress sidecar of the release's pods (both launch modes): where a run stands, for `kubectl get` and for
Prometheus. It runs no tenant code (the platform's image), and it is the only container that holds a token: the
release's own ServiceAccount's, whose Roles can get and patch one ConfigMap, <release>-progress, and scale the
release's worker StatefulSet (ssh mode), nothing else.

It reads what its own pod knows, in DS_RANK_STATE_DIR:
- PROGRESS, rank 0's progress (train/rankstate.py, on worker 0): state, step, steps, loss, tokens/s, ETA, ...
- VERDICT, the attempt ledger's (attempts.py, where it is kept: the launcher in ssh mode, worker 0 in nossh):
  an attempt starting, failed or done, a stop, or the failure budget spent
- hang-<run>.txt, the watchdog's report (watchdog.py, any worker): the state `hung`, the report's first line as
  the reason
and, within POLL_S of a change, patches the ConfigMap's data (strings; `summary` is the one line to read). Every
pod patches only what it read, so the newest event's state stands. With --metrics-port it serves the same, and
every rank's step, step time and heartbeat age, as Prometheus metrics (prometheus_client). Without API access
(no token, no cluster) or without prometheus_client in the image, it says so once and does the rest.

With --scale-down NAME (the launcher pod of launchMode ssh, launcher.scaleDownWorkers), once the ledger's verdict
says the job is done it scales the StatefulSet NAME to 0, so that finished workers free their GPUs: within a second
of the verdict, or at the latest on the SIGTERM the kubelet sends this native sidecar when the launcher has exited.

Usage: progress.py [--configmap NAME] [--metrics-port PORT] [--scale-down STATEFULSET]
       (runs until SIGTERM, then publishes once more)
"""

import argparse
import json
import os
import re
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

# The contract of train/rankstate.py and attempts.py (tests/test_pod_scripts.py checks that all say the same).
PROGRESS = "progress.json"
VERDICT = "verdict.json"
POLL_S = 1.0
METRIC = "deepspeed_training"
API_TIMEOUT = (3, 10)  # connect, read: a stuck API call must not hold the loop, nor the exit after SIGTERM
FINAL_TRIES = 20  # after SIGTERM, 0.5 s apart: a concurrent patch (409) or a slow API must not lose the last word
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")  # a program's strings reach terminals (make status): no escapes


def text(value, limit: int) -> str:
    """A published string, on one line, without control characters, at most `limit` characters."""
    return CONTROL.sub(" ", value)[:limit]


def log(message: str) -> None:
    print(f"progress: {socket.gethostname()}: {message}", flush=True)


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def number(value) -> float | None:
    """A published number, or None (a program's own writer may publish anything)."""
    if isinstance(value, bool):
        return None
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if result == result and abs(result) != float("inf") else None


def format_eta(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def fields_of(source: dict) -> dict[str, str]:
    """The ConfigMap's keys for what a PROGRESS or VERDICT file says (absent ones left out)."""
    out: dict[str, str] = {}
    if isinstance(source.get("state"), str):
        out["state"] = text(source["state"], 32)
    if isinstance(source.get("reason"), str):
        out["reason"] = text(source["reason"], 1000)
    formats = {"step": ("step", "{:.0f}"), "steps": ("steps", "{:.0f}"), "loss": ("loss", "{:.4f}"),
               "lr": ("lr", "{:.3e}"), "tokens_per_s": ("tokensPerSecond", "{:.0f}"), "mfu": ("mfu", "{:.1%}"),
               "checkpoint_step": ("checkpointStep", "{:.0f}"), "attempt": ("attempt", "{:.0f}"),
               "failures": ("failuresUsed", "{:.0f}"), "failure_budget": ("failureBudget", "{:.0f}"),
               "preemptions": ("preemptions", "{:.0f}")}
    for key, (name, form) in formats.items():
        value = number(source.get(key))
        if value is not None:
            out[name] = form.format(value)
    if isinstance(source.get("loss"), str):  # rankstate writes a non-finite loss as "nan" / "inf"
        out["loss"] = text(source["loss"], 16)
    if (eta := number(source.get("eta_s"))) is not None and eta >= 0:
        out["eta"] = format_eta(eta)
    step, steps = number(source.get("step")), number(source.get("steps"))
    if step is not None and steps:
        out["percent"] = f"{100 * step / steps:.1f}"
    if isinstance(source.get("run"), str):
        out["run"] = text(source["run"], 64)
    if isinstance(source.get("goodput_line"), str):  # train/goodput.py's split of the job's wall time
        out["goodput"] = text(source["goodput_line"], 400)
    return out


def summary(data: dict[str, str]) -> str:
    """One line: `training | step 120/300 (40.0%) | loss 0.4064 | 6100 tokens/s | eta 0:00:18 | ...`."""
    parts = [data.get("state", "pending")]
    if "step" in data:
        parts.append(f"step {data['step']}" + (f"/{data['steps']}" if "steps" in data else "")
                     + (f" ({data['percent']}%)" if "percent" in data else ""))
    parts += [f"{label} {data[key]}" for key, label in (("loss", "loss"), ("mfu", "mfu"), ("eta", "eta"),
                                                        ("checkpointStep", "checkpoint at step")) if key in data]
    if (tokens := number(data.get("tokensPerSecond"))) is not None:
        parts.insert(3 if "loss" in data else 2, f"{tokens:,.0f} tokens/s")
    if data.get("goodput"):
        parts.append(data["goodput"].split(" | ")[0])  # "goodput 91.2%"
    if "attempt" in data:
        preemptions = data.get("preemptions", "?")
        parts.append(f"attempt {data['attempt']} ({data.get('failuresUsed', '?')} of {data.get('failureBudget', '?')}"
                     f" failures used, {preemptions} preemption{'' if preemptions == '1' else 's'})")
    if data.get("reason"):
        parts.append(data["reason"])
    return " | ".join(parts)


class Pod:
    """The files of this pod's DS_RANK_STATE_DIR, and what changed in them since the last look."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.seen: dict[str, tuple[int, int]] = {}  # file name -> (inode, mtime_ns) when last read

    def changes(self) -> list[tuple[float, dict[str, str]]]:
        """(time, fields) of every source that changed, oldest first: by the time its writer put in it (mtimes
        may be coarser than the events), else by its mtime."""
        found = []
        paths = [self.state_dir / PROGRESS, self.state_dir / VERDICT, *self.state_dir.glob("hang-*.txt")]
        for path in paths:
            try:
                mtime = path.stat().st_mtime_ns
            except OSError:
                continue
            try:
                identity = (path.stat().st_ino, mtime)
            except OSError:
                continue
            if self.seen.get(path.name) == identity:
                continue
            self.seen[path.name] = identity
            if path.name.startswith("hang-"):
                try:
                    first = path.read_text(errors="replace").splitlines()[0]
                except (OSError, IndexError):
                    continue
                found.append((mtime / 1e9, {"state": "hung", "reason": text(first, 1000),
                                            "run": text(path.name.removeprefix("hang-").removesuffix(".txt"), 64)}))
                continue
            source = read_json(path)
            written = number(source.get("time"))
            found.append((written if written is not None else mtime / 1e9, fields_of(source)))
        return sorted(found, key=lambda change: change[0])

    def ranks(self) -> list[dict]:
        """Every rank's state line (train/rankstate.py: `<state> rank=R step=N step_s=S`) and its age."""
        ranks = []
        for path in self.state_dir.glob("[0-9]*"):
            if not path.name.isdigit():
                continue
            try:
                words, age = path.read_text(errors="replace").split(), time.time() - path.stat().st_mtime
            except OSError:
                continue
            fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            if fields.get("rank", "").isdigit():
                ranks.append({"rank": fields["rank"], "state": words[0] if words else "", "age": age,
                              "step": number(fields.get("step")), "step_s": number(fields.get("step_s"))})
        return ranks


def merge(data: dict[str, str], update: dict[str, str]) -> dict[str, str]:
    """The ConfigMap's data after `update`. An attempt's failure keeps the hang report that caused it; the reason
    (why the last attempt ended) goes once the job is done."""
    merged = dict(data)
    if (update.get("state") == "failed" and data.get("state") == "hung" and data.get("run")
            and update.get("run") == data["run"]):
        update = {k: v for k, v in update.items() if k != "reason"}
    merged.update(update)
    if merged.get("state") == "done":
        merged.pop("reason", None)
    merged["updated"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    merged["summary"] = summary(merged)
    return merged


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


class ScaleDown:
    """Scales the release's worker StatefulSet to 0 once the ledger's verdict says the job is done."""

    def __init__(self, api: Api, name: str, state_dir: Path):
        self.api, self.name, self.state_dir, self.done, self.last_error = api, name, state_dir, False, ""

    def pending(self) -> bool:
        return not self.done and read_json(self.state_dir / VERDICT).get("state") == "done"

    def run(self) -> None:
        if not self.pending():
            return
        try:
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


class ConfigMap:
    """The progress ConfigMap, through the kubernetes client and this pod's token."""

    def __init__(self, name: str, api: Api):
        self.api, self.name, self.namespace = api.core, name, api.namespace

    def apply(self, update: dict[str, str]) -> None:
        """Read, merge, write with the read's resourceVersion: a concurrent patch from another pod fails this one
        (409), and the caller tries again."""
        current = self.api.read_namespaced_config_map(self.name, self.namespace, _request_timeout=API_TIMEOUT)
        data = merge(current.data or {}, update)
        if "reason" not in data:  # merge dropped it: a merge patch removes a key only when told to with null
            data = {**data, "reason": None}
        body = {"metadata": {"resourceVersion": current.metadata.resource_version}, "data": data}
        self.api.patch_namespaced_config_map(self.name, self.namespace, body, _request_timeout=API_TIMEOUT)


def serve_metrics(pod: Pod, port: int, release: str) -> bool:
    try:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415
    except ImportError as err:
        log(f"no metrics: {err} (the image needs the prometheus_client package)")
        return False

    class Collector:
        def collect(self):
            progress, labels = read_json(pod.state_dir / PROGRESS), [release]
            gauges = (("step", "step", "the last step rank 0 reported"),
                      ("steps", "steps", "the steps the run trains for"),
                      ("loss", "loss", "rank 0's last logged loss (the mean over ranks)"),
                      ("learning_rate", "lr", "the last logged learning rate"),
                      ("tokens_per_second", "tokens_per_s", "tokens a second over the last logged interval"),
                      ("mfu_ratio", "mfu", "model FLOPs utilisation over the last logged interval"),
                      ("eta_seconds", "eta_s", "seconds left at the recent pace"),
                      ("checkpoint_step", "checkpoint_step", "the step of the last complete checkpoint"),
                      ("checkpoint_save_seconds", "checkpoint_save_s", "seconds the last checkpoint save took"),
                      ("attempt", "attempt", "the job's attempt number"),
                      ("failures", "failures", "failed attempts so far (the failure budget used)"),
                      ("failure_budget", "failure_budget", "failed attempts the job may retry"),
                      ("preemptions", "preemptions", "attempts stopped by SIGTERM (not counted as failures)"))
            for name, key, doc in gauges:
                value = number(progress.get(key))
                if value is not None:
                    family = GaugeMetricFamily(f"{METRIC}_{name}", doc, labels=["release"])
                    family.add_metric(labels, value)
                    yield family
            if isinstance(progress.get("state"), str):
                family = GaugeMetricFamily(f"{METRIC}_state", "rank 0's state (1 for the current one)",
                                           labels=["release", "state"])
                family.add_metric([release, progress["state"][:32]], 1)
                yield family
            if (published := number(progress.get("time"))) is not None:
                family = GaugeMetricFamily(f"{METRIC}_progress_age_seconds", "seconds since rank 0 last reported",
                                           labels=["release"])
                family.add_metric(labels, max(0.0, time.time() - published))
                yield family
            goodput = progress.get("goodput") if isinstance(progress.get("goodput"), dict) else {}
            family = GaugeMetricFamily(f"{METRIC}_goodput_seconds", "the job's wall time so far, by where it went "
                                       "(all attempts; bucket wall is the whole)", labels=["release", "bucket"])
            for bucket, seconds in goodput.items():
                if isinstance(bucket, str) and bucket != "attempts" and (value := number(seconds)) is not None:
                    family.add_metric([release, bucket[:32]], value)
            yield family
            ranks = pod.ranks()
            for name, key, doc in (("rank_step", "step", "the last step this rank finished"),
                                   ("rank_step_seconds", "step_s", "this rank's recent seconds per step"),
                                   ("rank_heartbeat_age_seconds", "age", "seconds since this rank's last report")):
                family = GaugeMetricFamily(f"{METRIC}_{name}", doc, labels=["release", "rank"])
                for rank in ranks:
                    if rank[key] is not None:
                        family.add_metric([release, rank["rank"]], rank[key])
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configmap", help="the progress ConfigMap to patch")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--scale-down", metavar="STATEFULSET", help="scale it to 0 once the job is done")
    args = parser.parse_args(argv)
    state_dir = Path(os.environ.get("DS_RANK_STATE_DIR", "/tmp/deepspeed-ranks"))
    pod = Pod(state_dir)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if args.metrics_port:
        serve_metrics(pod, args.metrics_port, os.environ.get("DS_RELEASE", ""))
    configmap = scale_down = None
    if args.configmap or args.scale_down:
        try:
            api = Api(os.environ.get("POD_NAMESPACE", "default"))
        except Exception as err:  # noqa: BLE001 - no token, no cluster, no client: the metrics still work
            wanted = " nor ".join(what for what in (args.configmap and f"publishing to ConfigMap {args.configmap}",
                                                    args.scale_down and f"scaling {args.scale_down} down") if what)
            log(f"no API access: not {wanted}: {type(err).__name__}: {err}")
        else:
            if args.configmap:
                configmap = ConfigMap(args.configmap, api)
                log(f"publishing to ConfigMap {args.configmap}")
            if args.scale_down:
                scale_down = ScaleDown(api, args.scale_down, state_dir)
                log(f"scaling statefulset {args.scale_down} to 0 once the job is done")
    pending: dict[str, str] = {}
    last_error, final_tries = "", FINAL_TRIES
    while True:
        for _, fields in pod.changes():
            pending = merge(pending, fields) if pending else dict(fields)
        if configmap and pending:
            try:
                configmap.apply({k: v for k, v in pending.items() if k not in ("updated", "summary")})
                pending, last_error = {}, ""
            except Exception as err:  # noqa: BLE001 - the API may be away for a while: keep it, try again
                if str(err) != last_error:
                    last_error = str(err)
                    log(f"could not patch ConfigMap {args.configmap} (trying again): {type(err).__name__}: "
                        f"{last_error.splitlines()[0] if last_error else ''}")
        if scale_down:
            scale_down.run()
        if stopping:
            final_tries -= 1
            if not ((configmap and pending) or (scale_down and scale_down.pending())) or final_tries <= 0:
                return 0
            time.sleep(0.5)  # the pod's grace period is long; a conflict clears in one more read
            continue
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
