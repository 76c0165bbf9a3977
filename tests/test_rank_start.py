"""A retry's ranks started by the loop itself (podruntime/rankstart.py): DeepSpeed's real runner starts a world of
two ranks once, each rank's rank-log.py records what the launcher gave it, and the starter then starts the same
ranks again from those records: the same command line, environment and interpreter, and the same end as DeepSpeed's
when a rank dies. A record that disagrees with the loop's command is refused, with the reason (hostile records)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from podruntime import rankstart
from podruntime.tenantfiles import Tree
from tests.support.chart import SCRIPTS, pod_program
from tests.support.harness import wait_for
from tests.support.ports import free_port

# Each rank writes what it was started with to OUT/<run>-<RANK>.json, then: rank 0 waits for SIGTERM; rank 1 waits
# until rank 0 has written its file, then ends as DIE says (`kill`: SIGKILL to itself; `exit:N`; else 0).
PROBE = """
import json, os, signal, sys, time
out, run, rank = sys.argv[-1], os.environ["DS_RUN_ID"], os.environ["RANK"]
with open(f"{out}/{run}-{rank}.json.part", "w") as f:
    json.dump({"argv": sys.argv, "env": dict(os.environ), "python": sys.executable, "pid": os.getpid()}, f)
os.rename(f"{out}/{run}-{rank}.json.part", f"{out}/{run}-{rank}.json")
if rank == "0":
    while True:
        time.sleep(0.1)
while not os.path.exists(f"{out}/{run}-0.json"):
    time.sleep(0.05)
die = os.environ.get("DIE", "")
if die == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(die.split(":")[1]) if die.startswith("exit:") else 0)
"""


def command(tmp_path: Path, port: int) -> list[str]:
    """The nossh worker's `deepspeed` command for node 0 of one host with two slots, as the chart renders it."""
    (tmp_path / "hostfile").write_text("worker-0 slots=2\n")
    (tmp_path / "probe.py").write_text(PROBE)
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    return [deepspeed, "--node_rank=0", f"--hostfile={tmp_path / 'hostfile'}", "--no_ssh", "--master_addr=127.0.0.1",
            f"--master_port={port}", str(SCRIPTS / "rank-log.py"), str(tmp_path / "probe.py"), str(tmp_path / "out")]


def env_of(tmp_path: Path, run: str, die: str) -> dict[str, str]:
    # PYTEST_CURRENT_TEST names the phase; what importing DeepSpeed set in this process is left out, so that the
    # ranks have it only if their launcher gives it to them.
    env = {key: value for key, value in os.environ.items()
           if key != "PYTEST_CURRENT_TEST" and key not in rankstart.IMPORT_ENV}
    return {**env, "DS_RANK_STATE_DIR": str(tmp_path / "state"), "DS_RUN_ID": run, "DIE": die, "HOME": str(tmp_path)}


# As a user of their own: a pod's stop ends every launcher and rank of its user, and this suite's other tests run
# pod loops as root beside this one (tests/test_attempt_loop.py).
AS_POD_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def seen(tmp_path: Path, run: str, rank: int) -> dict:
    return json.loads((tmp_path / "out" / f"{run}-{rank}.json").read_text())


