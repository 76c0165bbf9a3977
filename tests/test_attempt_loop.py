"""The attempt loop (podruntime/loop.py) in its own processes, as the pods run it (`python3 -I <scripts>
nossh-worker ...`), two workers on this machine's loopback: the hosts meet on worker 0, every host's evidence of an
attempt reaches the ledger's owner over the channel and the cause is decided once from all of it, a worker that gets
SIGTERM says so before its ranks stop (a preemption, whichever worker it was, on per-pod volumes), and a stop rule
ends every worker. DeepSpeed's launcher is a small program here (FAKE_LAUNCHER) that reports through the real
train.rankstate; the e2e tier runs the real one (tests/e2e)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podruntime import protocol
from tests.support.chart import ROOT, pod_program
from tests.support.harness import own_pid_namespace, signal_pid1, wait_for, write_projected
from tests.support.ports import free_port

# DeepSpeed's launcher's stand-in: one rank that beats to FAKE_STEP, then ends as FAKE_<worker>_<attempt> says:
# `exit:N`; `late:N` (N after 2 s more); `fail:N` (after its end record, FAKE_ERROR's line); `wait` (until SIGTERM:
# 143); `peer:PATH` (until the file PATH is there, then 1: a collective that fails once its peer is gone).
FAKE_LAUNCHER = """
import os, signal, sys, time
from train import rankstate
node = next(a.split("=")[1] for a in sys.argv if a.startswith("--node_rank="))
os.environ["RANK"] = node
what = os.environ.get(f"FAKE_{node}_{os.environ['DS_ATTEMPT']}", "exit:0")
rankstate.report("starting")
for step in range(1, int(os.environ.get("FAKE_STEP", "5")) + 1):
    rankstate.beat(step)
if what == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    while True:
        time.sleep(0.1)
if what.startswith("peer:"):
    while not os.path.exists(what[5:]):
        time.sleep(0.1)
    sys.exit(1)
kind, status = what.split(":")
if kind == "late":
    time.sleep(2)
if kind == "fail":
    rankstate.fail("program-error", os.environ["FAKE_ERROR"].format(node=node))
rankstate.clear()
sys.exit(int(status))
"""


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test():
    """A test that fails before its workers end leaves no process behind."""
    yield
    for workers in Workers.started:
        for p in workers.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    Workers.started.clear()


class Workers:
    """Two nossh workers on loopback, each with its own /tmp (state directory, ledger): per-pod volumes."""

    started: list["Workers"] = []

    def __init__(self, tmp: Path, retries: int = 2, only: tuple[int, ...] = (0, 1), **fake: str):
        Workers.started.append(self)
        self.tmp, self.port = tmp, free_port()
        # the chart's ConfigMap as the kubelet mounts it: the hostfile a link through ..data
        write_projected(tmp / "config", [("hostfile", "127.0.0.1 slots=1\nlocalhost slots=1\n", 0o644)], os.getgid())
        launcher = tmp / "launcher.py"  # the loop puts --node_rank=<index> after the command's first word
        launcher.write_text(f"#!{sys.executable}\n{FAKE_LAUNCHER}")
        launcher.chmod(0o755)
        self.processes = []
        for index in only:
            state = tmp / f"w{index}" / "ranks"
            state.mkdir(parents=True)
            env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "DS_CONFIG_DIR": str(tmp / "config"),
                   "DS_CHANNEL_PORT": str(self.port), "DS_WAIT_TIMEOUT_SECONDS": "30", "JOB_COMPLETION_INDEX":
                   str(index), protocol.STATE_DIR_ENV: str(state), "DS_ATTEMPTS_DIR": str(tmp / f"w{index}" /
                                                                                          "attempts"),
                   "DS_RUN_RETRIES": str(retries), "DS_JOB_UID": "job1", "DS_KILL_GRACE_SECONDS": "10", **fake}
            log = open(tmp / f"w{index}.log", "w")  # noqa: SIM115 - the process's, closed at its end
            # its own PID namespace, as a pod's: its rank stopper finds its ranks only (not the other worker's, nor
            # another test's on this machine)
            self.processes.append(subprocess.Popen(own_pid_namespace(pod_program("nossh-worker", str(launcher))),
                                                   env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def signal(self, index: int, sig: int) -> None:
        """`sig` to worker `index`'s loop, as the kubelet signals a container."""
        signal_pid1(self.processes[index], sig)

    def log(self, index: int) -> str:
        return (self.tmp / f"w{index}.log").read_text()

    def verdict(self) -> dict:
        return json.loads((self.tmp / "w0" / "ranks" / protocol.VERDICT).read_text())

    def causes(self) -> list[dict]:
        ledger = self.tmp / "w0" / "attempts" / "job1"
        return [json.loads((a / "cause.json").read_text()) for a in sorted(ledger.glob("0*"))
                if (a / "cause.json").exists()]

    def wait(self, timeout: float = 120) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.processes]
        finally:
            for p in self.processes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)

    def both(self) -> str:
        return self.log(0)[-3000:] + "\n----\n" + self.log(1)[-3000:]


