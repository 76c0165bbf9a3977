"""Cluster tier: the chart on a real Kubernetes (`make test-cluster`: the one-node cluster of ../shared/k8s, or
any cluster through KUBECONFIG + DS_IMAGE). What the netns tier cannot see: the kubelet applying securityContext
and probes, the Job and StatefulSet controllers, cluster DNS, the scale-down through the API.

Each test installs into a namespace of its own, with values sized for a 2-CPU node
(charts/deepspeed-training/ci/09-small-node-values.yaml). Elsewhere it skips with the reason.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

from podruntime import protocol
from scripts.deployctl import why
from tests.support.chart import CHART, HELM, ROOT
from tests.support.prometheus import PROMETHEUS, dashboard_queries, query, scraping
from tests.support.train_run import cpu_ds_config

KUBECONFIG, IMAGE = os.environ.get("KUBECONFIG", ""), os.environ.get("DS_IMAGE", "")
SIDECAR_IMAGE = os.environ.get("DS_SIDECAR_IMAGE", "")  # the progress sidecar's (make image-sidecar); "": DS_IMAGE
SMALL_NODE = CHART / "ci" / "09-small-node-values.yaml"
RELEASE = "ci"
LAUNCHER = f"{RELEASE}-deepspeed-training-launcher-1"  # one Job per Helm revision
WORKERS = f"{RELEASE}-deepspeed-training-worker"
NOSSH_WORKERS = f"{RELEASE}-deepspeed-training-worker-r1"  # launchMode nossh: the workers' Indexed Job
# Shorter than the defaults, long enough that a step or a save slowed by another test's pods beside it (two run at
# once) is never a hang: a stopped rank is found by its signals (hangDetection.signalSeconds, 20 s) first.
HANG_BUDGETS = {"enabled": True, "startupSeconds": 120, "stepSeconds": 30, "checkpointSeconds": 30}


def skip_reason() -> str | None:
    if not KUBECONFIG or not Path(KUBECONFIG).is_file():
        return "no cluster: `make test-cluster` brings one up (root, ../shared/k8s), or set KUBECONFIG and DS_IMAGE"
    if not IMAGE:
        return "DS_IMAGE is not set: the CPU image (make image) loaded into the cluster"
    if HELM is None:
        return "no helm binary; run `make setup`"
    probe = subprocess.run(["kubectl", "cluster-info", "--request-timeout=5s"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the cluster in {KUBECONFIG} does not answer: {probe.stderr.strip()[:200]}"
    return None


REASON = skip_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def kubectl(*args: str, namespace: str, check: bool = True, timeout: float = 60) -> str:
    proc = subprocess.run(["kubectl", "--namespace", namespace, *args], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def get(kind: str, name: str, namespace: str) -> dict:
    return json.loads(kubectl("get", kind, name, "-o", "json", namespace=namespace))


def wait_for(predicate, timeout: float, what: str, diagnose=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose()}")


def job_outcome(namespace: str, job: str = LAUNCHER) -> str | None:
    """"Complete" or "Failed" once the Job has that condition, wherever it stands in the list (Kubernetes >= 1.31
    lists SuccessCriteriaMet first; pytest-helm-charts 1.3.5's wait reads only the first condition)."""
    conditions = get("job", job, namespace).get("status", {}).get("conditions", [])
    done = [c["type"] for c in conditions if c["type"] in ("Complete", "Failed") and c["status"] == "True"]
    return done[0] if done else None


def diagnose(namespace: str) -> str:
    pods = kubectl("get", "pods", "-o", "wide", namespace=namespace, check=False)
    events = kubectl("get", "events", "--sort-by=.lastTimestamp", namespace=namespace, check=False)
    logs = kubectl("logs", f"job/{LAUNCHER}", "--tail=60", namespace=namespace, check=False)
    return f"{pods}\n{events[-3000:]}\n{logs}\n{failed_container_logs(namespace)}"


def failed_container_logs(namespace: str) -> str:
    """The last lines of every container (init containers included) that exited non-zero: an Init:Error shows why."""
    out = []
    for pod in json.loads(kubectl("get", "pods", "-o", "json", namespace=namespace, check=False) or '{"items": []}')[
            "items"]:
        status = pod.get("status", {})
        for container in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
            state = container.get("state", {}).get("terminated") or container.get("lastState", {}).get("terminated")
            if state and state.get("exitCode"):
                log = kubectl("logs", pod["metadata"]["name"], "-c", container["name"], "--tail=20",
                              namespace=namespace, check=False)
                out.append(f"--- {pod['metadata']['name']}/{container['name']} exited {state['exitCode']}:\n{log}")
    return "\n".join(out[:6])


def launcher_attempts(namespace: str) -> list[tuple[str, str]]:
    """(pod, log) of every launcher pod, oldest first."""
    pods = json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/component=launcher", "-o", "json",
                              namespace=namespace))["items"]
    pods.sort(key=lambda p: p["metadata"]["creationTimestamp"])
    return [(f"{p['metadata']['name']} ({p['status'].get('phase')})",
             kubectl("logs", p["metadata"]["name"], namespace=namespace, check=False)) for p in pods]


def launcher_logs(namespace: str) -> str:
    """Every launcher pod's log, oldest first."""
    return "\n".join(log for _, log in launcher_attempts(namespace))


def attempts_summary(namespace: str, chars: int = 5000) -> str:
    """The end of each launcher pod's log, so that a failure says why each attempt ended."""
    return "\n".join(f"===== {pod}\n{log[-chars:]}" for pod, log in launcher_attempts(namespace))


def worker_exec(namespace: str, ordinal: int, *argv: str, check: bool = True) -> str:
    return kubectl("exec", f"{WORKERS}-{ordinal}", "-c", "worker", "--", *argv, namespace=namespace, check=check)


@pytest.fixture
def namespace(namespace_factory):
    """A namespace of the test's own. pytest-helm-charts' module-scoped factory deletes them all at the module's
    end and waits for them together (the namespace controller takes 6-11 s for each: one wait, not ten); the ended
    test's ranks go at once instead of keeping the node's 2 CPUs busy."""
    name = namespace_factory(f"ds-{uuid.uuid4().hex[:8]}").metadata["name"]
    yield name
    kubectl("delete", "statefulsets,jobs,pods", "--all", "--grace-period=0", "--force", "--wait=false",
            namespace=name, check=False)


@pytest.fixture
def shared_claim(namespace) -> str:
    """A ReadWriteMany PVC named "checkpoints": local-k8s's, or one of DS_RWX_STORAGE_CLASS elsewhere."""
    if os.environ.get("LOCAL_K8S"):
        subprocess.run([os.environ["LOCAL_K8S"], "pvc", os.environ["LOCAL_K8S_STATE"], namespace, "checkpoints",
                        "1Gi"], check=True, capture_output=True)
    elif os.environ.get("DS_RWX_STORAGE_CLASS"):
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints"},
                 "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": os.environ["DS_RWX_STORAGE_CLASS"],
                          "resources": {"requests": {"storage": "1Gi"}}}}
        subprocess.run(["kubectl", "-n", namespace, "apply", "-f", "-"], input=json.dumps(claim), text=True,
                       check=True, capture_output=True)
    else:
        pytest.skip("needs a ReadWriteMany volume: the local cluster makes one; elsewhere set DS_RWX_STORAGE_CLASS")
    return "checkpoints"


