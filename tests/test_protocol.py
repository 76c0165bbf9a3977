"""The pods' run-time protocol (podruntime/protocol.py), one module for both sides: the chart's constants are the
owner's (scripts/chart_data.py --check), every pod program imports the package the chart ships (by static reading,
no path edits), a hang's verdict is merged by evidence (the culprit named whichever host reports it), and the two
sides refuse each other's other version."""

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podruntime import causes, protocol
from podruntime.text import clean, duration, lines
from tests.support.chart import CHART, ROOT, SCRIPTS, pod_program
from tests.support.harness import own_pid_namespace

PACKAGE = SCRIPTS / "podruntime"


def test_the_charts_constants_are_the_owners_and_no_python_is_generated():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chart_data.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    generated = CHART / "files" / "generated"
    assert json.loads((generated / "protocol.json").read_text())["version"] == protocol.VERSION
    assert not [p for p in generated.iterdir() if p.suffix in (".py", ".sh")], list(generated.iterdir())


def imports_of(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return modules


def test_every_pod_program_reaches_the_protocol_by_static_imports_of_the_package():
    """From the pods' entries (the scripts directory run as a program, the rank tagger DeepSpeed starts), every
    import of the package resolves to a file of it by reading alone; no program edits sys.path or loads a file by
    its path; the whole package reaches protocol.py."""
    modules = {f"podruntime.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules["podruntime"] = PACKAGE / "__init__.py"
    entries = [SCRIPTS / "__main__.py", SCRIPTS / "rank-log.py", SCRIPTS / "rank-hook.py"]
    seen, pending = set(), [imported for entry in entries for imported in imports_of(entry)]
    while pending:
        name = pending.pop()
        if not name.startswith("podruntime") or name in seen:
            continue
        seen.add(name)
        if name in modules:
            pending += imports_of(modules[name])
        else:  # `from podruntime.x import y` names y too: its module is podruntime.x
            assert name.rsplit(".", 1)[0] in modules, f"{name} resolves to no file of the package"
    assert {"podruntime.protocol", "podruntime.cli", "podruntime.loop", "podruntime.ledger"} <= seen
    reached = {name for name in seen if name in modules}
    assert reached >= set(modules) - {"podruntime", "podruntime.__main__"}, set(modules) - reached
    for path in [*PACKAGE.glob("*.py"), *entries]:
        text = path.read_text()
        if path.name == "savehook.py":  # it runs the tenant's program as python would (sys.path[0], runpy), no part
            text = text.replace("sys.path[0]", "").replace("runpy", "")  # of the package: nothing else of that
        assert "sys.path" not in text and "spec_from_file_location" not in text and "runpy" not in text, path


def test_the_tests_load_no_pod_program_by_its_path_and_edit_no_sys_path():
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        if path.name == Path(__file__).name:
            continue
        assert not re.search(r"spec_from_file_location|sys\.path\.(insert|append)|runpy\.run_path", text), path


FILE_FUNCTIONS = {"open", "scandir", "listdir", "walk", "stat", "lstat", "rename", "replace", "unlink", "remove",
                  "mkdir", "makedirs", "rmdir", "mkfifo", "utime", "chmod", "chown", "link", "symlink", "readlink"}
PATH_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "glob", "rglob", "mkdir", "unlink",
                "touch", "exists", "is_dir", "is_file", "stat", "lstat", "rename", "replace", "open", "resolve"}


def file_access(path: Path) -> list[str]:
    """Where a module opens a file by its path itself: pathlib, shutil or glob imported; the builtin open(); os's
    functions of paths; a path method called on a Tree's root or path()."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] in ("pathlib", "shutil", "glob")]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append("open()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in (
                    "os", "io") and func.attr in FILE_FUNCTIONS:
                found.append(f"{func.value.id}.{func.attr}()")
            elif isinstance(func, ast.Attribute) and func.attr in PATH_METHODS and (
                    isinstance(func.value, ast.Attribute) and func.value.attr == "root"
                    or isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Attribute)
                    and func.value.func.attr == "path"):
                found.append(f"a Tree's path .{func.attr}()")
    return found


def test_no_pod_program_opens_a_path_but_through_the_one_set_of_rules():
    """Everything under the checkpoint and state directories is opened through tenantfiles.Tree (no link followed,
    bounded, never raising); /proc, /sys and the termination log through host.py. No other module of the package
    touches a file by its path."""
    for path in PACKAGE.glob("*.py"):
        if path.name not in ("tenantfiles.py", "host.py"):
            assert not file_access(path), f"{path.name} opens files itself: {file_access(path)}"
    assert file_access(PACKAGE / "tenantfiles.py")  # the check sees what it looks for


def test_run_ids_round_trip_and_stay_one_path_component():
    assert protocol.run_id(3, "1a2b3c4d-5e6f") == "run-0003-1a2b3c4d"
    assert protocol.parse_run_id("run-0003-1a2b3c4d") == (3, "1a2b3c4d")
    assert protocol.run_id(1, "../../x; rm") == "run-0001-xrm"
    assert protocol.parse_run_id("run-1-x") is None and protocol.parse_run_id("../run-0001-x") is None


def test_published_text_is_one_bounded_line():
    assert clean("a\x1b]52;c;x\x07b\u202ec\nd" + "e" * 1000, 20) == "a ]52;c;x b c d" + "e" * 5


def test_one_duration_formatter():
    assert [duration(s) for s in (0, 41, 123, 3720, 86400)] == ["0s", "41s", "2m03s", "1h02m", "24h00m"]
    assert duration(18, "clock") == "0:00:18" and duration(3723, "clock") == "1:02:03"
    assert duration(float("nan")) == duration(None) == duration(True) == ""


@pytest.mark.parametrize("line, tag", [
    ("[rank 3 attempt 2] step 10", (3, 2)),
    ("w-1.svc: [rank 3 attempt 2] step 10", (3, 2)),  # after pdsh's `host: `
    ("[rank 3] outside the chart's attempts", (3, None)),
    ("[rank 0 attempt 1] text [rank 5 attempt 1] inside a line", (0, 1)),
    ("step 10 [rank 5 attempt 1] inside a line", None),  # a tag counts only at a line's start
    ("w-1: hang on w-1: [rank 5 attempt 1]", None),
])
def test_a_rank_tag_counts_only_at_a_lines_start(line, tag):
    assert protocol.tag_of(line) == tag


def test_one_line_splitter_for_the_tagger_and_make_logs():
    """A rank's U+2028, form feed or carriage return stays inside its line: no text a rank writes starts a line
    that looks like another rank's."""
    text = "[rank 0 attempt 1] a\u2028[rank 1 attempt 1] forged\x0c[rank 1 attempt 1] x\n[rank 1 attempt 1] real\n"
    assert [protocol.tag_of(line) for line in lines(text)] == [(0, 1), (1, 1)]
    assert lines("a\u2028b\nc".encode()) == [b"a\xe2\x80\xa8b", b"c"]


# ---------------------------------------------------------------- the verdict on a hang, by evidence

def report(host: str, *ranks: tuple) -> dict:
    return protocol.hang_report(host, "run-0002-abc", time.time(), [
        protocol.hang_rank(rank, host, kind, beat, 200, "training", where) for rank, kind, beat, where in ranks])


@pytest.mark.parametrize("order", ["culprit first", "victim first"])
def test_a_stopped_rank_on_the_second_host_is_the_culprit_not_the_first_hosts_waiting_rank(order):
    victim = report("w-0", (0, "in-collective", 1000.0, "waits in a collective: all_reduce"))
    culprit = report("w-1", (1, "stopped", 990.0, "process stopped (T (stopped))"))
    reports = [culprit, victim] if order == "culprit first" else [victim, culprit]
    merged = causes.merge_hang_reports(reports)
    assert (merged["culprit"]["rank"], merged["culprit"]["host"]) == (1, "w-1")
    assert [v["rank"] for v in merged["victims"]] == [0]
    assert merged["reason"].startswith("hang: rank 1 on w-1 is the likely culprit (its process is stopped")
    assert "1 rank waits for it in collectives (rank 0 on w-0)" in merged["reason"]


def test_among_ranks_with_evidence_against_them_the_oldest_beat_is_the_culprit():
    merged = causes.merge_hang_reports([
        report("w-0", (0, "outside-collective", 1005.0, "in read (x.py:3)")),
        report("w-1", (1, "unresponsive", 1001.0, "no stack (process D)"), (2, "in-collective", 900.0, "waits"))])
    assert merged["culprit"]["rank"] == 1  # before rank 0 (a newer beat) and rank 2 (it only waits)
    assert causes.merge_hang_reports([]) is None


def test_when_every_rank_that_reported_waits_the_culprit_is_on_another_host_never_a_waiting_rank():
    """One host's evidence alone (its ranks wait for a peer elsewhere, whose watchdog did not report): the reason says
    so, and names no culprit; the cause then keeps the rank's own word where one came."""
    merged = causes.merge_hang_reports([report("w-0", (0, "in-collective", 1000.0, "waits in a collective"),
                                               (1, "in-collective", 990.0, "waits in a collective"))])
    assert merged["culprit"] is None and [v["rank"] for v in merged["victims"]] == [1, 0]
    assert merged["reason"].startswith("hang: every rank that reported waits in a collective (rank 1 on w-0, rank 0 "
                                       "on w-0): the culprit is on another host"), merged["reason"]
    assert "likely culprit" not in merged["reason"]


@pytest.mark.parametrize("hostile", [[1, 2], {"v": 99, "ranks": []}, {"v": 2, "ranks": [{"kind": "rm -rf"}]},
                                     {"v": 2, "ranks": "x"}, {"v": 2, "host": "h\x1b[2J" * 200, "ranks": [
                                         {"rank": "0", "kind": "stopped", "last_beat": 1, "where": "w" * 5000}]}])
def test_a_hang_report_from_a_tenants_container_is_typed_and_bounded(hostile):
    checked = protocol.valid_hang_report(hostile)
    if checked is not None:
        assert len(checked["host"]) <= 253 and "\x1b" not in checked["host"]
        assert all(len(r["where"]) <= 400 for r in checked["ranks"])
        assert json.loads(json.dumps(checked)) == checked
    else:
        assert not (isinstance(hostile, dict) and hostile.get("ranks") and re.search("stopped", str(hostile)))


# ---------------------------------------------------------------- the two sides ship apart: a version, a skew rule

def test_a_chart_of_another_protocol_version_is_refused_at_the_check_and_at_the_ranks_start(tmp_path):
    """The image's train package and the chart's pod runtime differ after an upgrade of either: the config check
    (helm install) and every rank at start refuse the pair in one line naming both versions, with a configuration
    error's status (never retried); the same version, or no chart (a local run), passes."""
    protocol.check_version(str(protocol.VERSION), "x")
    protocol.check_version(None, "x")
    with pytest.raises(protocol.VersionSkew, match=f"speak run-state protocol version 99, this image's train "
                                                   f"package version {protocol.VERSION}"):
        protocol.check_version("99", "x")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    env = {**os.environ, protocol.PROTOCOL_ENV: "99", "DS_CONFIG_PATH": str(ds_config), "DS_WORLD_SIZE": "1",
           "DS_ACCELERATOR": "cpu"}
    check = subprocess.run([sys.executable, "-m", "train.preflight"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == protocol.EXIT_CONFIG_ERROR, check.stderr
    assert check.stderr.strip().splitlines() == [
        f"config check failed: config check: the chart's pod scripts speak run-state protocol version 99, this "
        f"image's train package version {protocol.VERSION}: upgrade the chart and the image together (or pin the "
        "image the chart was released with)"]
    rank = subprocess.run([sys.executable, "-m", "train", f"--ds-config={ds_config}", "--steps=1"],
                          env={**env, protocol.STATE_DIR_ENV: str(tmp_path / "ranks"), "RANK": "0"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert rank.returncode == protocol.EXIT_CONFIG_ERROR, rank.stderr
    assert "rank 0: the chart's pod scripts speak run-state protocol version 99" in rank.stderr
    assert "Traceback" not in rank.stderr


def test_the_pod_programs_run_from_the_charts_files_as_the_pods_run_them(tmp_path):
    usage = subprocess.run(pod_program("no-such-program"), capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "launcher DEEPSPEED_COMMAND" in usage.stderr
    state = tmp_path / "ranks"
    state.mkdir()
    # in a PID namespace of its own, as in a pod: this machine's other ranks (another test's) are not its to stop
    stopped = subprocess.run(own_pid_namespace(pod_program("stop-ranks")), env={
        "PATH": os.environ["PATH"], protocol.STATE_DIR_ENV: str(state)}, capture_output=True, text=True, timeout=30)
    assert stopped.returncode == 0 and stopped.stdout == "", stopped.stderr  # no ranks here: nothing to say
