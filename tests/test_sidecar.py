"""The sidecar (podruntime/sidecar.py), run as the pods run it (`python3 -I <scripts> sidecar`), on the files the
real writers leave: train/rankstate.py (rank 0's progress, every rank's state line), podruntime/ledger.py (the
ledger's verdict). Its writes of the progress ConfigMap go to a local stand-in that applies them as the API server
applies a JSON merge patch (the cluster tier patches a real one); its metrics are scraped by a real Prometheus.

Hostile cases beside the legitimate ones: a state directory planted with links, a FIFO and huge files (the sidecar
holds the release's token), and a pod flooding its metrics with ranks and goodput keys."""

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from podruntime import protocol
from podruntime import sidecar as sidecar_module
from podruntime.ledger import Ledger
from podruntime.text import Log
from tests.support.chart import HELM, ROOT, pod_program, render_chart
from tests.support.harness import wait_for
from tests.support.ports import free_port
from tests.support.prometheus import DASHBOARD, PROMETHEUS, dashboard_queries, query, scraping

RANKS = """
import sys
from train import rankstate
rank, steps = sys.argv[1], int(sys.argv[2])
rankstate.report("starting")
for step in range(1, steps + 1):
    rankstate.beat(step)
rankstate.publish(steps=100, loss=0.5 if rank == "0" else 9.9, tokens_per_s=1234.5, eta_s=61, lr=3e-4,
                  checkpoint_step=steps - 1, mfu=0.41, checkpoint_save_s=0.8,
                  goodput={"productive": 50.0, "startup": 6.0, "restore": 1.0, "save": 2.0, "recomputation": 0.5,
                           "hung": 0.0, "wall": 60.0, "unaccounted": 0.5, "attempts": 1},
                  goodput_line="goodput 83.3% | wall 60.0s = ...",
                  fault={"detect": 2.0, "stop": 0.5, "start": 4.0, "total": 6.5, "attempt": 3, "odd": 9.0},
                  fault_line="attempt 3 lost 6.5s to the fault before it: detect 2.0s + stop 0.5s + start 4.0s")
"""


def ledger(state_dir: Path, command: str, tmp: Path | None = None, **env: str) -> dict[str, str]:
    """The ledger as its owner keeps it, writing its verdict into `state_dir`: `begin` returns the attempt's env,
    which `end STATUS` takes."""
    base = {protocol.STATE_DIR_ENV: str(state_dir), "DS_RUN_RETRIES": "2",
            "DS_ATTEMPTS_DIR": str((tmp or state_dir.parent) / "attempts"), "DS_JOB_UID": "abcdef12"}
    book = Ledger({**base, **env}, Log("attempts"))
    words = command.split()
    if words == ["begin"]:
        return book.begin().env
    book.counter = env
    book.end(int(env[protocol.ATTEMPT_ENV["attempt"]]), int(words[1]), [])
    return {}


def run_ranks(state_dir: Path, attempt: int = 1, failures: int = 0, preemptions: int = 0) -> None:
    """Ranks 0 (7 steps) and 1 (6 steps) of an attempt, as the chart starts them, through the real rankstate. Their
    state files are named by pid and the processes are gone: they stay as a live rank's would."""
    env = {**os.environ, protocol.STATE_DIR_ENV: str(state_dir), "DS_ATTEMPT": str(attempt),
           "DS_FAILURES": str(failures), "DS_FAILURE_BUDGET": "2", "DS_PREEMPTIONS": str(preemptions),
           "DS_RUN_ID": f"run-{attempt:04d}-abcd"}
    for rank, steps in (("0", 7), ("1", 6)):
        subprocess.run([sys.executable, "-c", RANKS, rank, str(steps)], env={**env, "RANK": rank}, cwd=ROOT,
                       check=True)


