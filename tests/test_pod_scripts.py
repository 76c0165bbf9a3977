"""The pod programs as the pods run them (`python3 -I /etc/deepspeed/scripts PROGRAM`, from the rendered chart's
ConfigMap), for real: a non-root sshd per worker host and the launcher's meeting of its workers, the rank stopper and
the watchdog, in network namespaces built from the rendered chart."""

import re
import time
from pathlib import Path

import pytest

from tests.support.chart import HELM, ROOT, render_chart
from tests.support.harness import Cluster, ensure_user, namespaces_available, wait_for

REASON = namespaces_available() or (None if HELM else "no helm binary; run `make setup`")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SCRIPTS, CONFIG = "/etc/deepspeed/scripts", "/etc/deepspeed/config"
PROGRAM = f"python3 -I {SCRIPTS}"  # a pod program, as the pods' shells run it
WAIT = f"source {SCRIPTS}/ssh-setup.sh && {PROGRAM} wait-for-workers"


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
        # The launcher's clean-up runs on each worker in the same session as its check, once, its output logged.
        result = cluster.exec(launcher, ["bash", "-c", f"{WAIT} {CONFIG}/hostfile 30 1 'echo cleared on $(hostname)'"],
                              timeout=60)
        assert result.returncode == 0, result.stdout
        assert "all 2 workers are reachable" in result.stdout
        cleared = re.findall(r"^cleared on (\S+)$", result.stdout, flags=re.M)
        assert sorted(cleared) == sorted(w.hostname for w in cluster.pods_of("worker")), result.stdout
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
                  f"{PROGRAM} wait-for-workers {CONFIG}/hostfile 1 1")
        result = cluster.exec(launcher, ["bash", "-c", script], timeout=30)
        assert result.returncode == 1
        assert "Host key verification failed" in result.stdout



def test_wait_for_workers_waits_for_workers_of_the_current_template(docs):
    """During a rollout, a pod of the previous revision still answers SSH: the launcher must not start on it."""
    with Cluster(docs) as cluster:
        old = cluster.pods_of("worker")[1]
        old.container = {**old.container, "env": [
            {**e, "value": "0123456789abcdef"} if e["name"] == "DS_WORKER_TEMPLATE" else e
            for e in old.container["env"]]}
        launcher = start_workers(cluster, 2)
        result = cluster.exec(launcher, ["bash", "-c", f"{WAIT} {CONFIG}/hostfile 3 1 'echo cleared on $(hostname)'"],
                              timeout=60)
        assert result.returncode == 1, result.stdout
        expected = next(e["value"] for e in launcher.container["env"] if e["name"] == "DS_WORKER_TEMPLATE")
        assert f"  {old.fqdn}: runs worker template 0123456789abcdef, not {expected}" in result.stdout
        assert f"  {cluster.pods_of('worker')[0].fqdn}:" not in result.stdout
        # The clean-up ran on the current worker only, once: never on a pod of an earlier revision.
        assert re.findall(r"^cleared on (\S+)$", result.stdout, flags=re.M) == [cluster.pods_of("worker")[0].hostname]


def test_the_sshd_probe_reads_the_socket_table_and_sshd_logs_nothing(docs):
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 1)
        worker = cluster.pods_of("worker")[0]
        probe = next(c for c in docs if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0][
            "readinessProbe"]["exec"]["command"]
        for _ in range(3):
            assert cluster.exec(worker, probe, timeout=10).returncode == 0
        assert cluster.exec(launcher, probe, timeout=10).returncode == 1  # nothing listens there
        assert "kex_exchange_identification" not in worker.log() and "Connection closed" not in worker.log()


FAKE_LAUNCH = """
import subprocess, sys
# One child per state: `starting` and `training` ignore SIGTERM (as a rank blocked in a C++ collective
# would), the third acknowledges it and exits after a short save.
rank = '''
import os, signal, sys, time
from train import rankstate
state = sys.argv[1]
rankstate.report("training" if state == "acks" else state)
if state == "acks":
    def handle(*_):
        rankstate.report("stopping")
        time.sleep(3)
        sys.exit(0)
    signal.signal(signal.SIGTERM, handle)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(1)
'''
children = [subprocess.Popen([sys.executable, "-c", rank, s, "--local_rank=0"])
            for s in ("starting", "training", "acks")]
print("codes", [c.wait() for c in children], flush=True)
"""


