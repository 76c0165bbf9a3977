"""A real Prometheus (Debian's `prometheus`, which `make setup` installs) for the tests: scrape targets, query,
and the dashboard's queries (charts/deepspeed-training/dashboards/deepspeed-training.json)."""

import contextlib
import json
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from tests.support.chart import ROOT
from tests.support.ports import free_port

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = ROOT / "charts" / "deepspeed-training" / "dashboards" / "deepspeed-training.json"


def query(port: int, expr: str) -> list:
    """The series `expr` returns now ([] while Prometheus is not up)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.loads(response.read())
    except OSError:
        return []
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def dashboard_queries(namespace: str, release: str) -> list[str]:
    """Every query of the dashboard, for one release (its `$namespace` and `$release` variables)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$namespace", namespace).replace("$release", release)
            for p in dashboard["panels"] for t in p["targets"]]


@contextlib.contextmanager
def scraping(targets: dict[tuple[str, str], list[str]], sample_limit: int = 0):
    """A Prometheus scraping targets (host:port) every second, each group labelled with its (namespace, release) as
    the chart's PodMonitor labels a pod (its namespace and its `app.kubernetes.io/instance` from discovery, labels
    the target cannot set: honor_labels false), with the PodMonitor's sampleLimit; yields its HTTP port."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
            {"job_name": "deepspeed", "honor_labels": False, "sample_limit": sample_limit,
             "static_configs": [{"targets": hosts, "labels": {"namespace": namespace, "release": release}}
                                for (namespace, release), hosts in targets.items()]}]}))
        server = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp}/tsdb",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            yield port
        finally:
            server.terminate()
            server.wait(timeout=30)
