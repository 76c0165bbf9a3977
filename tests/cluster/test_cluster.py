"""Cluster tier: installs the chart on a real Kubernetes cluster and waits for the launcher Job to succeed.

Runs only when KUBECONFIG points at a reachable cluster and DS_IMAGE names the CPU image the cluster can pull
(kind: `make image` then `kind load docker-image $DS_IMAGE`; see the README's "Testing on kind"). CPU
workers are enough. Elsewhere it skips with the reason; the e2e tier runs the same rendered pods without a
cluster.
"""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helm_template import CHART, HELM

KUBECONFIG, IMAGE = os.environ.get("KUBECONFIG", ""), os.environ.get("DS_IMAGE", "")


def skip_reason() -> str | None:
    if not KUBECONFIG or not Path(KUBECONFIG).is_file():
        return "no cluster: KUBECONFIG is not set to a kubeconfig file (kind: `kind create cluster`)"
    if not IMAGE:
        return "DS_IMAGE is not set: build the CPU image (make image) and load it into the cluster"
    if HELM is None:
        return "no helm binary; run `make setup`"
    probe = subprocess.run(["kubectl", "cluster-info", "--request-timeout=5s"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the cluster in {KUBECONFIG} does not answer: {probe.stderr.strip()[:200]}"
    return None


REASON = skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_the_chart_trains_on_a_cluster(kube_cluster, namespace_factory):
    from pytest_helm_charts.k8s.job import wait_for_jobs_to_complete

    namespace = namespace_factory(f"ds-test-{uuid.uuid4().hex[:6]}").metadata["name"]
    repository, _, tag = IMAGE.rpartition(":")
    release = "smoke"
    subprocess.run([HELM, "install", release, str(CHART), "--namespace", namespace,
                    "-f", str(CHART / "ci" / "02-cpu-only-values.yaml"), "--set", f"image.repository={repository}",
                    "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent",
                    "--set", "train.config.steps=20"], check=True)
    try:
        launcher = f"{release}-deepspeed-training-launcher-1"  # per Helm revision
        wait_for_jobs_to_complete(kube_cluster.kube_client, [launcher], namespace, timeout_sec=900)
        logs = kube_cluster.kubectl(f"logs job/{launcher}", namespace=namespace, output_format="")
        assert "wait-for-workers: all 2 workers are reachable" in logs
        assert "INFO step 20/20" in logs
        scale = kube_cluster.kubectl(f"get statefulset {release}-deepspeed-training-worker", namespace=namespace)
        assert scale["spec"]["replicas"] == 0  # scaled down by the launcher after success
    finally:
        subprocess.run([HELM, "uninstall", release, "--namespace", namespace], check=False)
