"""How the chart's fixed costs grow with the number of workers (issue: cost that does not grow with workers).

1. Readiness, on namespace hosts (tests/support/harness.py; root), no ranks: N worker pods are started at once, then
   - ssh: the launcher pod runs its real entrypoint (the attempt loop, `launcher`) with, as the DeepSpeed command,
     pdsh as DeepSpeed's runner starts it (`-f 1024`) running `sleep 2` on every host: the ledger, the meeting
     (DNS, SSH and the worker template of every host, clearing stale ranks on it), the run. Measured from the
     last worker pod's start to "all N workers are reachable" and to the run's start, the fan-out's cost (the
     run's time less the 2 s), and the launcher pod's peak memory (the largest resident memory of its process
     tree at once, sampled every 50 ms), also during the run alone (pdsh holding N sessions);
   - nossh: every worker runs its real entrypoint (the attempt loop, `nossh-worker`) with `true` as the DeepSpeed
     command: the meeting on worker 0, the ledger, a run that ends at once; measured from the last worker's start to
     the last worker through.
   With the time until every worker's entrypoint has started its sshd: on this machine's 2 cores, N pods starting
   at once compete for the CPU, which a cluster's nodes do not.
2. The chart alone: `helm template` (with its schema) of N replicas in both modes, and the size of the config
   ConfigMap (the hostfile is in it) against the API's 1 MiB. The schema caps worker.replicas; this part renders
   a copy of the chart with the cap raised to measure past it.
3. The API load of the progress ConfigMap (--api-hosts): N worker pods' sidecars and the launcher's, as real
   processes against the real kube-apiserver of ../shared/k8s (root), every pod's ranks rewriting progress.json
   twice a second (any rank may write it), for --api-seconds: requests a second to the API server (its own
   apiserver_request_total for configmaps), this chart's sidecar (one writer per key, rate-limited) against the
   one before it (every pod's sidecar a GET and a PATCH of the whole object on each change of its own files),
   and each extrapolated to 4,096 workers by a straight line through the measured points.

    sudo .venv/bin/python bench/scale.py [--hosts 2,8,32,64] [--replicas 64,1024,4096] [--no-readiness]
                                         [--api-hosts 2,8,32,64] [--api-seconds 20]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.chart import CHART, HELM  # noqa: E402
from tests.support.chart_pods import UID, e2e_values, render  # noqa: E402
from tests.support.harness import (  # noqa: E402
    Cluster,
    ensure_user,
    namespaces_available,
    prebuilt_ops_for_pods,
    wait_for,
)
from train.deepspeed_mirror import PDSH_MAX_FAN_OUT  # noqa: E402

CONFIGMAP_LIMIT = 1 << 20  # the API server's object size limit for a ConfigMap's data
SIDECAR = CHART / "files"  # the scripts directory, run as a program: `sidecar ...`
BEFORE = "d21c687"  # the commit before this sidecar: its files/progress.py, every pod a writer of the whole object
IN_CLUSTER = """
import runpy, sys
from kubernetes.config import incluster_config
incluster_config.SERVICE_TOKEN_FILENAME, incluster_config.SERVICE_CERT_FILENAME = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
HOLD_S = 2  # how long the no-op run holds each host's session