def install(namespace: str, steps: int, action: str = "install", check: bool = True, **values
            ) -> subprocess.CompletedProcess:
    repository, _, tag = IMAGE.rpartition(":")
    # The chart's collective timeout (10 min), not a short one: it also bounds the start-up rendezvous, and on a
    # loaded 2-CPU node the ranks of a retry can start more than 30 s apart (a 30 s timeout failed a retry in CI).
    # TORCHDYNAMO_DISABLE: no program here compiles; it spares each rank importing torch's compiler (as the e2e tier).
    layer = {"image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
             "env": [{"name": "TORCHDYNAMO_DISABLE", "value": "1"}],
             "progress": {"image": SIDECAR_IMAGE},
             "deepspeed": {"config": cpu_ds_config(stage=2, micro=4)},
             "train": {"config": {"steps": steps, "log_every": 5, "checkpoint_every": 10,
                                  "model": {"n_layer": 2, "d_model": 64, "seq_len": 32},
                                  **values.pop("train_config", {})}}}
    layer.update(values)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(layer, f)
        f.flush()
        proc = subprocess.run([HELM, action, RELEASE, str(CHART), "--namespace", namespace, "-f", str(SMALL_NODE),
                               "-f", f.name], capture_output=True, text=True)
    assert proc.returncode == 0 or not check, f"helm {action}: {proc.stderr}"
    return proc


def stop_endless_job(namespace: str) -> None:
    """Ends a test's endless run at once: the namespace's teardown would otherwise wait out the ranks' SIGTERM
    saves (up to the pods' grace period)."""
    kubectl("delete", "jobs,statefulsets,pods", "--all", "--grace-period=0", "--force", "--wait=false",
            namespace=namespace, check=False)


def latest_checkpoint(namespace: str) -> str:
    return worker_exec(namespace, 0, "cat", "/checkpoints/latest", check=False).strip()


def progress_data(namespace: str) -> dict:
    return get("configmap", f"{RELEASE}-deepspeed-training-progress", namespace).get("data") or {}


def logged_steps(namespace: str) -> list[int]:
    logs = kubectl("logs", f"job/{LAUNCHER}", namespace=namespace, check=False)
    return [int(s) for s in re.findall(r"INFO step (\d+)/", logs)]


def check_progress_while_training(namespace: str) -> None:
    """The progress ConfigMap follows the rank-0 log within 10 s of a logged step; the sidecar's token can get and
    patch that one ConfigMap and nothing else; worker 0's sidecar serves the metrics."""
    logged = wait_for(lambda: (steps := logged_steps(namespace)) and (steps[-1], time.monotonic()), 60,
                      "a logged step", lambda: diagnose(namespace))
    shown = wait_for(lambda: int((data := progress_data(namespace)).get("step", "0")) >= logged[0]
                     and (time.monotonic(), data), 30, f"the progress ConfigMap to reach step {logged[0]}",
                     lambda: f"{progress_data(namespace)}\n{diagnose(namespace)}")
    assert shown[0] - logged[1] < 10, (shown[0] - logged[1], shown[1])
    # The summary is the ledger owner's (the launcher's sidecar), which reads rank 0's keys back: a beat behind them.
    summary = r"(training|saving) \| step (\d+)/100000 \(\d+\.\d%\) \| loss \d+\.\d{4} \| [\d,]+ tokens/s " \
              r"\| eta \d+:\d\d:\d\d \| .*attempt 1 \(0 of 2 failures used, 0 preemptions\)"
    wait_for(lambda: (found := re.fullmatch(summary, progress_data(namespace).get("summary", "")))
             and int(found[2]) >= logged[0], 30, f"the summary to show training at step {logged[0]} or later",
             lambda: f"{progress_data(namespace)}\n{diagnose(namespace)}")
    account = f"system:serviceaccount:{namespace}:{RELEASE}-deepspeed-training"
    for verb, resource, allowed in (("patch", f"configmap/{RELEASE}-deepspeed-training-progress", "yes"),
                                    ("get", f"configmap/{RELEASE}-deepspeed-training-progress", "yes"),
                                    ("patch", f"configmap/{RELEASE}-deepspeed-training-config", "no"),
                                    ("list", "configmaps", "no"), ("patch", f"job/{LAUNCHER}", "no"),
                                    ("create", "pods", "no")):
        answer = kubectl("auth", "can-i", verb, resource, f"--as={account}", namespace=namespace, check=False)
        assert answer.strip() == allowed, (verb, resource, answer)
    def metrics(pod: str) -> str:
        return kubectl("exec", pod, "-c", "progress", "--", "python3", "-c", "import urllib.request; print("
                       "urllib.request.urlopen('http://127.0.0.1:9400/metrics').read().decode())", namespace=namespace)

    # Worker 0's sidecar: rank 0's progress and its pod's rank; the launcher's: the job's (no release label: the
    # PodMonitor takes it from the pod).
    for name in ("deepspeed_training_step ", "deepspeed_training_loss ", "deepspeed_training_tokens_per_second ",
                 'deepspeed_training_rank_step{rank="0"}'):
        assert name in metrics(f"{WORKERS}-0"), metrics(f"{WORKERS}-0")
    launcher = json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/component=launcher", "-o", "json",
                                  namespace=namespace))["items"][0]["metadata"]["name"]
    for name in ("deepspeed_training_attempt 1.0", 'deepspeed_training_state{state="'):
        assert name in metrics(launcher), metrics(launcher)
    worker0 = metrics(f"{WORKERS}-0")
    print(f"\nkubectl get configmap {RELEASE}-deepspeed-training-progress -o jsonpath='{{.data.summary}}': "
          f"{shown[1]['summary']}\n/metrics of worker 0, training:\n"
          + "\n".join(line for line in worker0.splitlines() if not line.startswith("#")))


