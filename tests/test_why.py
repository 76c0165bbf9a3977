"""`make why` and `make logs` (scripts/deployctl/why.py) on what the API returns, and the rank tagger
(podruntime/ranklog.py) that tags every rank's line, run as DeepSpeed's launcher runs it (the chart's
files/rank-log.py). The cluster tier reads a real drill's `make why` from a real API server
(tests/cluster/test_cluster.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from podruntime import protocol, ranklog
from scripts.deployctl import why
from tests.support.chart import ROOT, SCRIPTS

RANK_LOG = SCRIPTS / "rank-log.py"  # DeepSpeed's launcher's script for every rank
RELEASE = why.Release("demo", "ml", "demo-deepspeed-training-progress", "ssh", ["demo-deepspeed-training-launcher"],
                      2, "/checkpoints")
T = 1_780_000_000.0


def pod(name: str, **extra) -> dict:
    return {"name": name, "phase": "Running", "reason": None, "message": None, "deleted": None, "created": T - 3600,
            "node": "n1", "terminated": [], "disruption": [], "restarts": 0, **extra}


def progress(attempts: list[dict], **extra) -> dict:
    return {"state": "failed", "cause": attempts[-1]["cause"], "attempts": json.dumps(attempts),
            "run": "run-0003-1a2b3c4d", "failuresUsed": "2", "failureBudget": "2", "preemptions": "1", "attempt": "3",
            "checkpointStep": "200", **extra}


def test_why_says_each_attempt_its_cause_and_time_the_budget_the_culprit_and_its_stacks():
    observed = {"progress": progress([
        {"attempt": 1, "cause": "hang", "step": 98, "seconds": 123.4, "ended": T - 900, "culprit": "rank 1 on w-1"},
        {"attempt": 2, "cause": "preempted", "step": 150, "seconds": 60, "ended": T - 500},
        {"attempt": 3, "cause": "program-error", "step": 201, "seconds": 41, "ended": T - 100,
         "culprit": "rank 0 on w-0"}],
        reason="attempt 3 ended: program-error: a rank on w-1 was killed by SIGKILL", bucketStep="180",
        goodput="goodput 71.0% | wall 400.0s | hung 120.0s (3 attempts)",
        lastFault="attempt 3 lost 24.5s to the fault before it: detect 12.0s + reschedule 1.5s + start 6.5s"),
        # The cluster: attempt 2's SIGTERM was an eviction, attempt 3's SIGKILL the OOM killer.
        "pods": [pod("w-0"), pod("w-1", terminated=[("worker", "OOMKilled", 137, T - 110, None)], restarts=1),
                 pod("launcher", disruption=[])],
        "events": [{"object": "demo-w-1", "kind": "Pod", "type": "Warning", "reason": "Evicted", "message":
                    "The node was low on resource: memory.", "time": T - 520, "count": 1}],
        "jobs": [{"name": "demo-deepspeed-training-launcher", "conditions": [("Failed", "PodFailurePolicy",
                                                                               "exit code 3")],
                  "active": 0, "failed": 1, "succeeded": 0}]}
    text = why.why_text(RELEASE, observed)
    assert text.startswith("Release demo in namespace ml (ssh mode): failed, cause program-error."), text
    assert "1 hang at step 98, 2m03s (culprit rank 1 on w-1; its stacks: /checkpoints/_job/diagnostics/" \
           "run-0001-1a2b3c4d/w-1.txt on its host's checkpoint volume)" in text, text
    assert "2 evicted at step 150, 1m00s (the pods saw preempted; the cluster: pod demo-w-1: Evicted" in text, text
    assert "3 oom-killed at step 201, 41s (the pods saw program-error; the cluster: pod w-1, container worker: " \
           "OOMKilled (exit 137)" in text, text
    assert "Failure budget: 2 of 2 used, 0 left; 1 preemption(s), never counted" in text
    assert "Last committed checkpoint: step 200 (the bucket's: step 180)." in text
    assert "The last fault: attempt 3 lost 24.5s to the fault before it: detect 12.0s + reschedule 1.5s + start " \
           "6.5s." in text, text
    assert "Job demo-deepspeed-training-launcher: Failed (PodFailurePolicy: exit code 3); 0 active, 1 failed" in text
    assert "Pods: 3 Running." in text


def test_why_prints_nothing_raw_from_the_cluster():
    hostile = "\x1b]52;c;aGk=\x07\u202erm -rf\n" + "x" * 5000
    observed = {"progress": {**progress([{"attempt": 1, "cause": "hang", "culprit": hostile, "ended": T}]),
                             "reason": hostile, "summary": hostile, "lastFault": hostile,
                             "attempts": "not json" + hostile},
                "pods": [pod(hostile, phase=hostile, disruption=[("EvictionByEvictionAPI", hostile, T)])],
                "events": [{"object": hostile, "kind": "Pod", "type": "Warning", "reason": "Evicted",
                            "message": hostile, "time": T, "count": 1}], "jobs": []}
    text = why.why_text(RELEASE, observed)
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert all(len(line) < 2100 for line in text.splitlines()), [len(line) for line in text.splitlines()]


def test_a_sidecar_stopped_at_its_pods_end_is_no_deletion_and_the_main_container_killed_is():
    def killing(container):
        return [{"object": "demo-launcher-x", "kind": "Pod", "type": "Normal", "reason": "Killing",
                 "message": f"Stopping container {container}", "time": T, "count": 1}]
    assert why.cluster_evidence([], killing("progress"), RELEASE.main_containers) == []
    [found] = why.cluster_evidence([], killing("launcher"), RELEASE.main_containers)
    assert found["cause"] == "pod-deleted" and "demo-launcher-x" in found["text"]


def test_a_preemption_the_cluster_shows_no_reason_for_is_said_so():
    """A SIGTERM's cause is the cluster's to show (an eviction, a deletion); one it shows nothing for is said so:
    a stop that came from elsewhere, or the program's own preemption mark."""
    observed = {"progress": progress([{"attempt": 1, "cause": "preempted", "step": 40, "seconds": 30, "ended": T}]),
                "pods": [pod("w-0")], "events": [], "jobs": []}
    assert "1 preempted at step 40, 30s (nothing the cluster kept shows why)" in why.why_text(RELEASE, observed)


