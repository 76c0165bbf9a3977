"""Commands against a cluster: which kube context, and what the release's progress ConfigMap says, printed as plain
bounded lines (nothing raw from the cluster reaches a terminal)."""

import re
import shlex
import shutil
import subprocess
import sys
import time

from scripts.deployctl.common import DeployError, manifest_docs
from scripts.deployctl.helm import release_name
from scripts.deployctl.render import Rendered


def kube_context(r: Rendered, requested: str | None, need_cluster: bool) -> str | None:
    allowed = r.settings["deploy"]["kubeContexts"]
    context = requested or (allowed[0] if allowed else None)
    if context is None and need_cluster and shutil.which("kubectl"):
        proc = subprocess.run(["kubectl", "config", "current-context"], capture_output=True, text=True)
        context = proc.stdout.strip() or None
    if allowed and context not in allowed:
        raise DeployError(f"values/{r.env}.yaml: deploy.kubeContexts allows {allowed}; refusing to deploy ENV={r.env} "
                          f"to kube context {context!r}")
    return context


def status(r: Rendered, context: str | None, dry_run: bool, manifests: str, follow: bool = False) -> int:
    """Where the release's run stands: its progress ConfigMap (the chart's progress sidecars keep it), read with
    the kubernetes client; `follow` (make status WATCH=1): its summary line again at every change, until the run
    ends (exit 0 when it completed, 1 when it failed) or Ctrl-C."""
    names = [doc["metadata"]["name"] for doc in manifest_docs(manifests)
             if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-progress")]
    if not names:
        raise DeployError(f"release {release_name(r)} renders no progress ConfigMap (progress.enabled is false)")
    namespace = r.settings["deploy"]["namespace"]
    print("+ " + shlex.join(["kubectl", *(["--context", context] if context else []), "--namespace", namespace,
                             "get", "configmap", names[0], *(["--watch"] if follow else []), "-o",
                             "jsonpath={.data.summary}"]), flush=True)
    if dry_run:
        return 0
    from kubernetes import client, config  # noqa: PLC0415 - only for a cluster command
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        config.load_kube_config(context=context)
        api = client.CoreV1Api()
        if follow:
            return watch_progress(api, namespace, names[0])
        data = api.read_namespaced_config_map(names[0], namespace).data or {}
    except ApiException as err:
        raise DeployError(f"{namespace}/{names[0]}: {err.status} {err.reason} (is release {release_name(r)} "
                          "installed?)") from None
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    except DeployError:
        raise
    except Exception as err:  # no kubeconfig, no cluster: one line
        raise DeployError(f"cannot read {namespace}/{names[0]}: {type(err).__name__}: {err}") from None
    print(progress_text(data))
    return 0


ENDED = {"done": 0, "failed": 1}  # the job's final states in the progress ConfigMap (the ledger's VERDICT) and exit
WATCH_S = 300  # one watch request's length; the next one goes on from the last version seen
SETTLE_S = 5  # after the final state, the last words (rank 0's keys reach the summary a beat later; writes every 2 s)


def watch_progress(api, namespace: str, name: str) -> int:
    """The ConfigMap's summary at each change (its sidecar writes it at most every 2 s): on a terminal one line
    rewritten in place, cut to the terminal's width; otherwise a plain line per change. Ends with the run, once
    its final state has said its last words (its summary the same for SETTLE_S: the sidecars rewrite other fields,
    times, every few seconds)."""
    from kubernetes import watch  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    live, shown, version, ended, changed = sys.stdout.isatty(), None, None, None, time.monotonic()
    while True:
        settling = ended is not None  # this request only waits out SETTLE_S after the final state
        if version is None:  # a fresh start: what it says now, and the version to watch from
            found = api.read_namespaced_config_map(name, namespace)
            events = [{"type": "MODIFIED", "object": found}]
            version = found.metadata.resource_version
        else:
            events = watch.Watch().stream(api.list_namespaced_config_map, namespace, field_selector=f"metadata.name="
                                          f"{name}", resource_version=version,
                                          timeout_seconds=SETTLE_S if settling else WATCH_S)
        try:
            for event in events:
                if event["type"] == "DELETED":
                    raise DeployError(f"{namespace}/{name}: deleted while watched (the release uninstalled?)")
                found = event["object"]
                version = found.metadata.resource_version
                data = found.data or {}
                line = printable(data.get("summary", "(no summary yet)"), 1000)
                if line != shown:
                    if live:
                        width = shutil.get_terminal_size().columns - 1
                        print("\r\033[K" + (line if len(line) <= width else line[:width - 1] + "…"), end="",
                              flush=True)
                    else:
                        print(line, flush=True)
                    shown, changed = line, time.monotonic()
                ended = ENDED.get(data.get("state"))  # None again if a new attempt began meanwhile
                if ended is not None and (not settling or time.monotonic() - changed >= SETTLE_S):
                    break  # to a request that ends within SETTLE_S, or to the end
        except ApiException as err:  # a request with a timeout is not retried on a 410 by the client
            if err.status != 410:  # 410 Gone: the version is too old to watch from; read it afresh
                raise
            version = None
        if ended is not None and time.monotonic() - changed >= SETTLE_S:
            if live:
                print(flush=True)
            return ended


# What a terminal must not receive from the cluster: control characters (C0, DEL, C1: escape sequences that clear the
# screen, set the window title or write the clipboard with OSC 52), format characters (bidirectional overrides that
# reorder what a person reads) and line or paragraph separators.
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]")


def printable(value, limit: int = 400) -> str:
    """`value` as one line a terminal shows as it is: unprintable characters replaced by `?`, at most `limit`
    characters (an object of the cluster can hold a megabyte in one field)."""
    text = UNPRINTABLE.sub("?", str(value))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def progress_text(data: dict) -> str:
    """The progress ConfigMap's data for a person: its summary line, then every field, each printable()."""
    lines = [printable(data.get("summary", "(no summary yet)"), 1000)]
    lines += [f"  {printable(key, 40):<16} {printable(data[key])}" for key in sorted(k for k in data if k != "summary")]
    return "\n".join(lines)
