"""`render_chart()`: the real `helm template` of the chart, parsed. Tests assert fields of what it returns."""

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.deployctl.common import manifest_docs

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "deepspeed-training"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
IMAGE = {"image": {"repository": "registry.example.com/ml/deepspeed-train"}}


def helm_binaries() -> dict[str, str]:
    """{'helm4': path, 'helm3': path} for the pinned helms that exist (scripts/install-tools.sh)."""
    found = {}
    for name, binary in (("helm4", os.environ.get("HELM", "helm")), ("helm3", "helm3")):
        path = shutil.which(binary) or shutil.which(binary, path=str(ROOT / ".tools" / "bin"))
        if path:
            found[name] = path
    return found


HELM = helm_binaries().get("helm4")


class HelmError(RuntimeError):
    def __init__(self, stderr: str):
        super().__init__(stderr)
        self.stderr = stderr


def render_chart(values: dict | None = None, *, show_only: list[str] | None = None, values_files=(),
                 helm: str | None = None, release: str = "job", namespace: str = "default",
                 with_image: bool = True, api_versions=()) -> list[dict]:
    """Renders the chart with `values` (merged over the ci/default image unless with_image=False) and
    returns its documents; `api_versions` are what the cluster would serve (`--api-versions`). Raises HelmError
    with helm's stderr when helm refuses."""
    helm = helm or HELM
    if helm is None:
        raise RuntimeError("no helm binary: run `make setup`")
    key = json.dumps([values, show_only, [(str(f), Path(f).read_text()) for f in values_files], helm, release,
                      namespace, with_image, list(api_versions)], sort_keys=True, default=str)
    if key not in _renders:
        try:
            _renders[key] = _render(values, show_only, values_files, helm, release, namespace, with_image,
                                    api_versions)
        except HelmError as refused:
            _renders[key] = refused
    if isinstance(_renders[key], HelmError):
        raise HelmError(_renders[key].stderr)
    return copy.deepcopy(_renders[key])


# Renders by their inputs, in this process: the same values rendered again (another Kubernetes minor, another
# check of one release) read the first render instead of running helm again. The chart cannot change under a
# test session.
_renders: dict[str, "list[dict] | HelmError"] = {}


def _render(values, show_only, values_files, helm, release, namespace, with_image, api_versions) -> list[dict]:
    cmd = [helm, "template", release, str(CHART), "--namespace", namespace]
    with tempfile.TemporaryDirectory() as tmp:
        def write(i: int, layer: dict) -> Path:
            path = Path(tmp) / f"values-{i}.yaml"
            path.write_text(json.dumps(layer))  # JSON: no YAML 1.1/1.2 disagreement on "n", "y", "0370e25"
            return path

        files = ([write(0, IMAGE)] if with_image else []) + list(values_files) + ([write(1, values)] if values else [])
        for f in files:
            cmd += ["--values", str(f)]
        for api in api_versions:
            cmd += ["--api-versions", api]
        for template in show_only or []:
            cmd += ["--show-only", f"templates/{template}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HelmError(proc.stderr)
    return manifest_docs(proc.stdout)


def is_hook(doc: dict) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    """The release's objects of `kind`; Helm's hooks (the config check) run before them and are not among them."""
    return [d for d in docs if d["kind"] == kind and not is_hook(d)]


def hooks(docs: list[dict]) -> list[dict]:
    return [d for d in docs if is_hook(d)]


def release_workloads(docs: list[dict]) -> list[dict]:
    """The release's StatefulSet and Jobs (the ranks' pods and the launcher), not the config check's hook Job."""
    return by_kind(docs, "StatefulSet") + by_kind(docs, "Job")


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    matches = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in matches]}"
    return matches[0]


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(workload: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(workload)["env"]}

SCRIPTS = CHART / "files"  # the pods' scripts directory, which runs as a program (files/__main__.py)


def pod_program(program: str, *args: str) -> list[str]:
    """A pod program's command as the pods run it: `python3 -I <scripts> PROGRAM ARGS` (podruntime/cli.py), the
    chart's own files."""
    return [sys.executable, "-I", str(SCRIPTS), program, *args]