def test_an_attempt_keeps_the_pods_cause_without_cluster_evidence_near_its_end():
    entries = [{"attempt": 1, "cause": "program-error", "ended": T}]
    far = [{"time": T - 5000, "cause": "oom-killed", "text": "long before"}]
    assert why.refine(entries, far) == entries
    assert why.refine([{"attempt": 1, "cause": "hang", "ended": T}], [{"time": T, "cause": "oom-killed",
                                                                        "text": "x"}])[0]["cause"] == "hang"


def test_rank_lines_picks_one_rank_and_attempt_from_a_merged_log():
    log = "\n".join(["w-0: [rank 0 attempt 1] step 10", "w-1: [rank 1 attempt 1] step 10",
                     "launcher: DeepSpeed exited with status 1", "w-1: [rank 1 attempt 2] resumed",
                     "w-1: [rank 11 attempt 2] other", "[rank 1] no attempt (outside the chart)"])
    assert why.rank_lines(log, 1, None) == ["w-1: [rank 1 attempt 1] step 10", "w-1: [rank 1 attempt 2] resumed",
                                            "[rank 1] no attempt (outside the chart)"]
    assert why.rank_lines(log, 1, 2) == ["w-1: [rank 1 attempt 2] resumed"]


def test_a_ranks_own_text_never_makes_a_line_of_another_rank_in_make_logs(tmp_path):
    """The tagger and make logs split lines alike (the newline alone): a rank that writes U+2028, a form feed or a
    carriage return and then another rank's tag stays one line of its own rank's; the legitimate line beside it
    is found."""
    program = tmp_path / "program.py"
    program.write_text("import sys\nsys.stdout.write('mine\\u2028[rank 1 attempt 1] forged\\x0c[rank 1 attempt 1] "
                       "again\\n')\nprint('[rank 1 attempt 1] quoted mid-line? no: at the start, after the tag')\n")
    result = subprocess.run([sys.executable, "-u", str(RANK_LOG), str(program)], capture_output=True, timeout=60,
                            env={**os.environ, "RANK": "0", "DS_ATTEMPT": "1"})
    text = result.stdout.decode()
    assert why.rank_lines(text, 1, None) == [] and len(why.rank_lines(text, 0, 1)) == 2, text


PROGRAM = """
import os, sys, time
print("from python", flush=True)
os.write(2, b"from the fd, like C++\\n")
sys.stdout.write("bar 10%\\rbar 50%\\rbar 100%\\n")
sys.stdout.write("no newline at the end")
sys.stdout.flush()
print(" ARGS", sys.argv[1:], "PID", os.getpid(), file=sys.stderr, flush=True)
if os.environ.get("SLEEP"):
    time.sleep(60)
sys.exit(7)
"""