def test_kill_ranks_does_not_hold_the_pod_for_ranks_that_cannot_save(docs):
    """A rank that finished no step is killed at once, one that does not answer SIGTERM after a short wait;
    only a rank that acknowledged gets the grace period (here 60 s) to save."""
    with Cluster(docs) as cluster:
        worker = cluster.pods_of("worker")[0]
        script = (f"cat > /tmp/fake_launch.py <<'EOF'\n{FAKE_LAUNCH}\nEOF\n"
                  f"export DS_KILL_GRACE_SECONDS=60 PYTHONPATH={ROOT}; "
                  # $(echo launch): this shell's own command line must not look like a launcher
                  "python3 /tmp/fake_launch.py deepspeed.launcher.$(echo launch) > /tmp/launch.log 2>&1 & "
                  # the three state files (not their .stacks beside them); the loop ran out its 20 s before
                  "for i in $(seq 100); do [[ $(ls $DS_RANK_STATE_DIR 2> /dev/null | grep -c '^[0-9]*$') == 3 ]] "
                  "&& break; sleep 0.2; done; "
                  f"start=$SECONDS; {PROGRAM} stop-ranks; echo \"took $((SECONDS - start))s\"; wait; "
                  "cat /tmp/launch.log")
        started = time.monotonic()
        result = cluster.exec(worker, ["bash", "-c", script], timeout=90)
        elapsed = time.monotonic() - started
        out = result.stdout
        assert re.search(r"SIGKILL to \d+: no step finished since it started", out), out
        assert re.search(r"SIGKILL to \d+: no answer to SIGTERM in 10s", out), out
        assert "codes [-9, -9, 0]" in out, out
        assert int(re.search(r"took (\d+)s", out).group(1)) <= 15 and elapsed < 40, out


FAKE_RANK = """
import sys, time
from train import rankstate
rankstate.report(sys.argv[1], step=7)
time.sleep(120)
"""


def test_the_watchdog_ends_a_save_that_never_ends_and_never_judges_a_stopping_rank(docs):
    """A rank stopped in the middle of a save hangs its peers there too: `saving` has its own budget (here 2 s),
    not none. A rank that acknowledged SIGTERM (`stopping`) is the grace period's to end, not the watchdog's."""
    with Cluster(docs) as cluster:
        worker = cluster.pods_of("worker")[0]
        script = (f"cat > /tmp/fake_rank.py <<'EOF'\n{FAKE_RANK}\nEOF\n"
                  f"export PYTHONPATH={ROOT} DS_HANG_DETECTION=on DS_HANG_STARTUP_SECONDS=100 "
                  "DS_HANG_STEP_SECONDS=100 DS_HANG_CHECKPOINT_SECONDS=2; "
                  "python3 /tmp/fake_rank.py stopping --local_rank=1 & stopping=$!; "
                  "python3 /tmp/fake_rank.py saving --local_rank=0 & saving=$!; "
                  f"{PROGRAM} watchdog & dog=$!; "
                  "wait $saving; echo \"saving rank: $?\"; wait $stopping; echo \"stopping rank: $?\"; "
                  "kill $dog; echo \"pids saving=$saving stopping=$stopping\"")
        result = cluster.exec(worker, ["bash", "-c", script], timeout=60)
        out = result.stdout
        saving, stopping = re.search(r"pids saving=(\d+) stopping=(\d+)", out).groups()
        hung = next(line for line in out.splitlines() if "hang on" in line)
        assert f"(pid {saving}, " in hung and "(budget 2s, saving after step 7)" in hung, out
        assert f"(pid {stopping}, " not in hung, out
        assert "saving rank: 137" in out and "stopping rank: 137" in out, out  # the attempt ends for every rank


def process_stat(pid: str) -> list[str]:
    """A process's /proc stat fields after its name (state, ppid, ...), or [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def test_a_pods_entrypoint_reaps_every_orphan_like_an_init(docs):
    """The worker's entrypoint is PID 1 of its container: a process orphaned there (a rank whose DeepSpeed launcher
    died, a launcher whose SSH session closed, a rank tagger's prefixer) is reaped when it ends, never left a zombie
    that looks alive to the rank stopper waiting for it."""
    with Cluster(docs) as cluster:
        launcher = start_workers(cluster, 1)
        worker = cluster.pods_of("worker")[0]
        # Over SSH, as the launcher starts ranks: a session that leaves a short-lived child behind, which is
        # reparented to the worker's PID 1 when the session ends, then ends itself.
        orphaning = cluster.exec(launcher, ["bash", "-c", f"source {SCRIPTS}/ssh-setup.sh && ssh -F ~/.ssh/config "
                                            f"{worker.fqdn} '( sleep 1 & ); exit 0'"], timeout=30)
        assert orphaning.returncode == 0, orphaning.stdout
        procs = [p.name for p in Path("/proc").glob("[0-9]*")]
        init = next(pid for pid in procs if process_stat(pid)[1:2] == [str(worker.process.pid)])  # the pod's PID 1

        def children() -> list[tuple[str, str]]:
            """(state, command) of every child of the pod's PID 1 (a zombie has no network namespace left)."""
            found = []
            for proc in Path("/proc").glob("[0-9]*"):
                fields = process_stat(proc.name)
                try:
                    if fields[1:2] == [init]:
                        found.append((fields[0], (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
                except OSError:
                    continue  # gone meanwhile
            return found

        # The orphan sleeps, then ends; reaped, it leaves no zombie. Never reaped, the wait runs out.
        wait_for(lambda: not [s for s, command in children() if s == "Z" or command.startswith("sleep 1")], 30,
                 "the orphan to end and be reaped", lambda: str(children()))
