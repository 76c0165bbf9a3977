"""The progress sidecar (charts/deepspeed-training/files/progress.py), run as the pod runs it, on the files that
the real writers leave: train/rankstate.py (rank 0's progress, every rank's state line), attempts.py (the
ledger's verdict) and the watchdog's hang report. Its patches of the ConfigMap run on a real API server in the
cluster tier (tests/cluster/test_cluster.py)."""

import json
import os
import re
import runpy
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.harness import wait_for
from tests.helm_template import ROOT
from tests.ports import free_port
from tests.prometheus import DASHBOARD, PROMETHEUS, dashboard_queries, query, scraping

FILES = ROOT / "charts" / "deepspeed-training" / "files"
sys.path.insert(0, str(FILES))
import attempts  # noqa: E402 - the pod script itself
import progress  # noqa: E402


def test_the_sidecar_reads_the_contract_the_ranks_and_the_ledger_write():
    from train import rankstate
    assert progress.PROGRESS == rankstate.PROGRESS and progress.VERDICT == attempts.VERDICT
    assert attempts.VERDICT_ENV == rankstate.ATTEMPT_ENV
    assert runpy.run_path(str(FILES / "progress.py"))["PROGRESS"] == rankstate.PROGRESS  # as the pod runs it


RANKS = """
import sys
from train import rankstate
rank, steps = sys.argv[1], int(sys.argv[2])
rankstate.report("starting")
for step in range(1, steps + 1):
    rankstate.beat(step)
rankstate.publish(steps=100, loss=0.5 if rank == "0" else 9.9, tokens_per_s=1234.5, eta_s=61, lr=3e-4,
                  checkpoint_step=steps - 1)
"""


GOODPUT = """
rankstate.publish(mfu=0.41, checkpoint_save_s=0.8, goodput={"productive": 50.0, "startup": 6.0, "restore": 1.0,
                  "save": 2.0, "recomputation": 0.5, "hung": 0.0, "wall": 60.0, "unaccounted": 0.5, "attempts": 1},
                  goodput_line="goodput 83.3% | wall 60.0s = ...")
"""


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


@pytest.fixture
def state_dir(tmp_path):
    directory = tmp_path / "ranks"
    directory.mkdir()
    return directory


def run_ranks(state_dir: Path, attempt: int, failures: int, preemptions: int) -> None:
    """Ranks 0 (7 steps) and 1 (6 steps) of an attempt, as the chart starts them, through the real rankstate. The
    state files are named by pid and the processes are gone: they stay as a live rank's would."""
    env = {**os.environ, "DS_RANK_STATE_DIR": str(state_dir), "DS_ATTEMPT": str(attempt),
           "DS_FAILURES": str(failures), "DS_FAILURE_BUDGET": "2", "DS_PREEMPTIONS": str(preemptions),
           "DS_RUN_ID": f"run-{attempt:04d}-abcd"}
    for rank, steps in (("0", 7), ("1", 6)):
        subprocess.run([sys.executable, "-c", RANKS + GOODPUT, rank, str(steps)], env={**env, "RANK": rank},
                       cwd=ROOT, check=True)


