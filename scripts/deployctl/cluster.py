"""Commands against a cluster: which kube context, and what the release's progress ConfigMap says, printed as plain
bounded lines (nothing raw from the cluster reaches a terminal)."""

import re
import shlex
import shutil
import subprocess

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


def status(r: Rendered, context: str | None, dry_run: bool, manifests: str) -> int:
    """Where the release's run stands: its progress ConfigMap (the chart's progress sidecars keep it), read with
    the kubernetes client."""
    names = [doc["metadata"]["name"] for doc in manifest_docs(manifests)
             if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-progress")]
    if not names:
        raise DeployError(f"release {release_name(r)} renders no progress ConfigMap (progress.enabled is false)")
    namespace = r.settings["deploy"]["namespace"]
    print("+ " + shlex.join(["kubectl", *(["--context", context] if context else []), "--namespace", namespace,
                             "get", "configmap", names[0], "-o", "jsonpath={.data.summary}"]), flush=True)
    if dry_run:
        return 0
    from kubernetes import client, config  # noqa: PLC0415 - only for a cluster command
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        config.load_kube_config(context=context)
        data = client.CoreV1Api().read_namespaced_config_map(names[0], namespace).data or {}
    except ApiException as err:
        raise DeployError(f"{namespace}/{names[0]}: {err.status} {err.reason} (is release {release_name(r)} "
                          "installed?)") from None
    except Exception as err:  # no kubeconfig, no cluster: one line
        raise DeployError(f"cannot read {namespace}/{names[0]}: {type(err).__name__}: {err}") from None
    print(progress_text(data))
    return 0


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