def test_the_owner_decides_once_from_every_workers_evidence(tmp_path):
    """Worker 1's rank raises; worker 0's only fails because its peer is gone. The cause names worker 1's error,
    sent over the channel with worker 1's end: decided once, never first from worker 0's evidence alone."""
    workers = Workers(tmp_path, FAKE_0_1="exit:1", FAKE_1_1="fail:1", FAKE_ERROR="ValueError: bad batch on {node}")
    codes = workers.wait()
    assert codes == [0, 0], workers.both()
    [first, second] = workers.causes()
    assert first["cause"] == "program-error" and "rank 1 on" in first["reason"] and \
        "ValueError: bad batch on 1" in first["reason"], first
    assert second["cause"] == "completed"
    assert workers.log(0).count("attempts: attempt") == 2


def test_while_worker_0_waits_at_the_start_barrier_the_verdict_says_for_whom_and_how_long_yet(tmp_path):
    """What the progress ConfigMap and `make why` show while a worker is missing: the barrier's wait, not a silent
    `starting`."""
    workers = Workers(tmp_path, only=(0,))
    verdict = tmp_path / "w0" / "ranks" / protocol.VERDICT
    wait_for(lambda: verdict.exists() and "waits for" in workers.verdict().get("reason", ""), 60,
             "the verdict to say the barrier's wait", lambda: workers.log(0)[-2000:])
    reason = workers.verdict()["reason"]
    assert re.fullmatch(r"the start barrier waits for 1 of 2 workers \(localhost\): \d+s more, then the job fails "
                        r"\(job\.waitTimeoutSeconds\)", reason), reason
    assert workers.verdict()["state"] == "starting"


def test_when_the_start_barriers_wait_runs_out_the_verdict_says_the_job_failed_and_for_whom(tmp_path):
    """The job's last word once worker 0 gives up on a missing worker: failed, who, and the limit; never the wait's
    "n s more" left standing after the job ended."""
    workers = Workers(tmp_path, only=(0,), DS_WAIT_TIMEOUT_SECONDS="6")
    assert workers.wait() == [1], workers.log(0)[-2000:]
    verdict = workers.verdict()
    assert verdict["state"] == "failed", verdict
    assert verdict["reason"] == ("1 of 2 workers did not reach the start barrier within 6s (job.waitTimeoutSeconds): "
                                 "localhost"), verdict


def test_a_worker_whose_run_ended_well_may_leave_before_worker_0s_ends(tmp_path):
    """Worker 1's run ends well and its pod's loop exits while worker 0's rank still finishes (its last save): that
    is no host leaving a run (no halt, no node-lost), and the job completes."""
    workers = Workers(tmp_path, retries=0, FAKE_0_1="late:0", FAKE_1_1="exit:0")
    assert workers.wait() == [0, 0], workers.both()
    assert [c["cause"] for c in workers.causes()] == ["completed"], workers.causes()
    assert "cannot go on" not in workers.log(0), workers.both()


def test_a_sigterm_to_any_worker_is_a_preemption_on_per_pod_volumes_and_ends_the_run_everywhere_at_once(tmp_path):
    """Worker 1 (not the ledger's owner) gets SIGTERM mid-run: it tells worker 0 over the channel before its ranks
    stop, so the attempt is a preemption and spends nothing (retries 0), though worker 1's /tmp is its own. Worker
    0's rank would wait for its peer forever (a rendezvous, a collective): worker 0 ends its run at once."""
    workers = Workers(tmp_path, retries=0, FAKE_0_1="wait", FAKE_1_1="wait")
    wait_for(lambda: "running (run-0001" in workers.log(0) and "running (run-0001" in workers.log(1), 60,
             "the first attempt", workers.both)
    workers.signal(1, signal.SIGTERM)
    assert workers.processes[1].wait(timeout=60) == protocol.EXIT_STOPPED, workers.both()
    wait_for(lambda: workers.causes(), 60, "attempt 1's cause", workers.both)
    assert workers.causes()[0]["cause"] == "preempted", workers.causes()
    assert "got SIGTERM: attempt 1 is a preemption" in workers.log(0)
    assert re.search(r"worker 0: \S+ got SIGTERM: run-0001-\w+ cannot go on: stopping this worker's ranks of it",
                     workers.log(0)), workers.both()
    assert "DeepSpeed exited with status 143" in workers.log(0), workers.both()
    # Worker 1's end said it stopped: it is leaving, not ready; worker 0 waits for its replacement.
    wait_for(lambda: "1/2 here; waiting for" in workers.log(0), 30, "worker 0 to wait for worker 1", workers.both)
    assert "attempt 2" not in workers.log(0), workers.both()
    workers.signal(0, signal.SIGTERM)  # the Job's end: nothing more to see here
    workers.wait()