def check_the_dashboard_on_a_real_prometheus(namespace: str) -> None:
    """A real Prometheus on this host scrapes every pod's sidecar (pod IPs: the local cluster's bridge) as the
    chart's PodMonitor would (its sampleLimit, the release from the pod's labels), and every query of the chart's
    dashboard returns a series for this release: the workers' ranks and rank 0's progress, the launcher's job."""
    if not (PROMETHEUS and os.environ.get("LOCAL_K8S")):
        print("dashboard queries not run here: needs `prometheus` (make setup) and the local cluster's pod network")
        return
    pods = json.loads(kubectl("get", "pods", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "json",
                              namespace=namespace))["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
    with scraping({(namespace, RELEASE): [f"{p['status']['podIP']}:9400" for p in running]},
                  sample_limit=40 + 3 * 1) as port:  # the PodMonitor's for gpusPerWorker 1 (tests/test_sidecar.py)
        wait_for(lambda: len(query(port, "deepspeed_training_rank_step")) == 2
                 and query(port, "deepspeed_training_goodput_seconds") and query(port, "deepspeed_training_attempt"),
                 60, "Prometheus to scrape the workers and the launcher")
        for expr in dashboard_queries(namespace, RELEASE):
            assert query(port, expr), expr


def test_the_chart_alone_refuses_a_config_every_rank_would_refuse_before_creating_the_release(namespace):
    """`helm install` without the glue: the config check hook runs the train package's check in the image, Helm
    prints its one line, and nothing of the release (workers, launcher, Service) is created."""
    started = time.monotonic()
    proc = install(namespace, steps=60, check=False, deepspeed={"config": {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}})
    took = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert ("config check failed: ds_config deepspeed.config (/etc/deepspeed/config/ds_config.json): "
            "train_batch_size 16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x 2 "
            "data-parallel ranks") in output, output
    assert "ci-deepspeed-training-config-check" in proc.stderr, proc.stderr  # Helm names the failed hook
    made = kubectl("get", "statefulsets,services,jobs,pods", "-o", "name", namespace=namespace).split()
    assert all("config-check" in name for name in made), made
    print(f"\nhelm install refused in {took:.1f}s:\n{output.strip()}")


def rights(namespace: str, account: str) -> set[tuple[str, str, str]]:  # (resource.group, name, verb)
    """(resource, resourceName, verb) the API server grants `account` in `namespace`, from outside the pods: the
    SelfSubjectRulesReview that `kubectl auth can-i --list` prints, as the account (impersonated), less what every
    authenticated account may do (ask what it may do)."""
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
              "spec": {"namespace": namespace}}
    proc = subprocess.run(["kubectl", "create", "--validate=false", "-o", "json", "-f", "-",
                           f"--as=system:serviceaccount:{namespace}:{account}"], input=json.dumps(review),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    granted = set()
    for rule in json.loads(proc.stdout)["status"].get("resourceRules", []):
        if set(rule.get("resources", [])) & {"selfsubjectaccessreviews", "selfsubjectrulesreviews",
                                               "selfsubjectreviews"}:
            continue  # any account may ask what it may do
        for group in rule.get("apiGroups", [""]):
            for resource in rule.get("resources", []):
                for name in rule.get("resourceNames", ["*"]):
                    granted |= {(f"{resource}{'.' + group if group else ''}", name, verb)
                                for verb in rule.get("verbs", [])}
    return granted


def test_each_account_holds_only_its_own_releases_rights(namespace):
    """The accounts the chart binds, from the API server's side: the release's own account may get and patch its
    progress ConfigMap and patch its workers' scale, and nothing else; a second release running as a shared account
    (a platform's) gets no Role at all, so it holds none of the first's rights; the config check's account none.
    The pods never get scheduled here (a scheduler nobody runs): the rights are the objects'."""
    unscheduled = {"scheduling": {"schedulerName": "nobody"}, "configCheck": {"enabled": False}}
    install(namespace, steps=10, **unscheduled)
    kubectl("create", "serviceaccount", "platform-trainer", namespace=namespace)
    proc = subprocess.run([HELM, "install", "other", str(CHART), "--namespace", namespace, "-f", str(SMALL_NODE),
                           "--set", f"image.repository={IMAGE.rpartition(':')[0]}", "--set",
                           f"image.tag={IMAGE.rpartition(':')[2]}", "--set", "serviceAccount.create=false", "--set",
                           "serviceAccount.name=platform-trainer", "--set", "launcher.scaleDownWorkers=false",
                           "--set", "scheduling.schedulerName=nobody", "--set", "configCheck.enabled=false"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    own = rights(namespace, f"{RELEASE}-deepspeed-training")
    assert own == {("configmaps", f"{RELEASE}-deepspeed-training-progress", "get"),
                   ("configmaps", f"{RELEASE}-deepspeed-training-progress", "patch"),
                   ("statefulsets/scale.apps", f"{RELEASE}-deepspeed-training-worker", "patch")}, own
    assert rights(namespace, "platform-trainer") == set()  # the shared account: no Role bound to it, by any release
    assert rights(namespace, "default") == set()
    bindings = json.loads(kubectl("get", "rolebindings", "-o", "json", namespace=namespace))["items"]
    assert {s["name"] for b in bindings for s in b["subjects"]} == {f"{RELEASE}-deepspeed-training"}, bindings
    print(f"\nkubectl auth can-i --list --as=system:serviceaccount:{namespace}:{RELEASE}-deepspeed-training: "
          f"{sorted(own)}")


def test_a_kept_ssh_secret_serves_a_reinstall_of_its_project_and_never_a_new_project_under_its_name(namespace):
    """The SSH Secret outlives `helm uninstall` (resource-policy keep): a reinstall of the same project (the same
    identity, checkpoints.owner) reuses its keys; a new project that takes the name gets keys of its own. The pods
    never get scheduled here: the keys are the objects'."""
    unscheduled = {"scheduling": {"schedulerName": "nobody"}, "configCheck": {"enabled": False}}
    secret = f"{RELEASE}-deepspeed-training-ssh"

    def keys() -> dict:
        return get("secret", secret, namespace)["data"]

    install(namespace, steps=10, checkpoints={"owner": "p-llama"}, **unscheduled)
    first = keys()
    for owner, same in (("p-llama", True), ("p-newteam", False)):
        proc = subprocess.run([HELM, "uninstall", RELEASE, "--namespace", namespace, "--wait"], capture_output=True,
                              text=True)
        assert proc.returncode == 0 and get("secret", secret, namespace), proc.stderr  # kept
        install(namespace, steps=10, checkpoints={"owner": owner}, **unscheduled)
        assert (keys() == first) is same, owner
        assert get("secret", secret, namespace)["metadata"]["annotations"]["deepspeed-training/owner"] == owner


def test_make_plan_says_whether_the_job_fits_this_clusters_nodes():
    """`make plan` with this cluster as the kube context: dev's sizing (2 workers x 1 CPU, and the chart's own
    containers on top) does not fit the one 2-CPU node; this tier's sizing (ci/09) does. Nothing is installed."""
    from scripts.deployctl import fit

    plan = subprocess.run([sys.executable, "-m", "scripts.deployctl", "plan", "--env", "dev", "--project", "example"],
                          cwd=CHART.parents[1], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "  requests    2 worker pods x 1.01 CPU" in plan.stdout, plan.stdout
    assert re.search(r"  fits        on empty nodes: no: worker pod 2 of 2 \(1\.01 CPU, [^)]*\) finds no node after "
                     r"\d+ other pods? \(1 schedulable node, first fit", plan.stdout), plan.stdout
    assert re.search(r"  fits        now: (yes|no: .*finds no node)", plan.stdout), plan.stdout
    manifests = subprocess.run([HELM, "template", RELEASE, str(CHART), "-f", str(SMALL_NODE)], capture_output=True,
                               text=True, check=True).stdout
    lines = fit.fit_lines(fit.pod_groups(manifests), None)
    assert lines[0].startswith("  fits        on empty nodes: yes (1 schedulable node, first fit"), lines
    print("\n" + "\n".join(line for line in plan.stdout.splitlines() if line.startswith(("  requests", "  fits"))))
    print("\n".join(lines))


def test_make_why_says_why_a_pod_does_not_start(namespace):
    """Workers that ask for more CPU than the node has, and a launcher whose image cannot be pulled (no config check:
    it runs in that image): `make why` gives each pod's line with the cluster's reason."""
    missing = {"repository": "localhost/no-such-image", "tag": "1", "pullPolicy": "IfNotPresent"}
    install(namespace, steps=10, image=missing, worker={"resources": {"requests": {"cpu": "3"}}},
            configCheck={"enabled": False})

    def said() -> str | None:
        text = make_why(namespace, "ssh")[0]
        return text if "cannot be pulled" in text and "not scheduled:" in text else None

    text = wait_for(said, 180, "make why to say why the pods do not start",
                    lambda: kubectl("get", "pods", "-o", "wide", namespace=namespace, check=False))
    assert re.search(rf"Not running: pods {WORKERS}-[01], {WORKERS}-[01]: not scheduled: 0/1 nodes are available: 1 "
                     r"Insufficient cpu", text), text
    assert re.search(rf"Not running: pod {LAUNCHER}-\S+: container launcher: its image localhost/no-such-image:1 "
                     r"cannot be pulled \((ErrImagePull|ImagePullBackOff): ", text), text
    print(f"\nmake why:\n{text}")
    # `make deploy`'s closing check: the same lines, once they hold, and a count of the pods by phase.
    release, client = why_release(namespace, "ssh")
    started = time.monotonic()
    checked = why.settled(release, client.CoreV1Api(), client.BatchV1Api(), settle=2)  # make why saw them hold
    assert checked[0].startswith(f"pods of {RELEASE}: ") and "Pending" in checked[0], checked
    assert any("not scheduled: 0/1 nodes are available: 1 Insufficient cpu" in line for line in checked), checked
    assert any("cannot be pulled" in line for line in checked), checked
    print(f"make deploy's check ({time.monotonic() - started:.0f}s):\n" + "\n".join(checked))


# The longest tests first: the tier runs two at a time (scripts/test-cluster.sh), and a long one that starts
# last would run alone at the end.


def test_an_upgrade_mid_run_starts_the_new_launcher_on_workers_of_the_new_template(namespace, shared_claim):
    """Seen before the fix: the new launcher passed its worker check against the OLD pods at once, pdsh then hit
    a worker being replaced, and the attempt failed. Now it waits for the rollout and its first run succeeds.
    The runs are endless (150 steps take 2 s here: the first run could end before the upgrade lands); the test
    needs the new launcher's first run to resume and train on, not to finish."""
    # peak_tflops: an MFU on CPU, for the dashboard's MFU panel.
    values = {"checkpoints": {"existingClaim": shared_claim}, "train_config": {"checkpoint_every": 10,
                                                                               "peak_tflops": 1.0}}
    install(namespace, steps=100000, launcher={"scaleDownWorkers": False}, **values)
    wait_for(lambda: latest_checkpoint(namespace) >= "step_00000010", 300, "checkpoint 10",
             lambda: diagnose(namespace))
    check_the_dashboard_on_a_real_prometheus(namespace)
    # A change to the worker pod template: the StatefulSet rolls its pods one at a time.
    install(namespace, steps=100000, action="upgrade", launcher={"scaleDownWorkers": False},
            worker={"podAnnotations": {"example.com/rollout": "2"}}, **values)
    # The pre-upgrade config check ran (and passed: Helm deleted it) while the first launcher's run held the workers.
    check = f"involvedObject.name={RELEASE}-deepspeed-training-config-check"
    events = kubectl("get", "events", "--field-selector", check, "-o", "jsonpath={.items[*].reason}",
                     namespace=namespace).split()
    assert events.count("Completed") == 2, events  # the pre-install's and the pre-upgrade's
    second = f"{RELEASE}-deepspeed-training-launcher-2"

    def trained_on_after_resuming() -> str | None:
        logs = kubectl("logs", f"job/{second}", "--tail=-1", namespace=namespace, check=False)
        resumed = re.search(r"resumed from /checkpoints/step_(\d+) at step", logs)
        steps = [int(n) for n in re.findall(r"INFO step (\d+)/", logs)]
        return logs if resumed and steps and max(steps) >= int(resumed.group(1)) + 20 else None

    logs = wait_for(trained_on_after_resuming, 400, "the new launcher to resume and train 20 steps",
                    lambda: diagnose(namespace))
    assert not get("job", second, namespace)["status"].get("failed")
    # The upgrade's new Job continues the release's ledger (keyed by the install, not the Job): the first Job's
    # attempt, stopped by the upgrade, is a preemption.
    assert "attempts: attempt 2 (0 of 2 failures used, 1 preemption)" in logs, logs[:3000]
    assert "launcher: retry" not in logs, logs[:logs.index("launcher: retry")][-8000:]  # the failed first run
    stop_endless_job(namespace)
    print("the new launcher waited for the rollout:", "a pod of an earlier revision" in logs)


def endpoint_for_pods(gateway: dict[str, str]) -> str:
    """The local gateway as this cluster's pods reach it. local-s3's LOCAL_S3_ENDPOINT_FOR_PODS names the host's
    own address, which local-k8s's pods have no route to (no default route); the host's side of their bridge, which
    is also their DNS server (the kubelet's clusterDNS), is on their link, and the gateway listens there too."""
    node = json.loads(kubectl("get", "nodes", "-o", "json", namespace="default"))["items"][0]["metadata"]["name"]
    config = json.loads(kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/configz", namespace="default"))
    port = urllib.parse.urlsplit(gateway["LOCAL_S3_ENDPOINT_FOR_PODS"]).port
    return f"http://{config['kubeletconfig']['clusterDNS'][0]}:{port}"


def test_every_worker_pod_and_volume_lost_resumes_from_the_bucket_with_the_failure_budget_it_had(namespace):
    """launchMode nossh on the chart's default storage (an emptyDir per worker pod) with an S3 bucket (the real RADOS
    Gateway on this host, which the pods reach at its address): a killed rank spends one failure and the retry in
    the pods resumes from their own volumes; then every worker pod is deleted, and with it every volume: the new
    pods' restore containers fetch their parts of the newest committed checkpoint and the job's ledger from the
    bucket before the ranks start, which resume there with one failure used and the deletion a preemption."""
    from tests.support import s3

    if not os.environ.get("LOCAL_K8S") or s3.unavailable():
        pytest.skip(f"needs the local cluster and the local S3 gateway: {s3.unavailable() or 'not local'}")
    gateway = s3.up()
    bucket = s3.new_bucket(gateway)
    kubectl("create", "secret", "generic", "ckpt-s3", *(f"--from-literal={key}={gateway[key]}" for key in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")), namespace=namespace)
    install(namespace, steps=100000, launchMode="nossh", job={"runRetries": 2},
            checkpoints={"objectStore": {"bucket": bucket, "endpoint": endpoint_for_pods(gateway),
                                         "credentialsSecret": "ckpt-s3"}})
    store = s3.client(gateway)
    prefix = f"{namespace}/{RELEASE}/checkpoints/"

    def committed() -> int:
        steps = [int(m[1]) for o in store.list_objects(bucket, prefix=prefix, recursive=True)
                 if (m := re.search(r"step_(\d+)/committed\.json$", o.object_name))]
        return max(steps, default=0)

    def worker_logs() -> str:
        return kubectl("logs", "-l", f"job-name={NOSSH_WORKERS},batch.kubernetes.io/job-completion-index=0",
                       "--tail=-1", "-c", "worker", namespace=namespace, check=False)

    wait_for(lambda: committed() >= 20, 300, "a checkpoint committed in the bucket", lambda: diagnose(namespace))
    kubectl("exec", nossh_pod(namespace, 1), "-c", "worker", "--", "pkill", "-KILL", "-f", "--", "--local_rank=",
            namespace=namespace)
    wait_for(lambda: "attempt 2 (1 of 2 failures used, 0 preemptions)" in worker_logs(), 300, "the retry",
             lambda: worker_logs()[-3000:])
    before = committed()
    wait_for(lambda: committed() > before, 300, "a checkpoint of the retry in the bucket", lambda: diagnose(namespace))
    old = {nossh_pod(namespace, 0), nossh_pod(namespace, 1)}
    kubectl("delete", "pods", "-l", f"job-name={NOSSH_WORKERS}", "--wait=true", namespace=namespace, timeout=180)
    wait_for(lambda: all(nossh_pod(namespace, i) not in ("", *old) for i in (0, 1)), 300, "the new worker pods",
             lambda: diagnose(namespace))
    restored = {i: kubectl("logs", nossh_pod(namespace, i), "-c", "restore", namespace=namespace) for i in (0, 1)}
    step = int(re.search(r"restored step_(\d+) from the bucket", restored[0])[1])
    assert f"restored step_{step:08d} from the bucket into /checkpoints/step_{step:08d} (node 1's part" in restored[1]
    assert "restored the job's attempts records" in restored[0], restored[0]
    logs = wait_for(lambda: (log := worker_logs()) and f"resumed from /checkpoints/step_{step:08d} at step {step}"
                    in log and log, 300, "the new pods to resume from the bucket's checkpoint",
                    lambda: worker_logs()[-4000:])
    # The failure budget the job had: one failure used, and the deletion of its pods a preemption.
    assert "attempt 3 (1 of 2 failures used, 1 preemption)" in logs, logs[-4000:]
    print(f"\nrestore containers: {restored[0].strip()} | {restored[1].strip()}")
    stop_endless_job(namespace)


def test_nossh_a_stopped_rank_on_the_second_host_is_named_in_the_progress_configmap(namespace):
    """nossh on per-pod volumes (no shared diagnostics/): worker 1's report reaches worker 0 at the start barrier,
    whose sidecar names the culprit in the ConfigMap as the retry in the pods starts. Then worker 1's pod is deleted
    (a preemption) and its replacement resumes from the copy worker 0 keeps of its part (a force delete is the same on
    Kubernetes 1.36: its containers get SIGTERM; the ssh test below does one); then both pods are deleted, and the
    job stops in one line rather than train from step 0."""
    install(namespace, steps=1000, launchMode="nossh", train_config={"checkpoint_every": 20}, job={"runRetries": 1},
            hangDetection=HANG_BUDGETS)
    wait_for(lambda: "INFO step 40/" in kubectl("logs", "-l", f"job-name={NOSSH_WORKERS},batch.kubernetes.io/job-"
                                                "completion-index=0", "--tail=-1", namespace=namespace, check=False),
             300, "step 40", lambda: diagnose(namespace))
    kubectl("exec", nossh_pod(namespace, 1), "--", "pkill", "-STOP", "-f", "--", "--local_rank=", namespace=namespace)
    seen = wait_for(lambda: (data := progress_data(namespace)).get("culprit") and "attempt 2 (" in data.get(
        "summary", "") and data, 300, "the ConfigMap to name the culprit during the retry",
        lambda: f"{progress_data(namespace)}\n{diagnose(namespace)}")
    assert seen["culprit"] == f"rank 1 on {NOSSH_WORKERS}-1", seen
    assert f"hang: rank 1 on {NOSSH_WORKERS}-1 is the likely culprit (its process is stopped" in seen["reason"], seen
    assert re.search(r"attempt 2 \(1 of 1 failures used", seen["summary"]), seen
    print(f"\nkubectl get configmap {RELEASE}-deepspeed-training-progress -o jsonpath='{{.data.summary}}': "
          f"{seen['summary']}")
    text, seconds = make_why(namespace, "nossh")
    assert re.search(rf"Attempts: 1 hang at step \d+, {TOOK} \(culprit rank 1 on {NOSSH_WORKERS}-1; its stacks: "
                     rf"/checkpoints/_job/diagnostics/run-0001-\w+/{NOSSH_WORKERS}-1.txt", text), text
    lines = make_logs(namespace, "nossh", 1, 1)  # worker 1's own log holds its rank
    assert lines[0].startswith(f"== pod {NOSSH_WORKERS}-1-") and len(lines) > 2, lines
    assert all("[rank 1 attempt 1] " in line for line in lines[1:]), lines
    print(f"make why ({seconds:.2f}s):\n{text}")
    # On these per-pod volumes (the chart's default storage) worker 1's pod is deleted: the Job controller's new
    # pod starts with an empty volume and resumes from the part worker 0 keeps of it (the peer copy).
    worker0_log = lambda: kubectl("logs", nossh_pod(namespace, 0), "-c", "worker", namespace=namespace,  # noqa: E731
                                  check=False)
    wait_for(lambda: "keeping worker 1's part" in worker0_log(), 120, "a part of worker 1's kept on worker 0",
             lambda: diagnose(namespace))
    plan = re.compile(r"resuming from (step_\d+): worker 1 from the copy its peer keeps \(worker 0\)")

    def resumed_from_the_peer_copy(times: int) -> tuple[str, str] | None:
        """(the planned tag, the tag rank 0 resumed from) of the `times`th resume from the peer copy, once there."""
        log = worker0_log()
        planned = list(plan.finditer(log))
        if len(planned) < times:
            return None
        resumed = re.search(r"resumed from /checkpoints/(step_\d+) at step", log[planned[times - 1].end():])
        return (planned[times - 1][1], resumed[1]) if resumed else None

    deleted = time.monotonic()
    kubectl("delete", "pod", nossh_pod(namespace, 1), "--wait=false", namespace=namespace)
    tags = wait_for(lambda: resumed_from_the_peer_copy(1), 240, "the new pod to resume from the peer copy",
                    lambda: diagnose(namespace))
    deleted_s = time.monotonic() - deleted
    assert tags[0] == tags[1], tags
    # A deletion is a preemption: the attempt it ended spent nothing.
    wait_for(lambda: "attempt 3 (1 of 1 failures used, 1 preemption)" in progress_data(namespace).get("summary", ""),
             60, "attempt 3 to count a preemption", lambda: str(progress_data(namespace)))
    print(f"worker pod deleted (nossh): resumed from the peer copy {deleted_s:.0f}s later")
    # Both pods deleted: every volume and the ledger with them. The new worker 0 knows from the progress ConfigMap
    # that the peer copy had a step: one line, a failed Job, never a start from step 0. (Or, when the old worker 1,
    # still in its grace period, joined the new worker 0 with its holdings first: no tag every worker holds, which
    # stops the same way.)
    kubectl("delete", "pod", nossh_pod(namespace, 0), nossh_pod(namespace, 1), "--wait=false", namespace=namespace)
    reason = wait_for(lambda: "not starting from step 0" in (text := progress_data(namespace).get("reason", ""))
                      and text, 240, "the job to stop in one line", lambda: diagnose(namespace))
    assert re.search(r"config-error: (no worker holds a checkpoint any more, though the peer copy had copied step \d+|"
                     r"no checkpoint is held by every worker, on its own volume or as the copy its peer keeps: "
                     r"worker 0 holds none)", reason), reason
    wait_for(lambda: any(c["type"] == "Failed" and c["status"] == "True" for c in
                         get("job", NOSSH_WORKERS, namespace).get("status", {}).get("conditions", [])), 120,
             "the Job to fail", lambda: diagnose(namespace))
    stop_endless_job(namespace)


def test_install_trains_to_completion_with_restricted_pods_and_scales_down(namespace):
    started = time.monotonic()
    install(namespace, steps=60)
    print(f"\nhelm install (config check included) returned in {time.monotonic() - started:.1f}s")
    # `make status WATCH=1`'s loop, from this API server: a line per change (not a terminal), until the run ends.
    watching = subprocess.Popen([sys.executable, "-c", "import sys; from kubernetes import client, config; "
                                 "from scripts.deployctl.cluster import watch_progress; config.load_kube_config(); "
                                 f"sys.exit(watch_progress(client.CoreV1Api(), {namespace!r}, "
                                 f"'{RELEASE}-deepspeed-training-progress'))"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # The config check passed and Helm removed its hook objects.
    assert kubectl("get", "jobs,configmaps,serviceaccounts", "-l", "app.kubernetes.io/component=config-check", "-o",
                   "name", namespace=namespace).strip() == ""
    # While the workers run: what the kubelet made of the pod specs.
    for ordinal in (0, 1):
        wait_for(lambda o=ordinal: any(c["type"] == "Ready" and c["status"] == "True" for c in get(
            "pod", f"{WORKERS}-{o}", namespace).get("status", {}).get("conditions", [])), 240,
            f"worker {ordinal} Ready (its sshd readiness probe)", lambda: diagnose(namespace))
        assert worker_exec(namespace, ordinal, "id", "-u").strip() == "10001"
        denied = subprocess.run(["kubectl", "-n", namespace, "exec", f"{WORKERS}-{ordinal}", "--", "touch",
                                 "/probe"], capture_output=True, text=True)
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr
        assert worker_exec(namespace, ordinal, "ls", "/var/run/secrets/kubernetes.io", check=False) == ""
    # `make logs RANK=0 FOLLOW=1`'s loop: rank 0's lines as they come, until the launcher's container ends.
    release = (f"why.Release({RELEASE!r}, {namespace!r}, '{RELEASE}-deepspeed-training-progress', 'ssh', "
               f"[{LAUNCHER!r}], 1, '/checkpoints', workloads=({LAUNCHER!r}, {WORKERS!r}))")  # why_release's
    following = subprocess.Popen([sys.executable, "-c", "import sys; from kubernetes import client, config; "
                                  "from scripts.deployctl import why; config.load_kube_config(); "
                                  f"sys.exit(why.follow_rank(client.CoreV1Api(), {release}, 0, None))"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    outcome = wait_for(lambda: job_outcome(namespace), 300, "the launcher Job to finish", lambda: diagnose(namespace))
    logs = kubectl("logs", f"job/{LAUNCHER}", namespace=namespace)
    assert outcome == "Complete", diagnose(namespace)
    followed, _ = following.communicate(timeout=60)
    rank0 = followed.splitlines()[1:]
    assert following.returncode == 0 and followed.startswith(f"== pod {LAUNCHER}-"), \
        (following.returncode, followed[:2000])
    assert rank0 and all(re.match(r"(\S+: )?\[rank 0 attempt 1\] ", line) for line in rank0), followed[-3000:]
    assert any("INFO step 60/60" in line for line in rank0), followed[-3000:]
    assert "wait-for-workers: all 2 workers are reachable" in logs
    assert "INFO step 60/60" in logs
    job = get("job", LAUNCHER, namespace)
    assert job["status"].get("succeeded") == 1 and not job["status"].get("failed")
    launcher_pod = job["spec"]["template"]["spec"]
    assert launcher_pod["automountServiceAccountToken"] is False  # the tenant's image holds no token
    wait_for(lambda: get("statefulset", WORKERS, namespace)["spec"]["replicas"] == 0, 60,
             "the launcher pod's sidecar to scale the workers to 0")
    sidecar_log = kubectl("logs", f"job/{LAUNCHER}", "-c", "progress", namespace=namespace)
    assert f"scaled statefulset {namespace}/{WORKERS} to 0 replicas: the run succeeded" in sidecar_log, sidecar_log
    # The progress ConfigMap's last word, from the sidecars of rank 0's pod and of the launcher (the ledger).
    # The summary is the ledger owner's, from rank 0's keys read back a beat later: waited for, not read once.
    done = (r"done \| step 60/60 \(100\.0%\) \| loss \d+\.\d{4} \| [\d,]+ tokens/s \| eta 0:00:00 \| "
            r"checkpoint at step 60 \| (peer copy at step \d+( \(\d+ steps behind\))? \| )?goodput \d+\.\d% \| "
            r"attempt 1 \(0 of 2 failures used, 0 preemptions\)")
    final = wait_for(lambda: re.fullmatch(done, (data := progress_data(namespace)).get("summary", "")) and data, 30,
                     "the progress ConfigMap's summary to say done", lambda: str(progress_data(namespace)))
    # The job's wall time, split into measured buckets that add up, with little left unaccounted.
    split = {name: float(seconds) for name, seconds in re.findall(r"([a-z-]+) (-?[\d.]+)s", final["goodput"])}
    wall = split.pop("wall")
    assert abs(sum(split.values()) - wall) < 0.5 and abs(split["unaccounted"]) < max(0.02 * wall, 3), final
    print(f"\nkubectl get configmap {RELEASE}-deepspeed-training-progress -o jsonpath='{{.data.summary}}': "
          f"{final['summary']}")
    try:
        watched, _ = watching.communicate(timeout=60)  # it ended with the run
    except subprocess.TimeoutExpired:
        watching.kill()
        raise AssertionError(f"make status WATCH=1 did not end with the run: {watching.communicate()[0][-3000:]}"
                             ) from None
    lines = watched.splitlines()
    assert watching.returncode == 0 and lines[-1].startswith("done | step 60/60 "), watched[-3000:]
    assert len(set(lines)) == len(lines) >= 3, watched  # it followed the changes: pending, starting, ..., done
    print(f"make status WATCH=1: {len(lines)} lines, the last: {lines[-1]}")


def test_a_killed_rank_spends_the_budget_and_the_job_fails_with_the_reason_in_the_pod(namespace, shared_claim):
    """runRetries 0: the first failed run spends the job's budget; the launcher exits with the ledger's status
    and the chart's podFailurePolicy fails the Job at once (no new pod), saying why where `kubectl get/describe
    pod` shows it (terminationMessagePolicy)."""
    install(namespace, steps=100000, train_config={"checkpoint_every": 0}, launcher={"scaleDownWorkers": False},
            checkpoints={"existingClaim": shared_claim}, job={"runRetries": 0})
    wait_for(lambda: "INFO step 20/" in kubectl("logs", f"job/{LAUNCHER}", namespace=namespace, check=False), 300,
             "training to reach step 20", lambda: diagnose(namespace))
    worker_exec(namespace, 1, "pkill", "-KILL", "-f", "--", "--local_rank=")
    outcome = wait_for(lambda: job_outcome(namespace), 300, "the Job to fail", lambda: diagnose(namespace))
    assert outcome == "Failed", diagnose(namespace)
    job = get("job", LAUNCHER, namespace)
    assert job["status"].get("failed") == 1 and not job["status"].get("succeeded"), attempts_summary(namespace)
    reason = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")["reason"]
    assert reason == "PodFailurePolicy", job["status"]["conditions"]
    pods = json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/component=launcher", "-o", "json",
                              namespace=namespace))["items"]
    terminated = [c["state"]["terminated"] for p in pods for c in p["status"]["containerStatuses"]]
    assert [t["exitCode"] for t in terminated] == [protocol.EXIT_NOT_RETRIED], terminated
    assert "failure budget spent: 1 failed attempts, job.runRetries=0 allows 0" in terminated[0].get("message", "")
    assert terminated[0]["message"].startswith("failed | budget-spent | "), terminated[0]
    text, _ = make_why(namespace, "ssh")
    assert re.search(r"failed, cause budget-spent\.\nWhy: failure budget spent: .* the last ended: attempt 1 ended: "
                     r"program-error: a rank was killed by SIGKILL", text), text
    stop_endless_job(namespace)


def test_a_stopped_rank_is_found_by_the_watchdog_named_and_the_retry_in_the_pod_resumes(namespace, shared_claim):
    """The hang drill on a real kubelet: the watchdog runs in the restricted worker pods (no ptrace), dumps the
    stacks from inside the ranks, and ends the attempt; the launcher's retry resumes in the same pod."""
    # Enough steps that the stop lands mid-run on a fast node too (CI trained 60 steps/s: 400 steps were gone in 7 s).
    steps = 1000
    install(namespace, steps=steps, train_config={"checkpoint_every": 20}, checkpoints={"existingClaim": shared_claim},
            launcher={"scaleDownWorkers": False}, job={"runRetries": 1},
            hangDetection=HANG_BUDGETS)
    wait_for(lambda: latest_checkpoint(namespace) >= "step_00000020", 300, "checkpoint 20",
             lambda: diagnose(namespace))
    # Training goes on while the test polls: the retry must resume from at least what was saved before the stop.
    # The stop may land in a save (every 20 steps): checkpointSeconds bounds that, as stepSeconds bounds a step.
    saved_before_stop = int(latest_checkpoint(namespace).removeprefix("step_"))
    worker_exec(namespace, 1, "pkill", "-STOP", "-f", "--", "--local_rank=")
    seen = {}
    outcome = wait_for(lambda: culprit_seen(namespace, seen) and job_outcome(namespace), 300, "the Job to finish",
                       lambda: diagnose(namespace))
    # The progress ConfigMap (the launcher's sidecar, from both workers' reports) names the stopped rank on the
    # second host, not the first host's rank that waits for it (what it showed before).
    logs = launcher_logs(namespace)
    around_the_hang = logs[max(0, logs.find("attempts: attempt 2") - 5000):][:6000]
    assert seen.get("culprit") == f"rank 1 on {WORKERS}-1", (seen, around_the_hang)
    assert f"hang: rank 1 on {WORKERS}-1 is the likely culprit (its process is stopped" in seen["reason"], seen
    assert outcome == "Complete", attempts_summary(namespace)
    assert get("job", LAUNCHER, namespace)["status"].get("failed") is None, attempts_summary(namespace)
    assert re.search(r"rank 1 \(pid \d+, local rank 0\) on \S+worker-1: process stopped", logs), logs[-6000:]
    # (Whether worker 0's watchdog also reported its rank waiting depends on which budget ran out first: the stopped
    # rank's host ends the attempt at once, and the waiting rank's collective then fails. tests/test_watchdog_signals.py
    # places a waiting peer, and tests/e2e/test_hangs.py the waiting host's word across hosts.)
    retry = logs[logs.rindex("attempts: attempt 2 (1 of 1 failures used, 0 preemptions)"):]
    resumed = re.search(r"resumed from /checkpoints/step_(\d+) ", retry)
    assert resumed and saved_before_stop <= int(resumed[1]) < steps, retry[-4000:]
    assert f"INFO step {steps}/{steps}" in retry, retry[-4000:]
    # The stacks behind the report, on the shared claim.
    stacks = worker_exec(namespace, 0, "sh", "-c", "cat /checkpoints/_job/diagnostics/run-*/*worker-1.txt")
    assert "process stopped" in stacks, stacks[-2000:]
    # `make why` from the API server names the cause, the culprit and where its stacks are; `make logs` one rank's
    # lines of one attempt, out of the launcher's log where pdsh merges every rank.
    text, seconds = make_why(namespace, "ssh")
    assert re.search(rf"Attempts: 1 hang at step \d+, {TOOK} \(culprit rank 1 on {WORKERS}-1; its stacks: "
                     rf"/checkpoints/_job/diagnostics/run-0001-\w+/{WORKERS}-1.txt on its host's checkpoint volume\); "
                     rf"2 completed, {TOOK}\.", text), text
    assert "Failure budget: 1 of 1 used, 0 left" in text, text
    lines = make_logs(namespace, "ssh", 1, 2)
    assert lines[0].startswith(f"== pod {LAUNCHER}-") and len(lines) > 2, lines
    assert all("[rank 1 attempt 2] " in line for line in lines[1:]), lines
    print(f"\nmake why ({seconds:.2f}s):\n{text}\nmake logs RANK=1 ATTEMPT=2: {len(lines) - 1} lines, e.g. {lines[1]}")


TOOK = r"(\d+h\d\dm|(\d+m)?\d+s)"  # how long an attempt took, as `make why` says it: 41s, 2m03s, 1h02m


def why_release(namespace: str, mode: str):
    """This tier's release as scripts/deployctl/why.py sees it, and the API as a person's kubeconfig reaches it."""
    from kubernetes import client, config

    config.load_kube_config()
    jobs = [LAUNCHER] if mode == "ssh" else [NOSSH_WORKERS]
    return why.Release(RELEASE, namespace, f"{RELEASE}-deepspeed-training-progress", mode, jobs, 1, "/checkpoints",
                       workloads=(*jobs, WORKERS) if mode == "ssh" else tuple(jobs)), client


def make_why(namespace: str, mode: str) -> tuple[str, float]:
    """`make why`'s paragraph, read from this API server, and the seconds it took."""
    release, client = why_release(namespace, mode)
    started = time.monotonic()
    text = why.why_text(release, why.read(client.CoreV1Api(), client.BatchV1Api(), release))
    return text, time.monotonic() - started


def make_logs(namespace: str, mode: str, rank: int, attempt: int | None) -> list[str]:
    """`make logs RANK= ATTEMPT=`'s lines, from this API server."""
    release, client = why_release(namespace, mode)
    return why.rank_log(client.CoreV1Api(), release, rank, attempt)


def culprit_seen(namespace: str, seen: dict) -> bool:
    """Keeps the progress ConfigMap's data once it names a culprit; always True (a wait's side look)."""
    data = progress_data(namespace)
    if data.get("culprit") and not seen:
        seen.update(data)
    return True


def test_deleting_the_launcher_pod_saves_a_checkpoint_and_the_next_attempt_resumes(namespace, shared_claim):
    # No periodic checkpoints: any checkpoint is the one the ranks wrote on SIGTERM.
    install(namespace, steps=100000, train_config={"checkpoint_every": 0}, checkpoints={"existingClaim": shared_claim},
            launcher={"scaleDownWorkers": False}, job={"backoffLimit": 2})
    wait_for(lambda: "INFO step 20/" in kubectl("logs", f"job/{LAUNCHER}", namespace=namespace, check=False), 300,
             "training to reach step 20", lambda: diagnose(namespace))
    check_progress_while_training(namespace)
    first = json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/component=launcher", "-o", "json",
                               namespace=namespace))["items"][0]["metadata"]["name"]
    # Its log goes with the pod: followed from here, it says how the stopped attempt ended.
    follower = subprocess.Popen(["kubectl", "--namespace", namespace, "logs", "-f", first, "-c", "launcher"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kubectl("delete", "pod", first, "--wait=true", namespace=namespace, timeout=240)
    first_log = follower.communicate(timeout=30)[0]
    saved = wait_for(lambda: latest_checkpoint(namespace), 30, "the checkpoint written on SIGTERM")
    retry_log = wait_for(lambda: "resumed from" in (log := kubectl("logs", f"job/{LAUNCHER}", namespace=namespace,
                                                                   check=False)) and log, 240,
                         "a new launcher attempt to resume", lambda: diagnose(namespace))
    assert f"resumed from /checkpoints/{saved} at step {int(saved.removeprefix('step_'))}" in retry_log
    # A deletion is a stop, not a failure: the next pod's attempt spent nothing of the job's budget.
    assert "attempt 2 (0 of 2 failures used, 1 preemption)" in retry_log, retry_log[-4000:]
    wait_for(lambda: "attempt 2 (0 of 2 failures used, 1 preemption)" in progress_data(namespace).get("summary", ""),
             30, "the progress ConfigMap to show attempt 2", lambda: str(progress_data(namespace)))
    # The pods saw a SIGTERM (preempted); the API server saw whose: `make why` says the pod was deleted.
    text, _ = make_why(namespace, "ssh")
    assert re.search(rf"Attempts: 1 pod-deleted at step \d+, {TOOK} \(the pods saw preempted; the cluster: "
                     rf"pod {first}: Killing at ", text), (text, first_log[-4000:])
    stop_endless_job(namespace)


def test_on_the_charts_default_storage_a_deleted_or_force_deleted_worker_resumes_from_its_peers_copy(namespace):
    """The chart's defaults: an emptyDir per pod, no claim, no bucket. Worker 1's pod is deleted during training
    (its SIGTERM: a preemption; its stop's checkpoint goes to worker 0 within its grace period), then its
    replacement is force-deleted (no SIGTERM: nothing more copied). Each time the StatefulSet's new pod starts with
    an empty volume and the job resumes from the part worker 0 keeps of it; `make why` says where each attempt's
    checkpoint came from."""
    install(namespace, steps=100000, train_config={"checkpoint_every": 20}, job={"runRetries": 1},
            launcher={"scaleDownWorkers": False})
    launcher_log = lambda: kubectl("logs", f"job/{LAUNCHER}", "--tail=-1", namespace=namespace, check=False)  # noqa: E731
    worker1_log = lambda: kubectl("logs", f"{WORKERS}-1", "-c", "worker", namespace=namespace, check=False)  # noqa: E731
    wait_for(lambda: "this worker's part" in worker1_log(), 300, "worker 1's first part kept on worker 0",
             lambda: diagnose(namespace))
    deleted = time.monotonic()
    kubectl("delete", "pod", f"{WORKERS}-1", "--wait=false", namespace=namespace)
    plan = r"resuming from (step_\d+): worker 1 from the copy its peer keeps \(worker 0\)"
    first = wait_for(lambda: (m := re.search(plan + r"[\s\S]*resumed from /checkpoints/(step_\d+) at step",
                                              launcher_log())) and m, 240, "attempt 2 to resume from the peer copy",
                     lambda: diagnose(namespace))
    resumed_s = time.monotonic() - deleted
    assert first[1] == first[2], first[0][-2000:]
    assert "attempt 2 (0 of 1 failures used, 1 preemption)" in launcher_log()  # a deletion spends nothing
    step = int(first[1].removeprefix("step_"))
    wait_for(lambda: any(int(s) > step for s in re.findall(r"step_(\d+): this worker's part", worker1_log())), 240,
             "the new pod's next part kept on worker 0", lambda: diagnose(namespace))
    forced = time.monotonic()
    kubectl("delete", "pod", f"{WORKERS}-1", "--grace-period=0", "--force", "--wait=false", namespace=namespace)
    second = wait_for(lambda: len(re.findall(plan, log := launcher_log())) >= 2 and "attempt 3 (" in log and
                      re.search(r"attempt 3 \([\s\S]*resumed from /checkpoints/step_\d+ at step", log) and log,
                      300, "attempt 3 to resume from the peer copy", lambda: diagnose(namespace))
    forced_s = time.monotonic() - forced
    assert "config-error" not in second, second[-4000:]
    wait_for(lambda: progress_data(namespace).get("lastFault", "").startswith("attempt 3 lost "), 60,
             "rank 0's first step of attempt 3", lambda: str(progress_data(namespace)))
    text, _ = make_why(namespace, "ssh")
    assert re.search(r"The last fault: attempt 3 lost [\d.]+s to the fault before it: ", text), text
    assert re.search(r"2 \S+( at step \d+)?, " + TOOK + r", resumed from the peer copy", text), text
    print(f"\nworker pod deleted: resumed from the peer copy {resumed_s:.0f}s later; force-deleted: "
          f"{forced_s:.0f}s later\nmake why:\n{text}")
    stop_endless_job(namespace)


def test_a_rank_over_its_memory_limit_is_oom_killed_and_the_same_oom_stops_the_job(namespace):
    """A model too big for the workers' memory limit: the kernel's OOM killer ends the ranks as they build it. The
    container's memory cgroup counted it (cgroup v1 here: only the rank dies, the container lives on, so the API
    server has no OOMKilled to show): the ledger's cause is oom-killed, the retry meets the same, and the budget
    stops the job; `make why` and the Job say so."""
    install(namespace, steps=100, launchMode="nossh", job={"runRetries": 1},
            train_config={"model": {"n_layer": 12, "d_model": 2048, "n_head": 16, "seq_len": 32}},
            worker={"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1536Mi"}}})
    outcome = wait_for(lambda: job_outcome(namespace, NOSSH_WORKERS), 400, "the workers' Job to fail",
                       lambda: diagnose(namespace))
    assert outcome == "Failed", diagnose(namespace)
    data = wait_for(lambda: (d := progress_data(namespace)).get("cause") == "budget-spent" and d, 60,
                    "the ConfigMap to say budget-spent", lambda: str(progress_data(namespace)))
    text, _ = make_why(namespace, "nossh")
    assert re.search(rf"Attempts: 1 oom-killed, {TOOK}; 2 oom-killed, {TOOK}\.", text), text
    assert "the kernel's OOM killer ended a process in the container of" in data["reason"], data
    pods = json.loads(kubectl("get", "pods", "-l", f"job-name={NOSSH_WORKERS}", "-o", "json",
                              namespace=namespace))["items"]
    messages = [c["state"]["terminated"].get("message", "") for p in pods for c in p["status"]["containerStatuses"]
                if c["name"] == "worker" and c["state"].get("terminated")]
    assert any(m.startswith("failed | budget-spent | failure budget spent") for m in messages), messages
    print(f"\nmake why:\n{text}")
    stop_endless_job(namespace)


def nossh_pod(namespace: str, index: int) -> str:
    """The running pod of one completion index of the nossh workers' Job (its name has a random suffix)."""
    pods = json.loads(kubectl("get", "pods", "-l", f"job-name={NOSSH_WORKERS},batch.kubernetes.io/job-completion-"
                              f"index={index}", "-o", "json", namespace=namespace))["items"]
    running = [p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"]
    return running[0] if running else ""


def test_nossh_trains_without_ssh_and_a_killed_rank_restarts_every_worker_in_place(namespace, shared_claim):
    install(namespace, steps=120, launchMode="nossh", train_config={"checkpoint_every": 10},
            checkpoints={"existingClaim": shared_claim})
    job = get("job", NOSSH_WORKERS, namespace)
    assert job["spec"]["completionMode"] == "Indexed"
    ours = kubectl("get", "secrets,statefulsets,roles", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
                   namespace=namespace)
    # No SSH Secret, no StatefulSet, no scale Role: the progress sidecar's Role only.
    assert ours.split() == [f"role.rbac.authorization.k8s.io/{RELEASE}-deepspeed-training-progress"], ours

    def checkpoint_20():
        pod = nossh_pod(namespace, 0)
        return pod and kubectl("exec", pod, "--", "cat", "/checkpoints/latest", namespace=namespace,
                               check=False).strip() >= "step_00000020"

    wait_for(checkpoint_20, 300, "checkpoint 20", lambda: diagnose(namespace))
    # The Job controller gave worker 0 the host name the hostfile and --master_addr use.
    worker0 = nossh_pod(namespace, 0)
    assert kubectl("exec", worker0, "--", "hostname", namespace=namespace).strip() == f"{NOSSH_WORKERS}-0"
    assert kubectl("exec", worker0, "--", "pgrep", "-c", "sshd", namespace=namespace, check=False).strip() == "0"
    kubectl("exec", nossh_pod(namespace, 1), "--", "pkill", "-KILL", "-f", "--", "--local_rank=", namespace=namespace)
    outcome = wait_for(lambda: job_outcome(namespace, NOSSH_WORKERS), 400, "the workers' Job to finish",
                       lambda: diagnose(namespace))
    assert outcome == "Complete", diagnose(namespace)
    status = get("job", NOSSH_WORKERS, namespace)["status"]
    assert status.get("succeeded") == 2 and not status.get("failed")  # retried in place: no pod recreated
    logs = kubectl("logs", "-l", f"job-name={NOSSH_WORKERS},batch.kubernetes.io/job-completion-index=0",
                   "--timestamps", "--tail=-1", namespace=namespace)
    assert "starting the run, attempt 2 (1 of 2 failures used, 0 preemptions)" in logs, logs[-4000:]
    assert "resumed from /checkpoints/step_" in logs and "INFO step 120/120" in logs
    # Worker 0's sidecar (rank 0 and the ledger in one pod) left the job's last word, goodput over both attempts.
    final = wait_for(lambda: (data := progress_data(namespace)).get("state") == "done"
                     and "step 120/120 (100.0%)" in data.get("summary", "") and data, 30,
                     "the progress ConfigMap's summary to say done at step 120", lambda: str(progress_data(namespace)))
    assert "attempt 2 (1 of 2 failures used, 0 preemptions)" in final["summary"], final
    assert final["goodput"].endswith("(2 attempts)"), final
    # The kill's loss by its parts, split at the killed rank's end record and the ledger's end of the attempt.
    assert re.fullmatch(r"attempt 2 lost [\d.]+s to the fault before it: detect [\d.]+s \+ stop [\d.]+s \+ "
                        r"reschedule [\d.]+s \+ start .* \+ recompute [\d.]+s", final.get("lastFault", "")), final
