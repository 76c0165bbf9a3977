"""The built images run the rendered chart's pods: one launcher and two worker containers on a podman network, with
the pods' hostnames, the ConfigMap/Secret files at their mountPaths, the pods' uid and a read-only root filesystem,
each beside its progress sidecar in the sidecar image (sharing the pod's /tmp). Run by `make test-image` (which
builds both images); skipped otherwise."""

import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.chart import render_chart
from tests.support.harness import Claims, Pod, container_env, materialize_volumes, pods_from_render
from tests.support.train_run import cpu_ds_config
from train import checkpoint

IMAGE = os.environ.get("DS_TEST_IMAGE", "")
SIDECAR_IMAGE = os.environ.get("DS_TEST_SIDECAR_IMAGE", "")
pytestmark = pytest.mark.skipif(not IMAGE or not SIDECAR_IMAGE or not shutil.which("podman"),
                                reason="image test: run `make test-image` (builds the images with podman)")


def podman(*args, check=True, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def sidecar_of(docs: list[dict], pod: Pod) -> Pod | None:
    """The pod's progress sidecar (its native sidecar init container), as a Pod of its own that shares the pod's
    volumes."""
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Job") and pod.name.startswith(doc["metadata"]["name"]):
            spec = doc["spec"]["template"]["spec"]
            sidecars = [c for c in spec.get("initContainers", []) if c["name"] == "progress"]
            if sidecars:
                return Pod(pod.name, pod.component, pod.hostname, sidecars[0], spec["volumes"], pod.uid, pod.gid,
                           labels=pod.labels, controller_env=pod.controller_env)
    return None


def metrics(container: str) -> str:
    """What the sidecar serves on its metrics port, fetched inside its own container (its python3)."""
    return podman("exec", container, "python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                  "'http://127.0.0.1:9400/metrics', timeout=5).read().decode())", check=False).stdout


def test_the_images_run_the_chart_pods():
    repository, _, tag = IMAGE.rpartition(":")
    docs = render_chart({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        # The sidecar in its own image. No API server here: the release's account is not created, so the sidecar
        # mounts no token and serves metrics only.
        "progress": {"image": SIDECAR_IMAGE}, "serviceAccount": {"create": False, "name": "trainer"},
        "worker": {"replicas": 2, "gpusPerWorker": 1, "gpuResourceName": ""},
        "launcher": {"scaleDownWorkers": False}, "job": {"waitTimeoutSeconds": 120},
        # TensorBoard is in the base image; the chart puts the event files under the release's checkpoints.
        "deepspeed": {"config": {**cpu_ds_config(stage=2, micro=4), "tensorboard": {"enabled": True,
                                                                                    "job_name": "image"}}},
        "train": {"config": {"steps": 20, "log_every": 5, "checkpoint_every": 10,
                             "model": {"n_layer": 2, "d_model": 64, "seq_len": 32}}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
        "checkpoints": {"existingClaim": "checkpoints"},
    })
    pods = pods_from_render(docs)
    run_id = uuid.uuid4().hex[:6]
    network, subnet = f"ds-test-{run_id}", "10.89.231"
    root = Path(tempfile.mkdtemp(prefix=f"ds-image-{run_id}-"))
    root.chmod(0o755)
    claim_dir = Claims(root)

    for i, pod in enumerate(pods):
        pod.ip = f"{subnet}.{10 + i}"
    hosts = [f"--add-host={p.fqdn}:{p.ip}" for p in pods if p.fqdn]
    podman("network", "create", "--subnet", f"{subnet}.0/24", network)
    names, sidecars = [], {}
    check = next(p for p in pods if p.component == "config-check")  # Helm's pre-install hook runs first
    pods = [check] + [p for p in pods if p is not check]

    def run(pod: Pod, name: str, image: str, *network_args: str) -> None:
        mounts = materialize_volumes(docs, pod, root / pod.name, claim_dir)  # a pod's sidecar: the same dirs
        volumes = [f"--volume={source}:{path}{':ro' if path.startswith('/etc/deepspeed') else ''}"
                   for path, source in mounts.items()]
        env = [f"--env={k}={v}" for k, v in container_env(docs, pod).items()]
        workdir = [f"--workdir={pod.container['workingDir']}"] if "workingDir" in pod.container else []
        podman("run", "--detach", f"--name={name}", f"--hostname={pod.hostname}", *network_args,
               f"--user={pod.uid}:{pod.gid}", "--read-only", "--shm-size=512m", "--cap-drop=ALL",
               "--security-opt=no-new-privileges", *volumes, *env, *workdir, "--pull=never", image,
               *pod.container["command"], *pod.container.get("args", []))
        names.append(name)

    try:
        for pod in pods:  # the config check, then workers in render order; the launcher waits for them anyway
            name = f"{run_id}-{pod.name}"
            if (sidecar := sidecar_of(docs, pod)) is not None:  # a native sidecar starts before the main container
                sidecars[pod.name] = f"{name}-progress"
                run(sidecar, f"{name}-progress", SIDECAR_IMAGE, "--network=none")
            run(pod, name, IMAGE, f"--network={network}", f"--ip={pod.ip}", *hosts)
            if pod is check:  # the train package's check, in the image, as the pods' user on a read-only root
                code = int(podman("wait", name, timeout=300).stdout.strip())
                logs = podman("logs", name)
                log = logs.stdout + logs.stderr
                assert code == 0 and "config check passed: ds_config for 2 data-parallel ranks" in log, log
        launcher = next(f"{run_id}-{p.name}" for p in pods if p.component == "launcher")
        code = int(podman("wait", launcher, timeout=900).stdout.strip())
        log = podman("logs", launcher).stdout + podman("logs", launcher).stderr
        assert code == 0, log[-6000:]
        assert "wait-for-workers: all 2 workers are reachable" in log
        assert "[rank 0] INFO step 20/20" in log
        # The sidecars, in their own image, read what the ranks and the ledger wrote in their pod's /tmp.
        worker0 = next(v for k, v in sidecars.items() if k.endswith("-worker-0"))
        launcher_sidecar = next(v for k, v in sidecars.items() if "-launcher-" in k)
        assert re.search(r"^deepspeed_training_step(\{[^}]*\})? 20\.0$", metrics(worker0), re.M), \
            metrics(worker0) + podman("logs", worker0).stdout
        assert re.search(r"^deepspeed_training_attempt(\{[^}]*\})? 1\.0$", metrics(launcher_sidecar), re.M), \
            metrics(launcher_sidecar) + podman("logs", launcher_sidecar).stdout
        release_dir = claim_dir("checkpoints", "default/job")  # the subPath of release "job" in "default"
        assert checkpoint.is_complete(release_dir / "step_00000020")
        assert list((release_dir / "monitor" / "image").glob("events.out.tfevents.*")), list(release_dir.rglob("*"))
    finally:
        for name in names:
            podman("rm", "--force", name, check=False)
        podman("network", "rm", "--force", network, check=False)
        shutil.rmtree(root, ignore_errors=True)