def start_sidecar(state_dir: Path, port: int, *args: str, release: str = "team-a-run") -> subprocess.Popen:
    env = {"PATH": os.environ["PATH"], "DS_RANK_STATE_DIR": str(state_dir), "DS_RELEASE": release,
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(FILES / "progress.py"), "--metrics-port", str(port), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_metrics_show_rank_0s_progress_every_ranks_step_and_the_attempt(state_dir):
    run_ranks(state_dir, attempt=3, failures=1, preemptions=1)
    port = free_port()
    sidecar = start_sidecar(state_dir, port, "--configmap", "job-progress")
    try:
        wait_for(lambda: 'rank="1"' in scrape(port), 30, "the metrics")
        text = scrape(port)
    finally:
        sidecar.terminate()
        out = sidecar.communicate(timeout=30)[0]
    assert sidecar.returncode == 0, out
    # No token here: it says so once and serves the metrics anyway.
    assert re.search(r"no API access: not publishing to ConfigMap job-progress: \w+", out), out
    release = 'release="team-a-run"'
    for line in (f"deepspeed_training_step{{{release}}} 7.0", f"deepspeed_training_steps{{{release}}} 100.0",
                 f"deepspeed_training_loss{{{release}}} 0.5", f"deepspeed_training_tokens_per_second{{{release}}} "
                 "1234.5", f"deepspeed_training_eta_seconds{{{release}}} 61.0",
                 f"deepspeed_training_checkpoint_step{{{release}}} 6.0", f"deepspeed_training_attempt{{{release}}} 3.0",
                 f"deepspeed_training_failures{{{release}}} 1.0", f"deepspeed_training_preemptions{{{release}}} 1.0",
                 f'deepspeed_training_state{{{release},state="training"}} 1.0',
                 f'deepspeed_training_rank_step{{rank="0",{release}}} 7.0',
                 f'deepspeed_training_rank_step{{rank="1",{release}}} 6.0',
                 f'deepspeed_training_goodput_seconds{{bucket="productive",{release}}} 50.0',
                 f'deepspeed_training_goodput_seconds{{bucket="unaccounted",{release}}} 0.5'):
        assert line in text, (line, text)
    assert re.search(r'deepspeed_training_rank_heartbeat_age_seconds\{rank="1",release="team-a-run"} \d', text)


def test_the_configmap_data_says_where_the_job_stands_and_a_failure_keeps_its_hang_report(state_dir, monkeypatch):
    pod = progress.Pod(state_dir)
    monkeypatch.setenv("DS_RANK_STATE_DIR", str(state_dir))
    # The ledger's owner starts attempt 2, rank 0 reports, the watchdog reports a hang, the attempt fails.
    attempts.say("starting", env={"DS_ATTEMPT": "2", "DS_FAILURES": "1", "DS_FAILURE_BUDGET": "2",
                                  "DS_PREEMPTIONS": "0", "DS_RUN_ID": "run-0002-abcd"})
    (state_dir / progress.PROGRESS).write_text(json.dumps(
        {"state": "training", "step": 120, "steps": 300, "loss": 0.40641, "tokens_per_s": 6100.4, "mfu": 0.412,
         "eta_s": 18.2, "checkpoint_step": 100, "attempt": "2", "failures": "1", "failure_budget": "2",
         "preemptions": "0", "run": "run-0002-abcd", "time": time.time() + 1}))  # after the ledger's word
    data: dict[str, str] = {}
    for _, fields in pod.changes():
        data = progress.merge(data, fields)
    assert data["summary"] == ("training | step 120/300 (40.0%) | loss 0.4064 | 6,100 tokens/s | mfu 41.2% | "
                               "eta 0:00:18 | checkpoint at step 100 | attempt 2 (1 of 2 failures used, 0 preemptions)")
    assert pod.changes() == []  # nothing new
    (state_dir / "hang-run-0002-abcd.txt").write_text("hang on w-1 (run-0002-abcd): rank 1 made no progress\nmore\n")
    monkeypatch.setenv("DS_ATTEMPT", "2")
    monkeypatch.setenv("DS_RUN_ID", "run-0002-abcd")
    attempts.end(1)
    for _, fields in pod.changes():
        data = progress.merge(data, fields)
    assert data["state"] == "failed" and data["reason"] == "hang on w-1 (run-0002-abcd): rank 1 made no progress"
    # A failure of its own says what ended, and the next attempt keeps the reason until rank 0 reports.
    data = progress.merge(data, {"state": "failed", "reason": "attempt 3 ended with status 1", "run": "run-3"})
    assert data["reason"] == "attempt 3 ended with status 1" and data["summary"].endswith(data["reason"])
    monkeypatch.setenv("DS_ATTEMPT", "3")
    monkeypatch.setenv("DS_RUN_ID", "run-0003-abcd")
    attempts.end(0)
    for _, fields in pod.changes():
        data = progress.merge(data, fields)
    assert data["state"] == "done" and "reason" not in data  # why an attempt ended is moot once the job is done


@pytest.mark.parametrize("content", ["[1, 2]", "not json", '{"step": "1e999", "loss": "x" }', '{"state": 7}',
                                     '{"step": true, "steps": 0, "eta_s": -5, "mfu": null, "reason": ["a"]}',
                                     json.dumps({"state": "s" * 10_000, "reason": "r" * 10_000})])
def test_a_programs_odd_progress_file_never_takes_the_sidecar_down(state_dir, content):
    (state_dir / progress.PROGRESS).write_text(content)
    (state_dir / "hang-run-1.txt").write_bytes(b"hang \xff\xfe on \x1b]0;owned\x07 w-1\n")  # not UTF-8, escapes
    (state_dir / "12345").write_bytes(b"training rank=0 step=\xff\n")
    data = {"tokensPerSecond": "1e+20x", "step": "many"}  # data a hand or another version wrote
    for _, fields in progress.Pod(state_dir).changes():
        data = progress.merge(data, fields)
    assert all(isinstance(v, str) and len(v) < 1200 for k, v in data.items() if k != "summary")
    assert "percent" not in data and "eta" not in data
    assert not progress.CONTROL.search(data["summary"]) and "\x1b" not in data["reason"]
    assert [r["step"] for r in progress.Pod(state_dir).ranks()] == [None]  # its metrics leave the step out


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary: `make setup` installs Debian's")
def test_a_real_prometheus_scrapes_the_sidecar_and_every_dashboard_query_returns_a_series(state_dir, tmp_path):
    """Every dashboard query returns this release's series, and only them: a sidecar in another namespace that
    claims the same release label (code in a tenant's image can set it) stays off this namespace's panels."""
    run_ranks(state_dir, attempt=1, failures=0, preemptions=0)
    spoof_dir = tmp_path / "team-b"
    spoof_dir.mkdir()
    run_ranks(spoof_dir, attempt=9, failures=2, preemptions=5)
    metrics_port, spoof_port = free_port(), free_port()
    sidecars = [start_sidecar(state_dir, metrics_port), start_sidecar(spoof_dir, spoof_port, release="team-a-run")]
    try:
        with scraping({"team-a": [f"127.0.0.1:{metrics_port}"], "team-b": [f"127.0.0.1:{spoof_port}"]}) as port:
            wait_for(lambda: len(query(port, 'deepspeed_training_rank_step{rank="1"}')) == 2, 60,
                     "prometheus to scrape both")
            exprs = dashboard_queries("team-a", "team-a-run")
            assert len(exprs) >= 14
            for expr in exprs:
                series = query(port, expr)
                assert series and all(s["metric"].get("namespace", "team-a") == "team-a" for s in series), expr
                assert all(s["metric"].get("release", "team-a-run") == "team-a-run" for s in series), expr
            attempt = next(e for e in exprs if e.startswith("deepspeed_training_attempt{"))
            assert [s["value"][1] for s in query(port, attempt)] == ["1"]  # not the spoof's 9
        variables = {v["name"]: v["query"]["query"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                     if v["type"] == "query"}
        assert variables == {"namespace": "label_values(deepspeed_training_step, namespace)",
                             "release": 'label_values(deepspeed_training_step{namespace=~"$namespace"}, release)'}
    finally:
        for sidecar in sidecars:
            sidecar.terminate()
            sidecar.communicate(timeout=30)