def test_rank_log_tags_every_line_of_the_rank_and_keeps_its_pid_arguments_and_exit_status(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    result = subprocess.run([sys.executable, "-u", str(RANK_LOG), "--local_rank=1", str(program), "--x", "y"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RANK": "5", "DS_ATTEMPT": "2"})
    assert result.returncode == 7, result
    lines = result.stdout.splitlines()
    assert lines[:3] == ["[rank 5 attempt 2] from python", "[rank 5 attempt 2] from the fd, like C++",
                         "[rank 5 attempt 2] bar 100%"], lines
    assert lines[3].startswith("[rank 5 attempt 2] no newline at the end ARGS ['--local_rank=1', '--x', 'y'] PID")
    assert result.stderr == ""


def test_rank_log_lines_outlive_the_ranks_process_tree(tmp_path):
    """DeepSpeed's launcher kills a failed rank's whole tree: the prefixer is not in it, so the rank's last line
    still comes out, and it ends once the rank is gone."""
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    rank = subprocess.Popen([sys.executable, "-u", str(RANK_LOG), str(program)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "RANK": "77", "SLEEP": "1"})
    first = rank.stdout.readline()
    assert first == b"[rank 77] from python\n"
    deadline = time.monotonic() + 30
    while b"PID" not in first and time.monotonic() < deadline:
        first = rank.stdout.readline()
    assert int(first.split(b"PID")[1]) == rank.pid  # exec: the rank is the process DeepSpeed started
    assert not psutil.Process(rank.pid).children(recursive=True)  # the prefixer is outside its tree
    prefixers = [p for p in psutil.process_iter(["cmdline"]) if "[rank 77] " in (p.info["cmdline"] or [])]
    assert [p.info["cmdline"][-4:] for p in prefixers] == [[str(SCRIPTS), "rank-prefix", "[rank 77] ", str(rank.pid)]]
    os.kill(rank.pid, signal.SIGKILL)
    assert rank.wait(timeout=30) == -signal.SIGKILL
    assert rank.stdout.read() == b""  # every writer closed: the prefixer ended


@pytest.mark.parametrize("argv", [[], ["-m"], ["--local_rank=0"]])
def test_rank_log_refuses_a_command_without_a_program(argv):
    result = subprocess.run([sys.executable, str(RANK_LOG), *argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage" in result.stderr


RAISES_LATE = """
import os, sys, time
state = os.environ["DS_RANK_STATE_DIR"]
if os.environ.get("OWN_RECORD"):
    from train import rankstate
    rankstate.report("starting")
    rankstate.beat(12)
else:  # a program that never reports: its rank's state line is the watchdog's only news of it
    with open(os.path.join(state, str(os.getpid())), "w") as f:
        f.write("training rank=4 step=12 v=2\\n")
print("some output", flush=True)
def load(path):
    raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: {path}")
load(["--no_such_option=1"])
"""


@pytest.mark.parametrize("own", [False, True])
def test_a_rank_that_dies_of_an_exception_leaves_its_last_line_for_the_ledger(tmp_path, own):
    """The prefixer is the ledger's witness of a program that never reported (its traceback's last line becomes
    the rank's end record); a rank that wrote its own keeps it."""
    from tests.support.harness import wait_for

    program, state = tmp_path / "program.py", tmp_path / "state"
    program.write_text(RAISES_LATE)
    state.mkdir()
    env = {**os.environ, "RANK": "4", "DS_RANK_STATE_DIR": str(state), "DS_RUN_ID": "run-0003-abcd",
           "PYTHONPATH": str(ROOT), **({"OWN_RECORD": "1"} if own else {})}
    result = subprocess.run([sys.executable, "-u", str(RANK_LOG), str(program)], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 1 and "[rank 4] Traceback (most recent call last):" in result.stdout, result
    wait_for(lambda: (state / "end-4.json").exists(), 30, "the end record")  # the prefixer writes it at the end
    found = json.loads((state / "end-4.json").read_text())
    assert protocol.valid_end_record(found) == found
    assert (found["run"], found["rank"], found["cause"], found["step"]) == ("run-0003-abcd", 4, "program-error", 12)
    assert found["line"] == "ValueError: Some specified arguments are not used by the HfArgumentParser: " \
                            "['--no_such_option=1']", found


def test_output_that_only_printed_a_traceback_earlier_names_no_error():
    assert ranklog.exception_line([b"Traceback (most recent call last):", b'  File "x.py", line 1',
                                          b"KeyError: 'a'", b"handled; training on", *[b"step"] * 39]) is None
    assert ranklog.exception_line([b"Traceback (most recent call last):", b"  File ...",
                                          b"RuntimeError: first", b"", b"During handling of the above exception, "
                                          b"another exception occurred:", b"", b"Traceback (most recent call last):",
                                          b"  File ...", b"OSError: [Errno 28] No space left on device"]) == \
        "OSError: [Errno 28] No space left on device"
    # torch.distributed's excepthook (once the process group exists) puts `[rankN]: ` before every line.
    assert ranklog.exception_line([b"[rank0]: Traceback (most recent call last):", b"[rank0]:   File ...",
                                          b"[rank0]: ValueError: Some specified arguments are not used"]) == \
        "ValueError: Some specified arguments are not used"


@pytest.mark.parametrize("command", ["why", "status", "logs"])
def test_the_read_only_commands_never_import_deepspeed(command):
    """make why/status/logs need the release's names, not DeepSpeed's parser (its import alone is ~1.7 s of the
    2 s they may take, bench/why.py); deploy and plan still run every check."""
    probe = ("import sys; from scripts.deployctl.cli import main; code = main(sys.argv[1:]); "
             "print(code, 'deepspeed' in sys.modules)")
    args = ["--env", "dev", "--project", "example", "--dry-run", command,
            *(["--rank", "0"] if command == "logs" else [])]
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.stdout.strip().splitlines()[-1] == "0 False", result.stdout + result.stderr


def api_of(data: dict, pods: list, events: list = (), jobs: list = (), release: str = RELEASE.name):
    """(CoreV1Api, BatchV1Api) as why.read calls them, answering with the client's own API models; the label
    selector must be the release's."""
    from kubernetes import client as k

    selector = f"app.kubernetes.io/instance={release}"

    class Core:
        def read_namespaced_config_map(self, name, namespace):
            return k.V1ConfigMap(data=data)

        def list_namespaced_pod(self, namespace, label_selector):
            assert label_selector == selector
            return k.V1PodList(items=list(pods))

        def list_namespaced_event(self, namespace):
            return k.CoreV1EventList(items=list(events))

    class Batch:
        def list_namespaced_job(self, namespace, label_selector):
            assert label_selector == selector
            return k.V1JobList(items=list(jobs))

    return Core(), Batch()


def test_a_device_its_plugin_calls_unhealthy_explains_the_newest_attempts_hang():
    """Kubernetes 1.36 reports device health per container (allocatedResourcesStatus). This machine has no device:
    the API objects are the client's own models, as the API server returns them, read by why.read."""
    from datetime import UTC, datetime

    from kubernetes import client as k

    health = [k.V1ResourceHealth(resource_id="GPU-7f3a", health="Unhealthy", message="XID 79: fell off the bus"),
              k.V1ResourceHealth(resource_id="GPU-0c21", health="Healthy")]
    status = k.V1ContainerStatus(name="worker", image="i", image_id="", ready=True, restart_count=0,
                                 allocated_resources_status=[k.V1ResourceStatus(name="nvidia.com/gpu",
                                                                                resources=health)])
    sick = k.V1Pod(metadata=k.V1ObjectMeta(name="demo-w-1", creation_timestamp=datetime.fromtimestamp(T, UTC)),
                   spec=k.V1PodSpec(containers=[k.V1Container(name="worker")], node_name="n1"),
                   status=k.V1PodStatus(phase="Running", container_statuses=[status]))
    attempts = [{"attempt": 1, "cause": "hang", "step": 40, "ended": T - 3000, "culprit": "rank 1 on w-1"},
                {"attempt": 2, "cause": "hang", "step": 98, "ended": T - 600, "culprit": "rank 1 on w-1"}]

    text = why.why_text(RELEASE, why.read(*api_of(progress(attempts), [sick]), RELEASE))
    assert "2 device-unhealthy at step 98 (the pods saw hang; the cluster: pod demo-w-1, container worker: " \
           "nvidia.com/gpu GPU-7f3a Unhealthy (XID 79: fell off the bus))" in text, text
    assert "1 hang at step 40" in text and "GPU-0c21" not in text, text  # the device's health now: the newest only
    # Nothing else the cluster saw near a hang replaces it: a deleted pod after a hang is the hang's.
    deleted = [{"time": T, "cause": "pod-deleted", "text": "x"}]
    assert why.refine([{"attempt": 1, "cause": "hang", "ended": T}], deleted)[0]["cause"] == "hang"


def test_make_why_takes_the_events_of_its_own_releases_objects_never_a_neighbours_with_a_longer_name():
    """Two projects side by side in one namespace, `llama` and `llama-7b`: the events `make why` reads are the
    release's by identity, the uid of a pod or Job it lists by its instance label, a name it renders, or a pod name
    its workloads give (a pod gone since). `llama-7b`'s evicted worker never becomes `llama`'s eviction."""
    from kubernetes import client as k

    llama = why.Release("llama", "ml", "llama-deepspeed-training-progress", "ssh",
                        ["llama-deepspeed-training-launcher"], 1, "/checkpoints", ("launcher", "worker"),
                        ("llama-deepspeed-training-launcher", "llama-deepspeed-training-worker",
                         "llama-deepspeed-training-config-check"),
                        ("llama-deepspeed-training-progress", "llama-deepspeed-training-worker"))
    live = k.V1Pod(metadata=k.V1ObjectMeta(name="llama-deepspeed-training-worker-0", uid="uid-live"),
                   spec=k.V1PodSpec(containers=[k.V1Container(name="worker")]), status=k.V1PodStatus(phase="Running"))

    def event(name: str, uid: str | None = None, reason: str = "Evicted") -> k.CoreV1Event:
        return k.CoreV1Event(metadata=k.V1ObjectMeta(name=f"{name}.1"), reason=reason, message="m", type="Warning",
                             involved_object=k.V1ObjectReference(kind="Pod", name=name, uid=uid), count=1)

    events = [event("llama-7b-deepspeed-training-worker-1", "uid-7b"),  # the neighbour's
              event("llama-deepspeed-training-worker-1x"),  # no pod name llama's workloads give
              event("llama-deepspeed-training-worker-1"),  # llama's, gone since
              event("renamed-by-nobody", "uid-live", "Killing"),  # llama's live pod, by uid
              event("llama-deepspeed-training-config-check-x7k2q", reason="BackoffLimitExceeded"),  # its hook's pod
              event("llama-deepspeed-training-launcher-0-ab12c", reason="Started"),  # an indexed Job's pod
              event("llama-deepspeed-training-worker", reason="SuccessfulCreate"),  # its StatefulSet
              event("llama-deepspeed-training-launcher-1-qq7rt", reason="Started")]  # a Job of an earlier revision

    job = k.V1Job(metadata=k.V1ObjectMeta(name="llama-deepspeed-training-launcher-1", uid="uid-job"),
                  status=k.V1JobStatus())
    seen = [e["object"] for e in why.read(*api_of({}, [live], events, [job], release="llama"), llama)["events"]]
    assert seen == ["llama-deepspeed-training-worker-1", "renamed-by-nobody",
                    "llama-deepspeed-training-config-check-x7k2q", "llama-deepspeed-training-launcher-0-ab12c",
                    "llama-deepspeed-training-worker", "llama-deepspeed-training-launcher-1-qq7rt"], seen


def test_a_pod_that_cannot_start_is_said_with_the_clusters_reason():
    """Unschedulable (the scheduler's message), an image that cannot be pulled (with the image), an init container
    that fails (its last line): each a line of `make why`, from the API objects (the client's own models); a running
    pod says nothing."""
    from kubernetes import client as k

    def pod_of(name, phase, conditions=(), statuses=(), inits=()):
        return k.V1Pod(metadata=k.V1ObjectMeta(name=name), spec=k.V1PodSpec(containers=[k.V1Container(name="worker")]),
                       status=k.V1PodStatus(phase=phase, conditions=list(conditions), container_statuses=list(statuses),
                                            init_container_statuses=list(inits)))

    def status(name, image="localhost/train:1", waiting=None, last=None):
        return k.V1ContainerStatus(name=name, image=image, image_id="", ready=False, restart_count=3,
                                   state=k.V1ContainerState(waiting=waiting),
                                   last_state=k.V1ContainerState(terminated=last))

    unscheduled = pod_of("demo-w-1", "Pending", [k.V1PodCondition(
        type="PodScheduled", status="False", reason="Unschedulable",
        message="0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available")])
    no_image = pod_of("demo-w-0", "Pending", statuses=[status("worker", "localhost/nope:1", k.V1ContainerStateWaiting(
        reason="ImagePullBackOff", message='Back-off pulling image "localhost/nope:1"'))])
    restore = pod_of("demo-w-2", "Pending", inits=[status("restore", waiting=k.V1ContainerStateWaiting(
        reason="CrashLoopBackOff", message="back-off 20s restarting failed container"),
        last=k.V1ContainerStateTerminated(exit_code=1, reason="Error", message="objectstore: listing the bucket\n"
                                          "ERROR: the bucket refused the keys (InvalidAccessKeyId)\n"))])
    running = pod_of("demo-launcher", "Running", statuses=[status("launcher")])

    api = api_of({"state": "starting"}, [unscheduled, no_image, restore, running])
    text = why.why_text(RELEASE, why.read(*api, RELEASE))
    assert "Not running: pod demo-w-1: not scheduled: 0/1 nodes are available: 1 Insufficient cpu." in text, text
    assert "Not running: pod demo-w-0: container worker: its image localhost/nope:1 cannot be pulled " \
           "(ImagePullBackOff: Back-off pulling image" in text, text
    assert "Not running: pod demo-w-2: init container restore: waits: CrashLoopBackOff (back-off 20s restarting " \
           "failed container); its last run ended: ERROR: the bucket refused the keys (InvalidAccessKeyId)." in text
    assert "demo-launcher" not in text.split("Pods:")[0], text
    # A hundred workers the scheduler cannot place are one line.
    many = [{"name": f"demo-w-{i}", "phase": "Pending", "unschedulable": "0/1 nodes are available."}
            for i in range(100)]
    assert why.not_running(many, lambda value, limit=400: value) == [
        "Not running: pods demo-w-0, demo-w-1, demo-w-2 and 97 more: not scheduled: 0/1 nodes are available."]


def test_a_job_waiting_for_admission_says_which_queue_or_gang_holds_it_and_a_neighbours_objects_say_nothing():
    """Kueue's Workload (owned by the release's Job) and a gang's PodGroup (rendered by the release, by exact name)
    that are not admitted: their own words; a neighbour's (another owner, a name that merely starts with ours) and
    an admitted one: nothing. The suspended Job says so."""
    ours, neighbours = "uid-launcher", "uid-of-demo-7b"
    release = why.Release("demo", "ml", "demo-deepspeed-training-progress", "ssh",
                          ["demo-deepspeed-training-launcher"], 2, "/checkpoints",
                          objects=("demo-deepspeed-training", "demo-deepspeed-training-launcher"))

    def workload(name, owner, *conditions, phase=None):
        return {"metadata": {"name": name, "ownerReferences": [{"uid": owner, "kind": "Job"}]},
                "status": {"conditions": [dict(zip(("type", "status", "message"), c, strict=True)) for c in conditions],
                           **({"phase": phase} if phase else {})}}

    quota = "couldn't assign flavors to pod set launcher: insufficient quota for cpu in flavor default, 3 more needed"
    objects = [
        ("Kueue workload", workload("job-demo-launcher-1a2b", ours, ("QuotaReserved", "False", quota))),
        ("Kueue workload", workload("job-demo-7b-launcher-9f9f", neighbours, ("QuotaReserved", "False", "theirs"))),
        ("Kueue workload", workload("job-demo-launcher-old", ours, ("Admitted", "True", "admitted"))),
        ("Volcano PodGroup", workload("demo-deepspeed-training", "", ("Unschedulable", "True",
                                                                     "2/3 tasks in gang unschedulable"),
                                      phase="Pending")),
        ("Volcano PodGroup", workload("demo-deepspeed-training-7b", "", ("Unschedulable", "True", "theirs"),
                                      phase="Pending")),
        ("PodGroup", {"metadata": "hostile", "status": ["x"]}),
    ]
    waiting = why.admission(objects, {ours}, release)
    assert [w["name"] for w in waiting] == ["job-demo-launcher-1a2b", "demo-deepspeed-training"], waiting
    observed = {"progress": {"state": "starting"}, "pods": [], "events": [], "admission": waiting,
                "jobs": [{"name": "demo-deepspeed-training-launcher", "conditions": [], "active": 0, "failed": 0,
                          "succeeded": 0, "suspended": True}]}
    text = why.why_text(release, observed)
    assert f"Not admitted: Kueue workload job-demo-launcher-1a2b: {quota}." in text, text
    assert "Not admitted: Volcano PodGroup demo-deepspeed-training (Pending): 2/3 tasks in gang unschedulable." in text
    assert "theirs" not in text and "7b" not in text
    assert "Job demo-deepspeed-training-launcher: suspended (not admitted yet: no pod is created)" in text, text