@pytest.fixture(scope="module")
def deepspeeds_run():
    """DeepSpeed's runner and launcher start the probe's two ranks; rank 1 is killed by SIGKILL: (dir, command,
    DeepSpeed's exit status, its output)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (the ranks run as a user of their own); the e2e tier starts ranks too")
    tmp_path = Path(tempfile.mkdtemp(prefix="ds-rankstart-"))
    try:
        for directory in (tmp_path, tmp_path / "out", tmp_path / "state"):
            directory.mkdir(exist_ok=True)
            directory.chmod(0o777)
        argv = command(tmp_path, free_port())
        status = subprocess.run(AS_POD_USER + argv, env=env_of(tmp_path, "run-1", "kill"), timeout=300,
                                capture_output=True)
        yield tmp_path, argv, status.returncode, status.stdout.decode(errors="replace")[-3000:]
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_starter_gives_each_rank_what_deepspeeds_launcher_gave_it_and_ends_as_it_does(deepspeeds_run):
    tmp_path, argv, deepspeeds_status, output = deepspeeds_run
    assert deepspeeds_status == 256 - signal.SIGKILL, output  # launch.py's sys.exit(-9), passed on by the runner
    found = rankstart.plan(Tree(tmp_path / "state"), argv, 0, {"run-1"})
    assert not isinstance(found, str), found
    assert found[0] == "run-1" and len(found[1]) == 2
    started = time.monotonic()
    ours = subprocess.run(AS_POD_USER + pod_program(rankstart.PROGRAM, "run-1", *argv),
                          env=env_of(tmp_path, "run-2", "kill"), timeout=120, capture_output=True)
    took = time.monotonic() - started
    assert ours.returncode == deepspeeds_status, ours.stdout.decode(errors="replace")[-3000:]
    for rank in (0, 1):
        theirs, mine = seen(tmp_path, "run-1", rank), seen(tmp_path, "run-2", rank)
        assert mine["argv"] == theirs["argv"] and mine["python"] == theirs["python"]
        assert {**mine["env"], "DS_RUN_ID": "run-1"} == theirs["env"]
    # Rank 0 (waiting) was ended with its peer, as DeepSpeed's launcher ends it.
    assert not os.path.exists(f"/proc/{seen(tmp_path, 'run-2', 0)['pid']}")
    print(f"\nDeepSpeed's runner and launcher vs the starter: the same ranks, the same end (status "
          f"{deepspeeds_status}); the starter took {took:.1f}s from start to its exit")


@pytest.mark.parametrize("die", ["exit:7", ""])
def test_the_starter_passes_a_ranks_status_on_and_ends_its_ranks_on_sigterm(deepspeeds_run, die):
    """A rank's non-zero status is the starter's (its peer ended); with none, the ranks run until the starter's
    SIGTERM, which ends them and exits 1, as launch.py does."""
    tmp_path, argv, _, _ = deepspeeds_run
    run = f"run-{die or 'term'}"
    recorded = json.loads((tmp_path / "state" / "launch-0.json").read_text())["run"]  # the last run's, as the loop
    process = subprocess.Popen(AS_POD_USER + pod_program(rankstart.PROGRAM, recorded, *argv),
                               env=env_of(tmp_path, run, die))
    wait_for(lambda: (tmp_path / "out" / f"{run}-1.json").exists() or process.poll() is not None, 60, "both ranks")
    if not die:
        wait_for(lambda: not os.path.exists(f"/proc/{seen(tmp_path, run, 1)['pid']}"), 60, "rank 1 to end well")
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == (7 if die else 1)
    assert not os.path.exists(f"/proc/{seen(tmp_path, run, 0)['pid']}")


def test_a_starter_whose_records_no_longer_agree_hands_the_run_to_deepspeeds_runner(deepspeeds_run):
    """The records changed between the loop's look and the starter's (a rank rewrote them): the starter execs
    DeepSpeed's runner with the same command, as a first run, and the run's status is DeepSpeed's."""
    tmp_path, argv, _, _ = deepspeeds_run
    ours = subprocess.run(AS_POD_USER + pod_program(rankstart.PROGRAM, "run-never", *argv),
                          env=env_of(tmp_path, "run-handover", "exit:7"), timeout=300, capture_output=True)
    out = ours.stdout.decode(errors="replace")
    assert ours.returncode == 7, out[-3000:]
    assert "DeepSpeed's runner starts the ranks (local rank 0's record is of no run this pod ran)" in out, out[-3000:]
    assert "deepspeed.launcher.launch" in out  # the runner's own line: `cmd = ... -m deepspeed.launcher.launch ...`


def test_what_importing_deepspeed_sets_is_replayed_as_the_launcher_gave_it():
    """deepspeed/__init__.py's os.environ.setdefault keys: its runner and launcher import it, so their ranks
    inherit them; the starter replays exactly those (rankstart.IMPORT_ENV)."""
    import ast

    import deepspeed

    source = Path(deepspeed.__file__).read_text()
    keys = {call.args[0].value for call in ast.walk(ast.parse(source)) if isinstance(call, ast.Call)
            and getattr(call.func, "attr", "") == "setdefault" and ast.unparse(call.func.value) == "os.environ"}
    assert keys == set(rankstart.IMPORT_ENV)


