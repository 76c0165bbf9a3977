"""What the platform's layers pinned in the rendered pods (identity, scheduling, checkpoint volume, the sidecar's
image) stays pinned, by any path: a project's render against a render of the platform's layers alone."""

import json

from scripts.deployctl.common import DeployError, manifest_docs
from scripts.deployctl.helm import helm_template, release_name
from scripts.deployctl.render import Rendered, build, write

# What the platform's layers decide in the rendered objects, whichever values produce it (a component's own
# value, the global fallback, a parent set to null): name -> (what it is, the chart keys that feed it). A
# project's render may differ from the platform's alone only where deploy.projectChoices lists its value.
PLACEMENT = ("global", "worker", "launcher")  # a component's own value, else the global one


PINNED_FIELDS = {
    "serviceAccount": ("ServiceAccount (name and annotations: the pods' token and cloud identity)",
                       [("serviceAccount",)]),
    "priorityClassName": ("PriorityClass (preemption of other tenants)", [(c, "priorityClassName") for c in PLACEMENT]),
    "nodeSelector": ("nodeSelector (the node pool)", [(c, "nodeSelector") for c in PLACEMENT]),
    "tolerations": ("tolerations (tainted nodes)", [(c, "tolerations") for c in PLACEMENT]),
    "affinity": ("affinity (the node pool)", [(c, "affinity") for c in PLACEMENT]),
    "schedulerName": ("scheduler", [("scheduling",)]),
    "kueueQueueName": ("Kueue queue (admission and quota)", [("scheduling",)]),
    "volcanoQueue": ("Volcano queue", [("scheduling",)]),
    "checkpointVolume": ("checkpoint volume (claim and directory)", [("checkpoints",)]),
    # The sidecar holds the release's token: it runs the platform's image. With chart.progress.image empty it would
    # run the workers' image, which projects choose: the platform pins chart.progress.image (values/base.yaml), or
    # the project runs without the sidecar (chart.progress.enabled: false, chart.launcher.scaleDownWorkers: false).
    "progressImage": ("progress sidecar's image (it holds the release's token: the platform pins "
                      "chart.progress.image, or the project sets chart.progress.enabled: false and "
                      "chart.launcher.scaleDownWorkers: false)", [("progress",), ("image",)]),
}


QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def pinned_fields(manifests: str) -> dict[str, dict]:
    """{component: {field: value}} of PINNED_FIELDS for the worker and launcher pods of a render."""
    docs = manifest_docs(manifests)
    accounts = {d["metadata"]["name"]: d["metadata"].get("annotations", {}) for d in docs
                if d["kind"] == "ServiceAccount"}
    volcano = [d["spec"].get("queue", "") for d in docs
               if d["kind"] == "PodGroup" and d["apiVersion"].startswith("scheduling.volcano.sh/")]
    found = {}
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Job"):
            continue
        template, spec = doc["spec"]["template"], doc["spec"]["template"]["spec"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        account = spec.get("serviceAccountName", "default")
        fields = {
            "serviceAccount": {"name": account, "annotations": accounts.get(account, {})},
            **{name: spec.get(name, empty) for name, empty in (("priorityClassName", ""), ("nodeSelector", {}),
                                                               ("tolerations", []), ("affinity", {}),
                                                               ("schedulerName", ""))},
            "kueueQueueName": template["metadata"]["labels"].get(QUEUE_LABEL, ""),
            "volcanoQueue": volcano[0] if volcano else "",
            # None: no sidecar, so no token to guard (a project may always run without it)
            "progressImage": next((c["image"] for c in spec.get("initContainers", []) if c["name"] == "progress"),
                                  None),
        }
        if component == "worker":  # the launcher mounts checkpoints only for the autotuner
            volume = next((v for v in spec.get("volumes", []) if v["name"] == "checkpoints"), {})
            mount = next((m for m in spec["containers"][0].get("volumeMounts", []) if m["name"] == "checkpoints"), {})
            fields["checkpointVolume"] = {
                "source": (volume.get("persistentVolumeClaim") or {}).get("claimName") or
                ("emptyDir" if "emptyDir" in volume else "a PVC per worker"), "subPath": mount.get("subPath", "")}
        found[component] = fields
    return found


def check_pins(r: Rendered, manifests: str, check_ds_config: bool = True) -> None:
    """A project's layers may not move its pods off what the platform's layers pinned (scheduling, identity,
    checkpoint volume), by any path: its render is compared with a render of the platform's layers alone (whose
    ds_config goes through DeepSpeed's parser unless `check_ds_config` is False: a read-only command)."""
    try:
        platform = build(r.env, None, check_ds_config=check_ds_config)
    except DeployError as err:
        raise DeployError(f"the platform's layers alone do not render, so what the project may change cannot be "
                          f"checked: {err}") from None
    platform.out = r.out / "platform"
    write(platform)
    ours, theirs = pinned_fields(manifests), pinned_fields(helm_template(platform, release_name(r),
                                                                         r.settings["deploy"]["namespace"]))
    choices = r.settings["deploy"].get("projectChoices", {})
    project_files = [f for f in r.sources if f.startswith("values/projects/")]
    for component, fields in ours.items():
        base = theirs.get(component) or theirs["worker"]  # a launcher the platform's own mode has not
        for name, value in fields.items():
            if value == base.get(name, value) or value in choices.get(name, []) or value is None:
                continue
            what, keys = PINNED_FIELDS[name]
            feeding = [("chart", *key) for key in keys]
            files = sorted({source for path, source in r.origin.items() if source in project_files and any(
                path[:len(key)] == key or key[:len(path)] == path for key in feeding)}) or project_files
            allowed = choices.get(name, [])
            raise DeployError(
                f"{', '.join(files)}: the {component} pods' {what} would be {json.dumps(value)}, but the platform's "
                f"layers (values/{r.env}.yaml, values/base.yaml) give {json.dumps(base[name])}; a project may change "
                f"it only to a value the platform lists in deploy.projectChoices.{name} "
                f"({', '.join(json.dumps(a) for a in allowed) if allowed else 'none listed'}); set through "
                f"{', '.join('chart.' + '.'.join(key) for key in keys)}")