def test_a_worker_that_vanishes_mid_run_is_node_lost_and_its_peers_run_ends_at_once(tmp_path):
    """Worker 1's pod is killed outright (its processes SIGKILLed: no SIGTERM, no word): worker 0 sees its channel
    drop mid-run, ends its own run at once and decides node-lost; the retry waits for worker 1 again."""
    workers = Workers(tmp_path, retries=1, FAKE_0_1="wait", FAKE_1_1="wait")
    wait_for(lambda: "running (run-0001" in workers.log(0) and "running (run-0001" in workers.log(1), 60,
             "the first attempt", workers.both)
    os.killpg(workers.processes[1].pid, signal.SIGKILL)
    wait_for(lambda: workers.causes(), 60, "attempt 1's cause", workers.both)
    assert workers.causes()[0]["cause"] == "node-lost", workers.causes()
    assert re.search(r"left without a word \(its connection dropped\): run-0001-\w+ cannot go on", workers.log(0)), \
        workers.both()
    workers.signal(0, signal.SIGTERM)
    workers.wait()


def test_a_sigterm_to_worker_0_ends_every_workers_run(tmp_path):
    """Worker 0 (the ledger's owner) gets SIGTERM: a preemption, and it tells worker 1 to stop its ranks now
    (`halt`): worker 1's rank would otherwise wait for worker 0's forever."""
    workers = Workers(tmp_path, retries=0, FAKE_0_1="wait", FAKE_1_1="wait")
    wait_for(lambda: "running (run-0001" in workers.log(0) and "running (run-0001" in workers.log(1), 60,
             "the first attempt", workers.both)
    workers.signal(0, signal.SIGTERM)
    assert workers.processes[0].wait(timeout=60) == protocol.EXIT_STOPPED, workers.both()
    wait_for(lambda: "DeepSpeed exited with status 143" in workers.log(1), 30, "worker 1's run to end", workers.both)
    assert re.search(r"worker 1: worker 0 says \S+ got SIGTERM: run-0001-\w+ cannot go on", workers.log(1)), \
        workers.both()
    assert workers.causes()[0]["cause"] == "preempted", workers.causes()
    workers.signal(1, signal.SIGTERM)
    workers.wait()


def test_a_stop_rule_ends_every_worker(tmp_path):
    """The same error at the same step twice: worker 0's ledger stops the job and ends worker 1 too."""
    error = {"FAKE_ERROR": "RuntimeError: shape mismatch in layer {node}"}
    workers = Workers(tmp_path, retries=5, FAKE_0_1="exit:1", FAKE_1_1="fail:1", FAKE_0_2="exit:1",
                      FAKE_1_2="fail:1", **error)
    assert workers.wait() == [protocol.EXIT_NOT_RETRIED] * 2, workers.both()
    assert "the same error at step 5 in attempts 1 and 2" in workers.log(0)
    assert "worker 0 says the job stops (program-error" in workers.log(1)
    assert workers.verdict()["state"] == "failed"


def test_the_ssh_launcher_runs_deepspeeds_runner_with_pdshs_ssh_config_and_the_attempts_env(tmp_path):
    """DeepSpeed's runner appends only its port to PDSH_SSH_ARGS_APPEND: our ssh config (key, known_hosts) must
    already be there, whatever the passwd home of the pod's uid says; the attempt's env reaches every rank
    through ~/.deepspeed_env, beside the chart's lines (a ConfigMap key, a link as the kubelet mounts it)."""
    from podruntime import sshmode
    from podruntime.ledger import Began

    write_projected(tmp_path / "config", [("hostfile", "127.0.0.1 slots=1\n", 0o644),
                                          ("deepspeed_env", "APP_PLAIN=1\n", 0o644)], os.getgid())
    home = tmp_path / "home"
    home.mkdir()
    seen = tmp_path / "seen.json"
    command = [sys.executable, "-c", f"import json, os; json.dump(dict(os.environ), open({str(seen)!r}, 'w'))"]
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "DS_CONFIG_DIR": str(tmp_path / "config")}
    launcher = sshmode.Launcher(command, ledger=None, env=env)
    run, number = protocol.ATTEMPT_ENV["run"], protocol.ATTEMPT_ENV["attempt"]
    attempt = Began(1, {run: "run-0001-x", number: "1"}, "attempt 1")
    assert launcher.run(attempt) == 0
    got = json.loads(seen.read_text())
    assert got["PDSH_RCMD_TYPE"] == "ssh" and got["PDSH_SSH_ARGS_APPEND"] == f"-F {home}/.ssh/config"
    assert got[run] == "run-0001-x"
    assert (home / ".deepspeed_env").read_text() == f"APP_PLAIN=1\n{run}=run-0001-x\n{number}=1\n"


