"""The pods' scripts from charts/deepspeed-training/files, run for real: a non-root sshd per worker host
and the launcher's wait-for-workers check, in network namespaces built from the rendered chart."""

import time

import pytest

from tests.e2e.harness import Cluster, ensure_user, namespaces_available
from tests.helm_template import HELM, render_chart

REASON = namespaces_available() or (None if HELM else "no helm binary; run `make setup`")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SCRIPTS, CONFIG = "/etc/deepspeed/scripts", "/etc/deepspeed/config"
WAIT = f"source {SCRIPTS}/ssh-setup.sh && bash {SCRIPTS}/wait-for-workers.sh"


@pytest.fixture(scope="module")
def docs():
    docs = render_chart({"worker": {"replicas": 2, "gpuResourceName": ""}})
    job = next(d for d in docs if d["kind"] == "Job")
    ensure_user(job["spec"]["template"]["spec"]["securityContext"]["runAsUser"], "/home/deepspeed")
    return docs


def start_workers(cluster, count):
    cluster.start_workers(count)
    return cluster.pods_of("launcher")[0]


def test_wait_for_workers_succeeds_once_every_worker_accepts_ssh(docs):
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 2)
        result = cluster.exec(launcher, ["bash", "-c", f"{WAIT} {CONFIG}/hostfile 30 1"], timeout=60)
        assert result.returncode == 0, result.stdout
        assert "all 2 workers are reachable" in result.stdout
        # Logged in as the pod's non-root user, with StrictHostKeyChecking on.
        who = cluster.exec(launcher, ["bash", "-c", f"source {SCRIPTS}/ssh-setup.sh && ssh -F ~/.ssh/config "
                                      f"{cluster.pods_of('worker')[1].fqdn} 'id -u; hostname'"], timeout=30)
        assert who.stdout.split() == [str(launcher.uid), cluster.pods_of("worker")[1].hostname], who.stdout


def test_wait_for_workers_fails_at_the_deadline_naming_the_missing_host(docs):
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 1)
        started = time.monotonic()
        result = cluster.exec(launcher, ["bash", "-c", f"{WAIT} {CONFIG}/hostfile 4 1"], timeout=60)
        elapsed = time.monotonic() - started
        assert result.returncode == 1, result.stdout
        present, missing = (p.fqdn for p in cluster.pods_of("worker"))
        assert "1/2 ready; waiting for: " + missing in result.stdout
        assert "1 of 2 workers still unreachable after 4s" in result.stdout
        assert f"  {missing}: SSH failed" in result.stdout
        assert f"  {present}:" not in result.stdout
        assert elapsed < 30


def test_wait_for_workers_reports_hosts_without_dns(docs):
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 0)
        script = f"echo 'nowhere.invalid slots=1' > /tmp/hosts && {WAIT} /tmp/hosts 1 1"
        result = cluster.exec(launcher, ["bash", "-c", script], timeout=30)
        assert result.returncode == 1
        assert "  nowhere.invalid: no DNS record" in result.stdout


def test_a_worker_with_another_host_key_is_refused(docs):
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 2)
        script = (f"source {SCRIPTS}/ssh-setup.sh && ssh-keygen -q -t ecdsa -N '' -f /tmp/other && "
                  "echo \"[*.$DS_WORKER_DOMAIN]:2222 $(cat /tmp/other.pub)\" > ~/.ssh/known_hosts && "
                  f"bash {SCRIPTS}/wait-for-workers.sh {CONFIG}/hostfile 1 1")
        result = cluster.exec(launcher, ["bash", "-c", script], timeout=30)
        assert result.returncode == 1
        assert "Host key verification failed" in result.stdout