class Sidecar:
    """files/sidecar.py as a pod runs it; its output collected as it comes."""

    def __init__(self, state_dir: Path, *args: str, node_rank: str = "0", kubeconfig: Path | None = None):
        self.port = free_port()
        env = {"PATH": os.environ["PATH"], protocol.STATE_DIR_ENV: str(state_dir), "PYTHONUNBUFFERED": "1",
               "DS_NODE_RANK": node_rank, "POD_NAMESPACE": "ml",
               "KUBECONFIG": str(kubeconfig or state_dir.parent / "no-kubeconfig")}
        self.process = subprocess.Popen([*pod_program("sidecar"), "--metrics-port", str(self.port), *args],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()
        wait_for(lambda: "serving metrics" in self.out(), 30, "the sidecar's metrics", self.out)

    def out(self) -> str:
        return "".join(self.lines)

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            return response.read().decode()

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        self.reader.join(timeout=10)
        assert self.process.returncode == 0, self.out()
        return self.out()


def samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@pytest.fixture
def state_dir(tmp_path):
    directory = tmp_path / "ranks"
    directory.mkdir()
    return directory


# ---------------------------------------------------------------- metrics: each pod its own part

def test_node_rank_0_serves_rank_0s_progress_and_its_ranks_and_the_ledgers_pod_the_job(state_dir):
    run_ranks(state_dir, attempt=3, failures=1, preemptions=1)
    ledger(state_dir, "begin")
    sidecar = Sidecar(state_dir, "--progress", "--job", "--world-size", "2", "--ranks-per-pod", "2")
    try:
        text = sidecar.scrape()
    finally:
        out = sidecar.stop()
    assert "no API access: not publishing" not in out  # no --configmap: nothing to publish
    for line in ("deepspeed_training_step 7.0", "deepspeed_training_steps 100.0", "deepspeed_training_loss 0.5",
                 "deepspeed_training_tokens_per_second 1234.5", "deepspeed_training_eta_seconds 61.0",
                 "deepspeed_training_checkpoint_step 6.0", "deepspeed_training_attempt 1.0",
                 "deepspeed_training_failures 0.0", "deepspeed_training_failure_budget 2.0",
                 'deepspeed_training_state{state="starting"} 1.0', 'deepspeed_training_rank_step{rank="0"} 7.0',
                 'deepspeed_training_rank_step{rank="1"} 6.0',
                 'deepspeed_training_goodput_seconds{bucket="productive"} 50.0',
                 'deepspeed_training_goodput_seconds{bucket="unaccounted"} 0.5',
                 'deepspeed_training_fault_seconds{part="detect"} 2.0',
                 'deepspeed_training_fault_seconds{part="total"} 6.5'):
        assert line in text, (line, text)
    assert 'part="odd"' not in text and 'part="attempt"' not in text  # parts from the fixed set only
    assert re.search(r'^deepspeed_training_rank_heartbeat_age_seconds\{rank="1"} \d', text, re.M)
    assert "release=" not in text  # the PodMonitor labels the release from the pod's own labels


def test_another_workers_sidecar_serves_only_its_own_ranks(state_dir):
    """Any rank may write progress.json (a program of its own): only node rank 0's sidecar publishes it, and only
    the ledger's owner's the job's counter."""
    run_ranks(state_dir)
    ledger(state_dir, "begin")
    sidecar = Sidecar(state_dir, "--progress", "--world-size", "4", "--ranks-per-pod", "2", node_rank="1")
    try:
        text = sidecar.scrape()
    finally:
        sidecar.stop()
    assert {line.split("{")[0].split()[0] for line in samples(text)} == {
        "deepspeed_training_rank_step", "deepspeed_training_rank_step_seconds",
        "deepspeed_training_rank_heartbeat_age_seconds"}, text


# ---------------------------------------------------------------- what the ConfigMap says

def test_the_job_record_says_where_the_job_stands_and_why_the_last_attempt_ended(state_dir, tmp_path):
    """The ledger's verdict and rank 0's progress, as the real writers leave them, in the ConfigMap's fields."""
    sidecar = sidecar_module  # its functions, in-process
    ledger(state_dir, "end 1", tmp=tmp_path, **ledger(state_dir, "begin", tmp=tmp_path))  # attempt 1 failed
    second = ledger(state_dir, "begin", tmp=tmp_path)
    verdict = json.loads((state_dir / protocol.VERDICT).read_text())
    (state_dir / protocol.PROGRESS).write_text(json.dumps(
        {"state": "training", "step": 120, "steps": 300, "loss": 0.40641, "tokens_per_s": 6100.4, "mfu": 0.412,
         "eta_s": 18.2, "checkpoint_step": 100, "time": verdict["time"] + 1}))  # after the attempt began
    rank0 = sidecar.progress_fields(json.loads((state_dir / protocol.PROGRESS).read_text()))
    fields = sidecar.job_fields(verdict, rank0)
    assert sidecar.summary({**rank0, **fields}) == (
        "training | step 120/300 (40.0%) | loss 0.4064 | 6,100 tokens/s | mfu 41.2% | eta 0:00:18 | checkpoint at "
        "step 100 | attempt 2 (1 of 2 failures used, 0 preemptions) | attempt 1 ended: program-error: exit status 1 "
        "(no rank said why: the ranks' log has it)")
    assert fields["cause"] == "program-error" and fields["history"] == "1 program-error (0s)", fields
    # With a bucket: node 0's uploader says where the bucket stands and how far it is behind the volume.
    uploads = sidecar.upload_fields({"committed_step": 80, "lag_steps": 20, "error": "x"})
    assert uploads == {"bucketStep": "80", "uploadLagSteps": "20"}
    assert "| checkpoint at step 100 | bucket at step 80 (20 steps behind) |" in sidecar.summary(
        {**rank0, **uploads, **fields})
    assert sidecar.upload_fields({"committed_step": None, "lag_steps": "1e999"}) == {}
    stale = {**rank0, "progressTime": f"{verdict['time'] - 5:.3f}"}  # rank 0's last word was of attempt 1
    assert sidecar.job_fields(verdict, stale)["state"] == "starting"
    ledger(state_dir, "end 0", tmp=tmp_path, **second)
    done = sidecar.job_fields(json.loads((state_dir / protocol.VERDICT).read_text()), rank0)
    assert done["state"] == "done" and "ended:" not in sidecar.summary({**rank0, **done})
    assert (done["cause"], done["history"]) == ("completed", "1 program-error (0s); 2 completed (0s)"), done
    # Hostile history entries (the ledger runs in the tenant's image) are dropped or bounded, never published raw.
    hostile = [{"attempt": 1, "cause": "hang\x1b[2J"}, {"attempt": True, "cause": "hang"},
               {"attempt": 3, "cause": "hang", "step": "1e999", "seconds": -5, "culprit": "r\u202e" * 400}, "x"]
    assert sidecar.history_entries(hostile) == [{"attempt": 3, "cause": "hang", "culprit": "r " * 150}]
    assert sidecar.history_line(sidecar.history_entries(hostile)) == "3 hang"
    assert sidecar.history_entries("hang") == []
    assert [e["cause"] for e in json.loads(done["attempts"])] == ["program-error", "completed"]


@pytest.mark.parametrize("content", ["[1, 2]", "not json", '{"step": "1e999", "loss": "x" }', '{"state": 7}',
                                     '{"step": true, "steps": 0, "eta_s": -5, "mfu": null, "reason": ["a"]}',
                                     json.dumps({"state": "s" * 10_000, "reason": "r\x1b]0;t\x07" * 10_000,
                                                 "step": 1e300, "goodput_line": "\x1b[2J" * 1000,
                                                 "fault_line": "\x1b]52;c;aGk=\x07" * 1000})])
def test_a_programs_odd_files_are_typed_bounded_and_cleaned(content):
    sidecar = sidecar_module  # its functions, in-process
    record = json.loads(content) if content.startswith(("{", "[")) else content
    record = record if isinstance(record, dict) else {}
    fields = {**sidecar.progress_fields(record), **sidecar.job_fields(record, {})}
    line = sidecar.summary(fields)
    assert all(isinstance(v, str) and len(v) <= 1000 for v in fields.values())
    assert "percent" not in fields and "eta" not in fields and fields["state"] == "pending"
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", line + "".join(fields.values()))


# ---------------------------------------------------------------- hostile: planted files, floods

def test_a_planted_state_directory_leaks_nothing_and_never_blocks_the_sidecar(tmp_path):
    """Links to the sidecar's own files (its token), a FIFO where the verdict goes, a device, huge files: it publishes
    none of them, keeps serving, and its scrapes answer at once."""
    state_dir = tmp_path / "ranks"
    state_dir.mkdir()
    token = tmp_path / "token"
    token.write_text("SECRET-TOKEN-" * 100)
    (state_dir / protocol.PROGRESS).symlink_to(token)
    os.mkfifo(state_dir / protocol.VERDICT)
    (state_dir / "123").symlink_to("/dev/zero")
    (state_dir / "124").write_bytes(b"training rank=0 step=" + b"9" * 10_000_000)
    sidecar = Sidecar(state_dir, "--progress", "--job", "--scale-down", "w", "--world-size", "2")
    try:
        for _ in range(3):
            started = time.monotonic()
            text = sidecar.scrape()
            assert time.monotonic() - started < 2
        assert "SECRET" not in text and 'state="pending"' in text, text
        assert 'deepspeed_training_rank_step{rank="0"}' not in text  # the huge line cut at its bound: no step
    finally:
        out = sidecar.stop()
    assert "SECRET" not in out and "Traceback" not in out, out


def test_a_flood_of_ranks_goodput_keys_and_states_stays_within_the_podmonitors_sample_limit(state_dir):
    """One pod exposed 26,003 series (every goodput key a label value, every digit-named file a rank): now at most
    --ranks-per-pod rank series, each below --world-size, and label values only from fixed sets."""
    for i in range(3000):
        (state_dir / str(100_000 + i)).write_text(f"training rank={i} step={i} step_s=0.1\n")
    (state_dir / protocol.PROGRESS).write_text(json.dumps(
        {"state": "x\nowned", "step": 5, "goodput": {f"k{i}": 1.0 for i in range(2_000)} | {"productive": 2.0},
         "fault": {f"k{i}": 1.0 for i in range(2_000)} | dict.fromkeys((*protocol.FAULT_PARTS, "total"), 1.0)}))
    sidecar = Sidecar(state_dir, "--progress", "--world-size", "16", "--ranks-per-pod", "8")
    try:
        text = sidecar.scrape()
    finally:
        sidecar.stop()
    limit = podmonitor_sample_limit(gpus_per_worker=8)
    assert len(samples(text)) <= limit, (len(samples(text)), limit)
    ranks = {int(r) for r in re.findall(r'rank="(\d+)"', text)}
    assert len(ranks) <= 8 and max(ranks) < 16
    buckets = set(re.findall(r'bucket="([^"]+)"', text))
    assert buckets == {"productive"}, buckets
    assert set(re.findall(r'part="([^"]+)"', text)) == {*protocol.FAULT_PARTS, "total"}


def test_a_pod_that_serves_every_metric_with_every_label_stays_within_the_bound_the_podmonitor_takes(state_dir):
    """The sampleLimit comes from sidecar.sample_bound: a pod serving rank 0's progress, the job's record, the
    bucket's and the peer copy's status and 8 ranks, every labelled metric at every value of its set, is at it."""
    from podruntime import causes
    from podruntime.tenantfiles import Tree
    full = dict.fromkeys((*protocol.GOODPUT_BUCKETS, *protocol.GOODPUT_TOTALS), 1.0)
    (state_dir / protocol.PROGRESS).write_text(json.dumps(
        {"step": 5, "steps": 9, "loss": 1.0, "lr": 1e-4, "tokens_per_s": 9.0, "mfu": 0.1, "eta_s": 3.0,
         "checkpoint_step": 4, "checkpoint_save_s": 0.1, "checkpoint_write_s": 0.2, "time": time.time(),
         "goodput": full, "fault": dict.fromkeys((*protocol.FAULT_PARTS, "total"), 1.0)}))
    (state_dir / protocol.VERDICT).write_text(json.dumps(
        {"state": "starting", "attempt": "2", "failures": "1", "failure_budget": "3", "preemptions": "0",
         "causes": dict.fromkeys(causes.CAUSES, 1)}))
    status = {"uploaded_step": 1, "committed_step": 1, "lag_steps": 0, "seconds": 1.0, "bytes_per_s": 1.0,
              "failures": 0, "replicated_step": 1}
    (state_dir / protocol.PEER_STATUS).write_text(json.dumps(status))
    for rank in range(8):
        (state_dir / str(100 + rank)).write_text(f"training rank={rank} step=5 step_s=0.1\n")
    pod = sidecar_module.Pod(Tree(state_dir), 8, 8)
    served = sum(len(values) for *_, values in sidecar_module.samples(pod, True, True, uploads=status))
    bound = sidecar_module.sample_bound()
    assert served == bound["fixed"] + 8 * bound["perRank"], (served, bound)
    assert podmonitor_sample_limit(gpus_per_worker=8) == served


def podmonitor_sample_limit(gpus_per_worker: int) -> int:
    """The PodMonitor's sampleLimit as the chart renders it."""
    docs = render_chart({"progress": {"podMonitor": True}, "worker": {"gpusPerWorker": gpus_per_worker}},
                        api_versions=["monitoring.coreos.com/v1/PodMonitor"])
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    return monitor["spec"]["sampleLimit"]


# ---------------------------------------------------------------- a real Prometheus, the dashboard

class Exposition(http.server.BaseHTTPRequestHandler):
    """A tenant's own server on a pod's metrics port, claiming another release's label."""

    def do_GET(self):  # noqa: N802
        body = b'deepspeed_training_step{release="victim"} 99\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.skipif(PROMETHEUS is None or HELM is None, reason="needs `prometheus` and helm (make setup)")
def test_a_real_prometheus_scrapes_as_the_podmonitor_does_and_every_dashboard_query_returns_this_release(state_dir,
                                                                                                        tmp_path):
    """The PodMonitor's labels (namespace and release from discovery, honorLabels false, sampleLimit) on a real
    Prometheus: every dashboard query returns this release's series; a pod in another namespace claiming the
    release, and a pod of this namespace whose exposition claims another release, stay off its panels; a flooding
    pod's scrape fails whole instead of filling the database."""
    docs = render_chart({"progress": {"podMonitor": True}}, api_versions=["monitoring.coreos.com/v1/PodMonitor"])
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")["spec"]
    endpoint = monitor["podMetricsEndpoints"][0]
    assert endpoint["honorLabels"] is False and endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "targetLabel": "release",
         "action": "replace"}]
    run_ranks(state_dir)
    ledger(state_dir, "begin")
    other = tmp_path / "team-b"
    other.mkdir()
    run_ranks(other, attempt=9, failures=2, preemptions=5)
    for _ in range(3):
        ledger(other, "begin", tmp=tmp_path / "b")
    flood = tmp_path / "flood"
    flood.mkdir()
    for i in range(400):
        (flood / str(10 + i)).write_text(f"training rank={i} step=1\n")
    spoof = http.server.HTTPServer(("127.0.0.1", free_port()), Exposition)
    threading.Thread(target=spoof.serve_forever, daemon=True).start()
    ours = Sidecar(state_dir, "--progress", "--job", "--world-size", "2", "--ranks-per-pod", "2")
    theirs = Sidecar(other, "--progress", "--job", "--world-size", "2", "--ranks-per-pod", "2")
    flooding = Sidecar(flood, "--progress", "--world-size", "1000", "--ranks-per-pod", "1000")
    try:
        targets = {("team-a", "run"): [f"127.0.0.1:{ours.port}", f"127.0.0.1:{spoof.server_port}"],
                   ("team-b", "run"): [f"127.0.0.1:{theirs.port}"], ("team-a", "flood"): [f"127.0.0.1:{flooding.port}"]}
        with scraping(targets, sample_limit=monitor["sampleLimit"]) as port:
            wait_for(lambda: len(query(port, "up")) == 4 and query(port, 'deepspeed_training_attempt{release="run"}'),
                     60, "prometheus to scrape every target")
            exprs = dashboard_queries("team-a", "run")
            assert len(exprs) >= 14
            for expr in exprs:
                series = query(port, expr)
                assert series, expr
                assert all(s["metric"].get("namespace", "team-a") == "team-a" for s in series), (expr, series)
                assert all(s["metric"].get("release", "run") == "run" for s in series), (expr, series)
            attempt = next(e for e in exprs if e.startswith("deepspeed_training_attempt{"))
            assert [s["value"][1] for s in query(port, attempt)] == ["1"]  # not team-b's 9
            spoofed = query(port, 'deepspeed_training_step{exported_release="victim"}')
            assert [s["metric"]["release"] for s in spoofed] == ["run"]  # its label kept apart, never the release
            assert query(port, 'up{release="flood"}')[0]["value"][1] == "0"  # over the sampleLimit: refused whole
            assert query(port, 'deepspeed_training_rank_step{release="flood"}') == []
        variables = {v["name"]: v["query"]["query"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                     if v["type"] == "query"}
        assert variables == {"namespace": "label_values(deepspeed_training_step, namespace)",
                             "release": 'label_values(deepspeed_training_step{namespace=~"$namespace"}, release)'}
    finally:
        for sidecar in (ours, theirs, flooding):
            sidecar.stop()
        spoof.shutdown()


# ---------------------------------------------------------------- writers: one per key, a bounded rate

class ApiServer(http.server.BaseHTTPRequestHandler):
    """A stand-in for the API server's ConfigMap endpoint: applies a JSON merge patch to `data` as the API server
    does (null removes a key) and records every request."""

    data: dict = {}
    seen: list = []

    def do_GET(self):  # noqa: N802
        self.seen.append(("GET", None, time.monotonic()))
        self.reply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p", "namespace": "ml"},
                    "data": dict(self.data)})

    def do_PATCH(self):  # noqa: N802
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("PATCH", patch, time.monotonic()))
        for key, value in patch.get("data", {}).items():
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
        self.reply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p"}, "data": dict(self.data)})

    def reply(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_one_writer_per_key_at_a_bounded_rate_whatever_the_workers(tmp_path):
    """ssh mode: worker 0 writes rank 0's progress, the launcher the job's record and the summary (reading rank 0's
    keys back), and the other workers nothing, though their ranks write progress files too. The peer copy's step
    that the ConfigMap showed before these pods started, then worker 0's, is noted for the plan (never step 0)."""
    ApiServer.data, ApiServer.seen = {"peerStep": "60"}, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "t", "user": {"token": "t"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    pods = {name: tmp_path / name for name in ("worker-0", "worker-1", "worker-2", "launcher")}
    for directory in pods.values():
        directory.mkdir()
    sidecars = []
    try:
        ledger(pods["launcher"], "begin", tmp=tmp_path)
        for index in range(3):
            sidecars.append(Sidecar(pods[f"worker-{index}"], "--configmap", "p", "--progress", "--world-size", "3",
                                    "--ranks-per-pod", "1", node_rank=str(index), kubeconfig=kubeconfig))
        sidecars.append(Sidecar(pods["launcher"], "--configmap", "p", "--job", kubeconfig=kubeconfig))
        started = time.monotonic()
        for step in range(1, 40):  # every rank writes a progress file each 0.1 s, as a hostile program might
            for index in range(3):
                (pods[f"worker-{index}"] / protocol.PROGRESS).write_text(json.dumps(
                    {"state": "training", "step": step + 1000 * index, "steps": 100, "time": time.time()}))
                (pods[f"worker-{index}"] / protocol.PEER_STATUS).write_text(json.dumps(
                    {"replicated_step": 80 + 1000 * index, "lag_steps": 0}))
            time.sleep(0.1)
        wait_for(lambda: "step 39/100" in ApiServer.data.get("summary", ""), 30, "the summary to follow rank 0",
                 lambda: str(ApiServer.data))
        noted = lambda pod: json.loads((pods[pod] / protocol.JOB_PEER_STEP).read_text())  # noqa: E731
        wait_for(lambda: noted("launcher") == {"step": 80}, 30, "the launcher to note worker 0's peer step",
                 lambda: str(ApiServer.data))
        assert noted("worker-0") == {"step": 60}  # what the ConfigMap showed when its pod started
        took = time.monotonic() - started
    finally:
        outs = [sidecar.stop() for sidecar in sidecars]
        server.shutdown()
    patches = [patch for verb, patch, _ in ApiServer.seen if verb == "PATCH"]
    keys = [set(patch["data"]) for patch in patches]
    progress_keys, job_keys = set(sidecar_module.PROGRESS_KEYS), set(sidecar_module.JOB_KEYS)
    assert all(k <= progress_keys or k <= job_keys for k in keys), keys  # each patch one writer's keys only
    assert ApiServer.data["step"] == "39" and ApiServer.data["state"] == "training", ApiServer.data
    assert all(int(patch["data"].get("step") or 0) < 1000 for patch in patches)  # workers 1, 2: nothing
    # 2 writers, each at most one patch every 2 s (and the launcher's reads): independent of the workers' count.
    assert len(ApiServer.seen) <= 3 * (took / 2 + 2) + 6, (len(ApiServer.seen), took)
    assert all("API requests" in out for out in (outs[0], outs[3]))