def rss_mib(pids: set[int]) -> float:
    """The processes' resident memory now, together."""
    total = 0
    for pid in pids:
        try:
            total += next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def tree(root: int) -> set[int]:
    """`root` and its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def readiness_ssh(shared: Path, hosts: int) -> dict:
    values = e2e_values(shared, workers=hosts)
    values["job"]["waitTimeoutSeconds"] = 300
    with Cluster(render(values)) as cluster:
        workers = cluster.pods_of("worker")
        for worker in workers:
            cluster.start(worker)
        up = time.monotonic()  # the last worker pod started (its sshd not yet listening)
        launcher = cluster.pods_of("launcher")[0]
        argv = launcher.container.get("command", []) + launcher.container.get("args", [])
        script = argv.index("launcher")
        # The run: pdsh as DeepSpeed's runner starts it, holding every host's session for HOLD_S.
        fan_out = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(w.fqdn for w in workers),
                   "sleep", str(HOLD_S)]
        process = cluster.start(launcher, argv=[*argv[:script + 1], *fan_out])
        peak, run_peak, sshd, reachable, ran, done, tick = 0.0, 0.0, None, None, None, None, 0
        while process.poll() is None:
            tick += 1
            if tick % 5 == 0:  # memory every 50 ms: a scan of /proc every 10 ms took a fifth of the two cores
                memory = rss_mib(tree(process.pid))
                peak = max(peak, memory)
                if ran is not None:
                    run_peak = max(run_peak, memory)
            if sshd is None and all("starting sshd" in w.log() for w in workers):
                sshd = time.monotonic()  # every worker's entrypoint is through its set-up
            log = launcher.log()
            if reachable is None and "workers are reachable" in log:
                reachable = time.monotonic()
            if ran is None and "launcher: running (" in log:
                ran = time.monotonic()
            if "DeepSpeed exited with status" in log and not done:
                done = time.monotonic()
            time.sleep(0.01)
        log = launcher.log()
        assert process.returncode == 0 and reachable and ran and done, log[-3000:]
    return {"sshd_s": (sshd or done) - up, "reachable_s": reachable - up, "run_s": ran - up,
            "fan_out_s": done - ran - HOLD_S, "peak_mib": peak, "run_peak_mib": run_peak}


def readiness_nossh(shared: Path, hosts: int) -> dict:
    values = e2e_values(shared, workers=hosts)
    values["launchMode"] = "nossh"
    values["job"]["waitTimeoutSeconds"] = 300
    with Cluster(render(values)) as cluster:
        workers = cluster.pods_of("worker")
        argv = [*workers[0].container["command"], "true"]  # the loop, with a run that ends at once
        processes = [cluster.start(worker, argv=argv) for worker in workers]
        up = time.monotonic()
        done = wait_for(lambda: all(p.poll() is not None for p in processes), 300, "every worker through the barrier",
                        interval=0.01)
        assert all(p.returncode == 0 for p in processes), [p.returncode for p in processes]
    return {"through_s": done - up}


def chart_alone(replicas: list[int]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "deepspeed-training"
        shutil.copytree(CHART, chart)
        schema = json.loads((chart / "values.schema.json").read_text())
        cap = schema["properties"]["worker"]["properties"]["replicas"]["maximum"]
        schema["properties"]["worker"]["properties"]["replicas"]["maximum"] = max(replicas)
        (chart / "values.schema.json").write_text(json.dumps(schema))
        for mode in ("ssh", "nossh"):
            for n in replicas:
                if mode == "ssh" and n > PDSH_MAX_FAN_OUT:
                    continue  # refused at render: past DeepSpeed's pdsh fan-out
                values = Path(tmp) / "values.json"
                values.write_text(json.dumps({"image": {"repository": "example/deepspeed", "tag": "1"},
                                              "launchMode": mode, "worker": {"replicas": n}}))
                started = time.perf_counter()
                out = subprocess.run([HELM, "template", "bench", str(chart), "-f", str(values)], capture_output=True,
                                     text=True, check=True).stdout
                seconds = time.perf_counter() - started
                config = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"
                              and d["metadata"]["name"].endswith("-config"))
                size = sum(len(k.encode()) + len(v.encode()) for k, v in config["data"].items())
                rows.append({"mode": mode, "replicas": n, "template_s": seconds, "configmap_bytes": size,
                             "over_cap": n > cap})
    return rows


def apiserver_configmap_requests(kubeconfig: str) -> int:
    """The API server's count of requests to configmaps so far (all verbs)."""
    text = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "--raw", "/metrics"], capture_output=True,
                          text=True, check=True).stdout
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="configmaps"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def api_run(design: str, workers: int, seconds: float, env: dict, kubeconfig: str, work: Path) -> float:
    """Requests a second to configmaps while `workers` worker pods and a launcher run `design`'s sidecar."""
    script = SIDECAR if design == "now" else work / "progress-before.py"
    pods = [(f"worker-{i}", ["--progress", "--world-size", str(workers), "--ranks-per-pod", "1"], str(i))
            for i in range(workers)] + [("launcher", ["--job"], "")]
    processes, dirs = [], []
    for name, role, node_rank in pods:
        state = work / design / str(workers) / name
        state.mkdir(parents=True, exist_ok=True)
        dirs.append(state)
        if name == "launcher":
            (state / "verdict.json").write_text(json.dumps({"v": 2, "state": "starting", "attempt": "1",
                                                            "time": time.time()}))
        args = [*(["sidecar"] if design == "now" else []), "--configmap", "bench-progress",
                *(role if design == "now" else [])]
        processes.append(subprocess.Popen(
            [sys.executable, "-c", IN_CLUSTER, str(work / "token"), str(work / "ca.crt"), str(script), *args],
            env={**env, "DS_RANK_STATE_DIR": str(state), "DS_NODE_RANK": node_rank}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    try:
        wait_for(lambda: all(p.poll() is None for p in processes) and time.sleep(0.5) is None, 120, "the sidecars")
        time.sleep(min(30.0, 2 + workers * 0.3))  # their imports (~1 s of CPU each) done before the count starts
        before, started = apiserver_configmap_requests(kubeconfig), time.monotonic()
        step = 0
        while time.monotonic() - started < seconds:
            step += 1
            for state in dirs[:-1]:  # every pod's ranks, as a program of its own may write it
                (state / "progress.json.tmp").write_text(json.dumps({"state": "training", "step": step,
                                                                     "steps": 100000, "time": time.time()}))
                os.replace(state / "progress.json.tmp", state / "progress.json")
            time.sleep(0.5)
        return (apiserver_configmap_requests(kubeconfig) - before) / (time.monotonic() - started)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def api_load(hosts: list[int], seconds: float) -> list[tuple[int, float, float]] | str:
    """(workers, requests/s now, requests/s before) for each count, or why it could not run."""
    k8s = Path(os.environ.get("LOCAL_K8S_DIR", ROOT.parent / "shared" / "k8s")) / "local-k8s.sh"
    if os.geteuid() != 0 or not k8s.exists():
        return "needs root and ../shared/k8s (a real kube-apiserver)"
    state, work = ROOT / ".build" / "k8s-bench", Path(tempfile.mkdtemp(prefix="api-load-"))
    try:
        kubeconfig = subprocess.run([str(k8s), "up", str(state)], capture_output=True, text=True,
                                    check=True).stdout.strip()
        kubectl = ["kubectl", "--kubeconfig", kubeconfig]
        subprocess.run([*kubectl, "create", "namespace", "bench"], capture_output=True)
        subprocess.run([*kubectl, "-n", "bench", "create", "configmap", "bench-progress"], capture_output=True)
        subprocess.run([*kubectl, "-n", "bench", "create", "serviceaccount", "sidecar"], capture_output=True)
        subprocess.run([*kubectl, "-n", "bench", "create", "role", "progress", "--verb=get,patch",
                        "--resource=configmaps", "--resource-name=bench-progress"], capture_output=True)
        subprocess.run([*kubectl, "-n", "bench", "create", "rolebinding", "progress", "--role=progress",
                        "--serviceaccount=bench:sidecar"], capture_output=True)
        token = subprocess.run([*kubectl, "-n", "bench", "create", "token", "sidecar", "--duration=2h"],
                               capture_output=True, text=True, check=True).stdout.strip()
        (work / "token").write_text(token)
        config = yaml.safe_load(Path(kubeconfig).read_text())
        cluster = config["clusters"][0]["cluster"]
        ca = cluster.get("certificate-authority-data")
        if ca:
            import base64
            (work / "ca.crt").write_bytes(base64.b64decode(ca))
        else:
            shutil.copy(cluster["certificate-authority"], work / "ca.crt")
        host, port = cluster["server"].removeprefix("https://").rsplit(":", 1)
        before = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:charts/deepspeed-training/files/"
                                 "progress.py"], capture_output=True, text=True, check=True).stdout
        (work / "progress-before.py").write_text(before)
        env = {"PATH": os.environ["PATH"], "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
               "POD_NAMESPACE": "bench", "PYTHONUNBUFFERED": "1"}
        return [(n, api_run("now", n, seconds, env, kubeconfig, work), api_run("before", n, seconds, env, kubeconfig,
                                                                               work)) for n in hosts]
    finally:
        subprocess.run([str(k8s), "down", str(state), "--purge"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def extrapolate(points: list[tuple[int, float]], at: int) -> float:
    """A least-squares straight line through (workers, requests/s), at `at` workers."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return mean_y + slope * (at - mean_x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="2,8,32,64")
    parser.add_argument("--replicas", default="64,1024,4096")
    parser.add_argument("--no-readiness", action="store_true")
    parser.add_argument("--api-hosts", default="2,8,32,64", help="worker counts for the API load ('' to skip)")
    parser.add_argument("--api-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if not args.no_readiness:
        reason = namespaces_available()
        if reason:
            print(f"readiness skipped: {reason}")
        else:
            ensure_user(UID, "/home/deepspeed")
            shared = prebuilt_ops_for_pods(UID)
            print("Readiness (seconds after the last worker pod started; no ranks)")
            columns = ("hosts", "ssh: every sshd", "ssh: all reachable", "ssh: run starts", "ssh: pdsh fan-out",
                       "launcher peak MiB", "of it, pdsh run MiB", "nossh: barrier through")
            print(" | ".join(columns))
            for hosts in (int(n) for n in args.hosts.split(",")):
                ssh, nossh = readiness_ssh(shared, hosts), readiness_nossh(shared, hosts)
                cells = (hosts, ssh["sshd_s"], ssh["reachable_s"], ssh["run_s"], ssh["fan_out_s"], ssh["peak_mib"],
                         ssh["run_peak_mib"], nossh["through_s"])
                print(" | ".join(f"{c:>{len(h)}.{0 if 'MiB' in h else 2}f}" if isinstance(c, float)
                                 else f"{c:>{len(h)}}" for h, c in zip(columns, cells, strict=True)), flush=True)
    print("\nThe chart alone (helm template with the schema; the config ConfigMap against the API's 1 MiB)")
    print(f"{'mode':>5} | {'replicas':>8} | {'helm template s':>15} | {'config ConfigMap':>16} | {'of 1 MiB':>8}")
    for row in chart_alone([int(n) for n in args.replicas.split(",")]):
        print(f"{row['mode']:>5} | {row['replicas']:>8} | {row['template_s']:>15.2f} | "
              f"{row['configmap_bytes']:>14,} B | {100 * row['configmap_bytes'] / CONFIGMAP_LIMIT:>7.1f}%"
              + ("  (past the schema's cap)" if row["over_cap"] else ""))
    if args.api_hosts:
        print("\nAPI load of the progress ConfigMap (requests a second to the kube-apiserver; every pod's ranks "
              "rewrite progress.json twice a second)")
        rows = api_load([int(n) for n in args.api_hosts.split(",")], args.api_seconds)
        if isinstance(rows, str):
            print(f"skipped: {rows}")
            return 0
        print(f"{'workers':>7} | {'this sidecar':>12} | {'the one before':>14} | {'ratio':>6}")
        for workers, now, before in rows:
            print(f"{workers:>7} | {now:>12.2f} | {before:>14.2f} | {before / max(now, 1e-9):>5.0f}x")
        at = 4096
        now, before = (extrapolate([(w, r[i]) for w, *r in rows], at) for i in (0, 1))
        print(f"{at:>7} | {now:>12.2f} | {before:>14.2f} | {before / max(now, 1e-9):>5.0f}x  (extrapolated)")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        print("bench/scale.py: the readiness part needs root (network namespaces); use --no-readiness",
              file=sys.stderr)
    sys.exit(main())
