"""The pods' run-time protocol (train/podstate.py), one owner for both sides: the chart's copies are the owner's
(scripts/chart_data.py --check), every pod script reads its copy, the sidecar's reads trust nothing in the state
directory, and a hang's verdict is merged by evidence (the culprit named whichever host reports it)."""

import json
import os
import re
import runpy
import subprocess
import sys
import time

import pytest

from tests.support.chart import CHART, ROOT
from train import podstate

FILES = CHART / "files"


def test_the_charts_copies_are_the_owners_and_every_pod_script_reads_them():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chart_data.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert (FILES / "generated" / "podstate.py").read_bytes() == (ROOT / "train" / "podstate.py").read_bytes()
    for script in ("watchdog.py", "attempts.py", "sidecar.py"):
        module = runpy.run_path(str(FILES / script))["podstate"]
        assert module.__file__ == str(FILES / "generated" / "podstate.py") and module.VERSION == podstate.VERSION
    for script in ("launcher.sh", "nossh-worker.sh", "kill-ranks.sh"):
        assert "/generated/podstate.sh\"" in (FILES / script).read_text(), script
    shell = subprocess.run(["bash", "-c", f"source {FILES}/generated/podstate.sh; echo $NOTHING_TO_SAVE_STATES "
                            "$EXIT_NOT_RETRIED $EXIT_STOPPED"], capture_output=True, text=True, check=True)
    assert shell.stdout.split() == [*podstate.NOTHING_TO_SAVE_STATES, str(podstate.EXIT_NOT_RETRIED),
                                    str(podstate.EXIT_STOPPED)]


def test_run_ids_round_trip_and_stay_one_path_component():
    assert podstate.run_id(3, "1a2b3c4d-5e6f") == "run-0003-1a2b3c4d"
    assert podstate.parse_run_id("run-0003-1a2b3c4d") == (3, "1a2b3c4d")
    assert podstate.run_id(1, "../../x; rm") == "run-0001-xrm"
    assert podstate.parse_run_id("run-1-x") is None and podstate.parse_run_id("../run-0001-x") is None


# ---------------------------------------------------------------- reads that trust nothing

@pytest.fixture
def planted(tmp_path):
    """A state directory a hostile tenant prepared: links to a secret of the reader's, a FIFO, a device, a huge file
    and a directory where a file was expected, beside a legitimate record."""
    state = tmp_path / "ranks"
    state.mkdir()
    secret = tmp_path / "token"
    secret.write_text("the reader's own token")
    (state / podstate.PROGRESS).symlink_to(secret)
    (state / "12345").symlink_to("/dev/zero")
    os.mkfifo(state / podstate.VERDICT)
    (state / "hang-run-0001-abc.json").write_bytes(b"{" + b" " * (podstate.MAX_RECORD_BYTES + 10) + b"}")
    (state / "777").mkdir()
    (state / "888").write_text("training rank=1 step=7\n")
    return state, secret


def test_the_state_directory_reader_follows_no_link_opens_no_fifo_and_bounds_every_read(planted):
    state, secret = planted
    reader = podstate.StateDir(state)
    started = time.monotonic()
    assert reader.read(podstate.PROGRESS) is None  # a link to the reader's own files: not followed
    assert reader.read("12345") is None and reader.read("777") is None  # a device, a directory
    assert reader.read(podstate.VERDICT) is None  # a FIFO: refused at once, not waited on
    assert reader.read_json("hang-run-0001-abc.json") is None  # past the bound: refused whole
    assert reader.read("../token") is None and reader.read("") is None
    assert reader.read("888", 8)[0] == b"training" and time.monotonic() - started < 1
    assert reader.names(podstate.RANK_FILE) == ["12345", "777", "888"]
    # The directory itself replaced by a link (to the reader's own files): nothing is read through it.
    linked = state.parent / "linked"
    linked.symlink_to(secret.parent)
    assert podstate.StateDir(linked).read("token") is None and podstate.StateDir(linked).names() == []


def test_published_text_is_one_bounded_line():
    assert podstate.clean("a\x1b]52;c;x\x07b\u202ec\nd" + "e" * 1000, 20) == "a ]52;c;x b c d" + "e" * 5


# ---------------------------------------------------------------- the verdict on a hang, by evidence

def report(host: str, *ranks: tuple) -> dict:
    return podstate.hang_report(host, "run-0002-abc", time.time(), [
        podstate.hang_rank(rank, host, kind, beat, 200, "training", where) for rank, kind, beat, where in ranks])