def test_a_spoke_that_gets_its_go_and_loses_the_connection_at_once_still_hands_the_go_over(tmp_path, monkeypatch):
    """Worker 0 may send `go`, run and leave before a worker's loop looks again: the spoke's reader has the `go` and
    the end of the connection in the inbox by then. connect() returns once connected, so the loop reads them; it
    used to see no connection, try again, and wait for a worker 0 that had already left. The reader is made to
    finish before connect() goes on (the interleaving a loaded machine gives now and then)."""
    import socket
    import threading

    from podruntime import channel

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def worker0() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(channel.encode("go", env={"DS_ATTEMPT": "1"}))
        conn.close()
        server.close()  # gone: a connection tried again is refused

    threading.Thread(target=worker0, daemon=True).start()

    class ReaderFirst(threading.Thread):
        def start(self):
            super().start()
            self.join(10)

    monkeypatch.setattr(channel.threading, "Thread", ReaderFirst)
    spoke = channel.Spoke(1, "127.0.0.1", port)
    assert spoke.connect(time.monotonic() + 3, channel.encode("join", index=1))
    assert [spoke.inbox.get(timeout=5)["m"], spoke.inbox.get(timeout=5)["m"]] == ["go", "gone"]


def test_in_ssh_a_workers_word_that_its_ranks_wait_reaches_the_launcher_and_the_launchers_reaches_a_worker():
    """The `waiting` relay of ssh mode over real sockets: a worker agent's Listener broadcasts it to the launcher's
    Spoke, whose handler takes it at once (not the inbox, which is read between runs); what the launcher sends on
    reaches the other worker's Listener handler. Anything a connection sends before its `join` is refused."""
    import queue
    import socket

    from podruntime import channel

    heard_by_worker, heard_by_launcher = queue.Queue(), queue.Queue()
    port = free_port()
    listener = channel.Listener(port, {"waiting": heard_by_worker.put})
    spoke = channel.Spoke(0, "127.0.0.1", port, queue.Queue(), {"waiting": heard_by_launcher.put})
    assert spoke.connect(time.monotonic() + 10, channel.encode("join", index=0))
    wait_for(lambda: listener.connections, 10, "the launcher's connection to be held")
    said = channel.encode("waiting", run="run-0003-abc", since=1000.5, who="rank 0 (pid 7, local rank 0) on w-0")
    assert listener.broadcast(said) == 1
    message = heard_by_launcher.get(timeout=10)
    assert (message["m"], message["run"], message["since"], message["index"]) == ("waiting", "run-0003-abc", 1000.5, 0)
    assert spoke.inbox.empty()
    assert spoke.send(said)
    assert heard_by_worker.get(timeout=10)["who"] == "rank 0 (pid 7, local rank 0) on w-0"
    # A connection that never said `join` is dropped at its first line, and its word goes nowhere.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
        stranger.sendall(said)
        stranger.settimeout(5)
        assert stranger.recv(1) == b""  # closed by the listener
    assert heard_by_worker.empty()


def test_in_nossh_a_workers_word_that_its_ranks_wait_reaches_worker_0_and_worker_0s_reaches_a_worker():
    """The same relay in nossh: a worker's Spoke to worker 0's Hub, whose handler takes it at once with the sender's
    index (worker 0 sends it on to every other worker, nosshmode.Worker.relay_waiting), and back."""
    import queue

    from podruntime import channel

    heard_by_hub, heard_by_worker = queue.Queue(), queue.Queue()
    port = free_port()
    hub = channel.Hub(port, {1}, {"waiting": heard_by_hub.put})
    spoke = channel.Spoke(1, "127.0.0.1", port, handlers={"waiting": heard_by_worker.put})
    assert spoke.connect(time.monotonic() + 10, channel.encode("join", index=1))
    assert hub.inbox.get(timeout=10)[1]["m"] == "join"
    said = channel.encode("waiting", run="run-0003-abc", since=1000.5, who="rank 1 (pid 7, local rank 0) on w-1")
    assert spoke.send(said)
    message = heard_by_hub.get(timeout=10)
    assert (message["index"], message["who"]) == (1, "rank 1 (pid 7, local rank 0) on w-1") and hub.inbox.empty()
    assert hub.send(1, said)
    assert heard_by_worker.get(timeout=10)["run"] == "run-0003-abc" and spoke.inbox.empty()
