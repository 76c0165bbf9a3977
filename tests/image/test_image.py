"""The built image runs the rendered chart's pods: one launcher and two worker containers on a podman
network, with the pods' hostnames, the ConfigMap/Secret files at their mountPaths, the pods' uid and a
read-only root filesystem. Run by `make test-image` (which builds the image); skipped otherwise."""

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.e2e.harness import Claims, container_env, materialize_volumes, pods_from_render
from tests.helm_template import render_chart
from tests.train_run import cpu_ds_config
from train import checkpoint

IMAGE = os.environ.get("DS_TEST_IMAGE", "")
pytestmark = pytest.mark.skipif(not IMAGE or not shutil.which("podman"),
                                reason="image test: run `make test-image` (builds the image with podman)")


def podman(*args, check=True, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def test_the_image_runs_the_chart_pods():
    repository, _, tag = IMAGE.rpartition(":")
    docs = render_chart({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
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
    names = []
    check = next(p for p in pods if p.component == "config-check")  # Helm's pre-install hook runs first
    pods = [check] + [p for p in pods if p is not check]
    try:
        for pod in pods:  # the config check, then workers in render order; the launcher waits for them anyway
            mounts = materialize_volumes(docs, pod, root / pod.name, claim_dir)
            volumes = []
            for path, source in mounts.items():
                read_only = path.startswith("/etc/deepspeed")
                volumes.append(f"--volume={source}:{path}{':ro' if read_only else ''}")
            env = [f"--env={k}={v}" for k, v in container_env(docs, pod).items()]
            name = f"{run_id}-{pod.name}"
            podman("run", "--detach", f"--name={name}", f"--hostname={pod.hostname}", f"--network={network}",
                   f"--ip={pod.ip}", *hosts, f"--user={pod.uid}:{pod.gid}", "--read-only", "--shm-size=512m",
                   "--cap-drop=ALL", "--security-opt=no-new-privileges", *volumes, *env,
                   f"--workdir={pod.container['workingDir']}", "--pull=never", IMAGE,
                   *pod.container["command"], *pod.container.get("args", []))
            names.append(name)
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
        release_dir = claim_dir("checkpoints", "default/job")  # the subPath of release "job" in "default"
        assert checkpoint.is_complete(release_dir / "step_00000020")
        assert list((release_dir / "monitor" / "image").glob("events.out.tfevents.*")), list(release_dir.rglob("*"))
    finally:
        for name in names:
            podman("rm", "--force", name, check=False)
        podman("network", "rm", "--force", network, check=False)
        shutil.rmtree(root, ignore_errors=True)