@pytest.mark.parametrize("order", ["culprit first", "victim first"])
def test_a_stopped_rank_on_the_second_host_is_the_culprit_not_the_first_hosts_waiting_rank(order):
    """The defect this fixes: worker 0's report (its rank waits in all_reduce, reported first, with the newer beat)
    was published as the reason; the rank that cannot run is named whichever host reports it."""
    victim = report("w-0", (0, "in-collective", 1000.0, "waits in a collective: all_reduce"))
    culprit = report("w-1", (1, "stopped", 990.0, "process stopped (T (stopped))"))
    reports = [culprit, victim] if order == "culprit first" else [victim, culprit]
    merged = podstate.merge_hang_reports(reports)
    assert (merged["culprit"]["rank"], merged["culprit"]["host"]) == (1, "w-1")
    assert [v["rank"] for v in merged["victims"]] == [0]
    assert merged["reason"].startswith("hang: rank 1 on w-1 is the likely culprit (its process is stopped")
    assert "1 rank waits for it in collectives (rank 0 on w-0)" in merged["reason"]


def test_among_ranks_with_evidence_against_them_the_oldest_beat_is_the_culprit():
    merged = podstate.merge_hang_reports([
        report("w-0", (0, "outside-collective", 1005.0, "in read (x.py:3)")),
        report("w-1", (1, "unresponsive", 1001.0, "no stack (process D)"), (2, "in-collective", 900.0, "waits"))])
    assert merged["culprit"]["rank"] == 1  # before rank 0 (a newer beat) and rank 2 (it only waits)
    assert podstate.merge_hang_reports([]) is None


@pytest.mark.parametrize("hostile", [[1, 2], {"v": 99, "ranks": []}, {"v": 1, "ranks": [{"kind": "rm -rf"}]},
                                     {"v": 1, "ranks": "x"}, {"v": 1, "host": "h\x1b[2J" * 200, "ranks": [
                                         {"rank": "0", "kind": "stopped", "last_beat": 1, "where": "w" * 5000}]}])
def test_a_hang_report_from_a_tenants_container_is_typed_and_bounded(hostile):
    report = podstate.valid_hang_report(hostile)
    if report is not None:
        assert len(report["host"]) <= 253 and "\x1b" not in report["host"]
        assert all(len(r["where"]) <= podstate.MAX_TEXT for r in report["ranks"])
        assert json.loads(json.dumps(report)) == report
    else:
        assert not (isinstance(hostile, dict) and hostile.get("ranks") and re.search("stopped", str(hostile)))


# ---------------------------------------------------------------- the two sides ship apart: a version, a skew rule

def test_a_chart_of_another_protocol_version_is_refused_at_the_check_and_at_the_ranks_start(tmp_path):
    """The image's train package and the chart's copy differ after an upgrade of either: the config check (helm
    install) and every rank at start refuse the pair in one line naming both versions, with a configuration
    error's status (never retried); the same version, or no chart (a local run), passes."""
    podstate.check_version(str(podstate.VERSION), "x")
    podstate.check_version(None, "x")
    with pytest.raises(podstate.VersionSkew, match=f"speak run-state protocol version 99, this image's train "
                                                   f"package version {podstate.VERSION}"):
        podstate.check_version("99", "x")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    env = {**os.environ, podstate.PROTOCOL_ENV: "99", "DS_CONFIG_PATH": str(ds_config), "DS_WORLD_SIZE": "1",
           "DS_ACCELERATOR": "cpu"}
    check = subprocess.run([sys.executable, "-m", "train.preflight"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == podstate.EXIT_CONFIG_ERROR, check.stderr
    assert check.stderr.strip().splitlines() == [
        f"config check failed: config check: the chart's pod scripts speak run-state protocol version 99, this "
        f"image's train package version {podstate.VERSION}: upgrade the chart and the image together (or pin the "
        "image the chart was released with)"]
    rank = subprocess.run([sys.executable, "-m", "train", f"--ds-config={ds_config}", "--steps=1"],
                          env={**env, podstate.STATE_DIR_ENV: str(tmp_path / "ranks"), "RANK": "0"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert rank.returncode == podstate.EXIT_CONFIG_ERROR, rank.stderr
    assert "rank 0: the chart's pod scripts speak run-state protocol version 99" in rank.stderr
    assert "Traceback" not in rank.stderr


def test_the_readers_write_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    state = tmp_path / "ranks"
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("unchanged")
    (state / podstate.JOB_ID_FILE).symlink_to(victim)
    assert podstate.StateDir(state).write(podstate.JOB_ID_FILE, "uid\n")
    assert victim.read_text() == "unchanged" and (state / podstate.JOB_ID_FILE).read_text() == "uid\n"
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere")
    assert not podstate.StateDir(linked).write(podstate.JOB_ID_FILE, "uid\n")  # a linked directory: nothing


def test_pruning_keeps_the_newest_and_the_spared(tmp_path):
    for i in range(12):
        (tmp_path / f"run-{i:04d}-a").mkdir()
        os.utime(tmp_path / f"run-{i:04d}-a", (1000 + i, 1000 + i))
    podstate.prune(tmp_path, podstate.KEEP_RUNS, spare="run-0000-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-0000-a"] + [f"run-{i:04d}-a" for i in range(2, 12)]
