"""How long `make why` and `make status` take against a real kube-apiserver (../shared/k8s, root) as the
release grows, against the target: <= 2 s with 64 workers (ENV=dev PROJECT=example's release, in its namespace).
A namespace holds what a release leaves there: the progress ConfigMap (the ledger's last 10 attempts, rank 0's
progress), the launcher Job (suspended: nothing runs), N worker pods and the launcher's pod (bound to a node that
does not exist: the API server keeps them, no kubelet runs them), and 5 events per pod. Timed: the whole command as
`make why` / `make status` run it (`python -m scripts.deployctl --env dev --project example why|status`: the
layers rendered without DeepSpeed's parser, helm template, the reads), and within it scripts/deployctl/why.py's
read() and why_text() (4 requests) and status's one read, each the median of 5 runs.

    sudo .venv/bin/python bench/why.py [--workers 2,16,64,256]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.deployctl import why  # noqa: E402

NAMESPACE, RELEASE = "ml-dev", "example"  # values/dev.yaml + values/projects/example
TARGET_S = 2.0


def populate(core, batch, client, workers: int) -> why.Release:
    labels = {"app.kubernetes.io/instance": RELEASE}
    now = time.time()
    attempts = [{"attempt": i, "cause": cause, "step": 100 * i, "seconds": 600.0, "ended": now - 600 * (10 - i),
                 **({"culprit": f"rank {i} on {RELEASE}-worker-{i}"} if cause == "hang" else {})}
                for i, cause in enumerate(["hang", "preempted", "program-error", "hang", "preempted", "oom-killed",
                                           "collective-timeout", "preempted", "hang", "program-error"], 1)]
    data = {"state": "training", "cause": "program-error", "reason": "attempt 10 ended: program-error: ...",
            "attempts": json.dumps(attempts), "history": "...", "attempt": "11", "failuresUsed": "7",
            "failureBudget": "20", "preemptions": "3", "run": "run-0011-1a2b3c4d", "checkpointStep": "1000",
            "summary": "training | step 1042/100000 ...", "goodput": "goodput 80.0% | wall 6000.0s"}
    core.create_namespaced_config_map(NAMESPACE, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=f"{RELEASE}-deepspeed-training-progress", labels=labels), data=data))
    template = client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=client.V1PodSpec(
        restart_policy="Never", containers=[client.V1Container(name="launcher", image="none")]))
    batch.create_namespaced_job(NAMESPACE, client.V1Job(
        metadata=client.V1ObjectMeta(name=f"{RELEASE}-deepspeed-training-launcher-1", labels=labels),
        spec=client.V1JobSpec(template=template, suspend=True)))
    names = [f"{RELEASE}-deepspeed-training-worker-{i}" for i in range(workers)]
    names.append(f"{RELEASE}-deepspeed-training-launcher-1-abcde")
    for name in names:
        core.create_namespaced_pod(NAMESPACE, client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels=labels), spec=client.V1PodSpec(
                node_name="absent-node", containers=[client.V1Container(name="worker", image="none")])))
        for n in range(5):
            stamp = datetime.fromtimestamp(now - 60 * n, UTC)
            core.create_namespaced_event(NAMESPACE, client.CoreV1Event(
                metadata=client.V1ObjectMeta(name=f"{name}.{n}"), type="Warning" if n % 2 else "Normal",
                reason=("Killing", "BackOff", "Pulled", "Evicted", "Started")[n], message=f"event {n} of {name}",
                involved_object=client.V1ObjectReference(kind="Pod", name=name, namespace=NAMESPACE),
                first_timestamp=stamp, last_timestamp=stamp, count=1))
    return why.Release(RELEASE, NAMESPACE, f"{RELEASE}-deepspeed-training-progress", "ssh",
                       [f"{RELEASE}-deepspeed-training-launcher-1"], 1, "/checkpoints")


def timed(run, repeat: int = 5) -> float:
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,16,64,256")
    args = parser.parse_args()
    k8s = Path(os.environ.get("LOCAL_K8S_DIR", ROOT.parent / "shared" / "k8s")) / "local-k8s.sh"
    if os.geteuid() != 0 or not k8s.exists():
        print("bench/why.py needs root and ../shared/k8s (a real kube-apiserver)")
        return 1
    from kubernetes import client, config

    state = ROOT / ".build" / "k8s-bench-why"
    rows = []
    try:
        kubeconfig = subprocess.run([str(k8s), "up", str(state)], capture_output=True, text=True,
                                    check=True).stdout.strip()
        config.load_kube_config(kubeconfig)
        core, batch = client.CoreV1Api(), client.BatchV1Api()
        for workers in [int(n) for n in args.workers.split(",")]:
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
            release = populate(core, batch, client, workers)
            text = why.why_text(release, why.read(core, batch, release))
            why_s = timed(lambda: why.why_text(release, why.read(core, batch, release)))  # noqa: B023
            status_s = timed(lambda: core.read_namespaced_config_map(release.progress, NAMESPACE))  # noqa: B023
            env = {**os.environ, "KUBECONFIG": kubeconfig, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
            commands = [timed(lambda c=command, e=env: subprocess.run(
                [sys.executable, "-m", "scripts.deployctl", "--env", "dev", "--project", "example", c], cwd=ROOT,
                env=e, capture_output=True, check=True)) for command in ("why", "status")]
            rows.append((workers, *commands, why_s, status_s, len(text)))
            core.delete_namespace(NAMESPACE)
            while any(ns.metadata.name == NAMESPACE for ns in core.list_namespace().items):
                time.sleep(0.5)
    finally:
        subprocess.run([str(k8s), "down", str(state), "--purge"], capture_output=True)
    print("\n| workers | make why (s) | make status (s) | target | why's reads + text (s) | status's read (s) | "
          "paragraph (chars) |\n|---|---|---|---|---|---|---|")
    for workers, why_cmd, status_cmd, why_s, status_s, chars in rows:
        print(f"| {workers} | {why_cmd:.2f} | {status_cmd:.2f} | <= {TARGET_S:.0f} s | {why_s:.3f} | {status_s:.3f} | "
              f"{chars} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
