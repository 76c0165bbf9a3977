"""The scale-down after a successful run (launcher.scaleDownWorkers): the launcher pod's progress sidecar
(podruntime/sidecar.py --scale-down, the `kubernetes` client), the only container with a token, patches the workers'
scale once the ledger says the job is done, and never otherwise. Against a local stand-in for the API server that
records what it is sent; the cluster tier (tests/cluster) does it on a real one."""

import http.server
import json
import signal
import subprocess
import threading

import pytest

from podruntime.ledger import Ledger
from tests.support.chart import pod_program
from tests.support.harness import wait_for

SCALE = ("PATCH", "/apis/apps/v1/namespaces/ml/statefulsets/job-worker/scale", "application/strategic-merge-patch+json",
         {"spec": {"replicas": 0}}, "Bearer sidecar-token")


@pytest.fixture
def api(tmp_path):
    """(kubeconfig path, the requests seen)."""
    seen = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.command, self.path, self.headers["Content-Type"], json.loads(body),
                         self.headers.get("Authorization")))
            reply = json.dumps({"apiVersion": "autoscaling/v1", "kind": "Scale", "spec": {"replicas": 0}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "t", "user": {"token": "sidecar-token"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    yield kubeconfig, seen
    server.shutdown()


class Sidecar:
    """The sidecar with --scale-down as the launcher pod runs it (python3 -I), its output collected as it comes."""

    def __init__(self, state_dir, kubeconfig):
        env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "ml",
               "DS_RANK_STATE_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([*pod_program("sidecar"), "--scale-down", "job-worker"], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()
        wait_for(lambda: any("once the job is done" in line for line in self.lines), 30, "the sidecar to start",
                 lambda: "".join(self.lines))

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        self.reader.join(timeout=10)
        assert self.process.returncode == 0, "".join(self.lines)
        return "".join(self.lines)


def say(state_dir, state: str) -> None:
    """The ledger's verdict, written by the real ledger (it runs in the launcher's container)."""
    Ledger({"DS_RANK_STATE_DIR": str(state_dir), "DS_ATTEMPTS_DIR": str(state_dir / "attempts")}).say(state)


def test_the_sidecar_scales_the_workers_down_once_the_ledger_says_done(tmp_path, api):
    kubeconfig, seen = api
    sidecar = Sidecar(tmp_path, kubeconfig)
    try:
        say(tmp_path, "done")
        wait_for(lambda: seen, 30, "the scale-down")
    finally:
        out = sidecar.stop()
    assert seen == [SCALE]  # once: the final look after SIGTERM sends nothing more
    assert "scaled statefulset ml/job-worker to 0 replicas: the run succeeded" in out


@pytest.mark.parametrize("state", ["starting", "failed", "stopping"])
def test_the_workers_stay_up_after_any_other_verdict(tmp_path, api, state):
    """A failed attempt (the next one needs the workers), a stop, an attempt starting: the sidecar's last look after
    SIGTERM, which always comes, sends nothing."""
    kubeconfig, seen = api
    sidecar = Sidecar(tmp_path, kubeconfig)
    say(tmp_path, state)
    sidecar.stop()
    assert seen == []


def test_a_done_verdict_just_before_the_sidecars_sigterm_still_scales_down(tmp_path, api):
    """The kubelet sends the native sidecar SIGTERM as soon as the launcher exits, which may be within the
    sidecar's poll interval after the verdict."""
    kubeconfig, seen = api
    sidecar = Sidecar(tmp_path, kubeconfig)
    say(tmp_path, "done")
    sidecar.stop()
    assert seen == [SCALE]
