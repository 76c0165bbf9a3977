"""The launcher's scale-down step (files/scale-workers.py, the `kubernetes` client) and what it sends."""

import http.server
import json
import subprocess
import sys
import threading

from tests.helm_template import CHART


def test_scale_workers_patches_only_the_worker_scale(tmp_path):
    """files/scale-workers.py against a local stand-in for the API server, recording what it is sent."""
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
        "users": [{"name": "t", "user": {"token": "launcher-token"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "DS_WORKER_STATEFULSET": "job-worker",
           "POD_NAMESPACE": "ml"}
    try:
        result = subprocess.run([sys.executable, str(CHART / "files" / "scale-workers.py")], env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert "scaled statefulset ml/job-worker to 0 replicas" in result.stdout
    assert seen == [("PATCH", "/apis/apps/v1/namespaces/ml/statefulsets/job-worker/scale",
                     "application/strategic-merge-patch+json", {"spec": {"replicas": 0}}, "Bearer launcher-token")]
