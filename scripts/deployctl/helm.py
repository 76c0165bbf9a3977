"""Helm: the render of the manifests (the chart's own checks), the deploy, and the local demo of the same job."""

import os
import re
import shlex
import shutil
import subprocess

from scripts.deployctl import common
from scripts.deployctl.common import DeployError, blame, write_file
from scripts.deployctl.layers import release_of
from scripts.deployctl.render import Rendered


def release_name(r: Rendered) -> str:
    return release_of(r.settings, r.project)


def helm() -> str:
    found = shutil.which("helm") or shutil.which("helm", path=str(common.ROOT / ".tools" / "bin"))
    if not found:
        raise DeployError("helm not found: run `make setup`")
    return found


def helm_args(r: Rendered, context: str | None) -> list[str]:
    args = ["--namespace", r.settings["deploy"]["namespace"]]
    return args + (["--kube-context", context] if context else [])


def run(cmd: list[str], dry_run: bool = False, env: dict | None = None) -> int:
    print("+ " + shlex.join(cmd), flush=True)
    return 0 if dry_run else subprocess.run(cmd, env=env).returncode


def helm_message(stderr: str) -> str:
    """helm's error on one line: without its "Error:" prefixes, template positions and --debug hint."""
    lines = []
    for line in stderr.splitlines():
        line = re.sub(r"^Error: (execution error at \([^)]*\): )?", "", line.strip())
        if line and not line.startswith("Use --debug") and line != "deepspeed-training:":
            lines.append(line.lstrip("- "))
    return "; ".join(lines)


def blame_chart_error(r: Rendered, stderr: str) -> str:
    named = blame(r.origin, ("chart",), stderr)
    return f" ({', '.join(named)})" if named else ""


def helm_template(r: Rendered, release: str | None = None, namespace: str | None = None) -> str:
    """The manifests Helm would apply (the chart's own checks run here too); `r` as another release would
    render it."""
    cmd = [helm(), "template", release or release_name(r), str(common.CHART), "-f", str(r.out / "values.yaml"),
           "--namespace", namespace or r.settings["deploy"]["namespace"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        where = f"{r.out.relative_to(common.ROOT)}/values.yaml{blame_chart_error(r, proc.stderr)}"
        raise DeployError(f"the chart refuses {where}: {helm_message(proc.stderr)}")
    write_file(r.out / "manifests.yaml", proc.stdout)
    return proc.stdout


def deploy(r: Rendered, context: str | None, dry_run: bool, wait: bool, manifests: str) -> int:
    cmd = [helm(), "upgrade", "--install", release_name(r), str(common.CHART), "-f", str(r.out / "values.yaml"),
           *helm_args(r, context), "--create-namespace"]
    if wait or r.settings["deploy"]["wait"]:
        cmd += ["--wait", "--timeout", r.settings["deploy"]["timeout"]]
    if dry_run:
        print("DRY_RUN: not applied. It would apply:")
        for doc in common.manifest_docs(manifests):
            print(f"  {doc['kind']:<16} {r.settings['deploy']['namespace']}/{doc['metadata']['name']}")
        print(f"  (full manifests: {(r.out / 'manifests.yaml').relative_to(common.ROOT)})")
    return run(cmd, dry_run)


def demo(r: Rendered, manifests: str) -> int:
    """The rendered program as a local DeepSpeed job, one rank per worker slot: the `deepspeed` command of the
    chart's Job (the launcher's, or in launchMode nossh the workers'), so the chart's program conventions apply,
    with its pod paths pointed at build/."""
    ckpt = common.BUILD / "demo" / (r.project or "base") / "checkpoints"  # one per project: programs differ
    job = next(doc for doc in common.manifest_docs(manifests) if doc["kind"] == "Job")
    launcher = job["spec"]["template"]["spec"]["containers"][0]
    runner = launcher["args"]
    start = next(i for i, arg in enumerate(runner[1:], 1) if not arg.startswith("--"))  # files/rank-log.py
    chart_env = {e["name"]: e["value"] for e in launcher["env"] if "value" in e}
    scripts = next(m["mountPath"] for m in launcher["volumeMounts"] if runner[start].startswith(m["mountPath"] + "/"))
    local = {scripts: str(common.CHART / "files"), chart_env["DS_CONFIG_PATH"]: str(r.out / "ds_config.json"),
             chart_env["DS_TRAIN_CONFIG_PATH"]: str(r.out / "train_config.json"),
             chart_env["DS_CHECKPOINT_DIR"]: str(ckpt),
             common.IMAGE_EXAMPLES: str(common.ROOT / "examples")}
    program = []
    for arg in runner[start:]:
        for pod_path, local_path in local.items():
            arg = arg.replace(pod_path, local_path)
        program.append(arg)
    cmd = ["deepspeed", "--num_gpus", str(r.world_size), *program]
    env = dict(os.environ)
    for item in r.effective["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
    env["DEEPSPEED_TIMEOUT"] = chart_env["DEEPSPEED_TIMEOUT"]  # the one collective timeout, as the pods get it
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"demo: world size {r.world_size} on this machine ({r.world_size} CPU ranks)", flush=True)
    if not shutil.which("deepspeed"):
        raise DeployError("deepspeed is not on PATH: run `make setup`, then `make demo` (the Makefile adds .venv/bin)")
    code = run(cmd, env=env)
    if code == 0:
        print(f"demo: done; checkpoints in {ckpt.relative_to(common.ROOT)}. A rerun resumes from the last checkpoint; "
              f"`rm -rf {ckpt.relative_to(common.ROOT)}` starts over.")
    return code