# ---- the records as hostile input: each disagreement is refused, with what the loop would start otherwise


def records(tmp_path: Path, deepspeed: list[str], **change) -> Tree:
    """Two valid records for `argv` (node 0, a world of 2), one field of local rank 1's replaced by `change`."""
    state = tmp_path / "records"
    state.mkdir(exist_ok=True)
    for local in (0, 1):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": deepspeed[5].split("=")[1], "WORLD_SIZE": "2",
               "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2", "RANK": str(local), "LOCAL_RANK": str(local),
               "CUDA_VISIBLE_DEVICES": "0,1"}
        argv = [deepspeed[6], f"--local_rank={local}", *deepspeed[7:]]
        rec = {"run": "run-1", "python": sys.executable, "argv": argv, "env": env}
        if local == 1:
            for key, value in change.items():
                if key in env or key == "LD_PRELOAD":
                    env[key] = value
                else:
                    rec[key] = value
        (state / f"launch-{local}.json").write_text(json.dumps(rec))
    return Tree(state)


HOSTILE = {
    "the wrong program": ({"argv": ["/tmp/evil.py", "--local_rank=1"]}, "another command line"),
    "another interpreter": ({"python": "/bin/sh"}, "names another interpreter than DeepSpeed's runner's"),
    "a rank number int() refuses": ({"RANK": "\u00b2"}, "not a number"),
    "a size int() refuses": ({"LOCAL_SIZE": "\u00b2"}, "not a number"),
    "a variable beside the launcher's": ({"LD_PRELOAD": "/tmp/evil.so"}, "does not hold the launcher's variables"),
    "a rank twice": ({"RANK": "0"}, "RANK 0 twice"),
    "a rank twice, written otherwise": ({"RANK": "00"}, "RANK 00 twice"),
    "a rank outside the world": ({"RANK": "9"}, "outside the world"),
    "another master port": ({"MASTER_PORT": "1"}, "has MASTER_PORT=1"),
    "another node": ({"CROSS_RANK": "3"}, "has CROSS_RANK=3"),
    "a run this pod never ran": ({"run": "run-0"}, "no run this pod ran"),
    "another world": ({"WORLD_SIZE": "4"}, "another run, interpreter or world"),
    "a non-number size": ({"LOCAL_SIZE": "x"}, "not a number"),
    "not a record": ({"extra": 1}, "not a launch record"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_record_that_disagrees_with_the_loops_command_is_refused_with_why(tmp_path, case):
    argv = command(tmp_path, 29500)
    assert rankstart.plan(records(tmp_path, argv), argv, 0, {"run-1"})[0] == "run-1"  # the legitimate pair
    change, why = HOSTILE[case]
    found = rankstart.plan(records(tmp_path, argv, **change), argv, 0, {"run-1"})
    assert isinstance(found, str) and why in found, found


def test_a_linked_missing_or_oversized_record_and_a_runner_argument_that_changes_the_rank_keep_deepspeeds_runner(
        tmp_path):
    argv = command(tmp_path, 29500)
    tree = records(tmp_path, argv)
    state = tmp_path / "records"
    assert isinstance(rankstart.plan(tree, argv, 0, {"run-1"}), tuple)
    bound = ["--bind_cores_to_rank" if w == "--no_ssh" else w for w in argv]
    assert "--bind_cores_to_rank changes how a rank starts" in rankstart.plan(tree, bound, 0, {"run-1"})
    assert "runs no rank-log.py" in rankstart.plan(tree, argv[:6], 0, {"run-1"})
    (state / "launch-1.json").write_text(" " * (1 << 20))
    assert "local rank 1's record is missing" in rankstart.plan(tree, argv, 0, {"run-1"})
    (state / "launch-1.json").unlink()
    (state / "launch-1.json").symlink_to(state / "launch-0.json")
    assert "local rank 1's record is missing" in rankstart.plan(tree, argv, 0, {"run-1"})
    (state / "launch-0.json").unlink()
    assert "no rank of this pod's last run recorded its start" in rankstart.plan(tree, argv, 0, {"run-1"})
