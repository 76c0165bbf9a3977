"""Start-up cost of the chart's pods in both launch modes, and the fault drill, on namespace hosts
(tests/e2e/harness.py; root).

1. Start-up: time from "all pods started" (as a Job and StatefulSet start them) to the first logged optimizer
   step, for launchMode ssh (sshd workers + launcher: SSH checks, clearing stale ranks, pdsh) and nossh (the
   start barrier, then `deepspeed --no_ssh` per pod), against bare `deepspeed --no_ssh` started directly on
   each host with the same hostfile and program (no entrypoint scripts, no SSH, no barrier). Goal: <= 1.1x bare.
2. Fault drill, both modes: SIGKILL one rank of worker 1 mid-run and measure the time from the kill to the
   first optimizer step of the retry (in-pod retry: job.runRetries), the steps lost, and the pods
   recreated (none: the cost does not grow with the number of workers). Goal: <= 15 s on 2 hosts.

    sudo .venv/bin/python bench/e2e_startup.py [--repeats 3] [--trials 2]
"""

import argparse
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.chart_pods import UID, e2e_values, render  # noqa: E402
from tests.e2e.harness import Cluster, ensure_user, namespaces_available, prebuilt_ops_for_pods, step_losses, wait_for  # noqa: E402

FIRST_STEP = re.compile(r"\[rank 0\] INFO step 1/")


def wait_for_text(pod, pattern: re.Pattern, timeout: float) -> float:
    return wait_for(lambda: pattern.search(pod.log()), timeout, f"{pod.name}: {pattern.pattern!r}", pod.log, 0.05)


def values(extensions: Path, mode: str, **train) -> dict:
    v = e2e_values(extensions, **train)
    v["train"]["module"] = "train"
    v["launchMode"] = mode
    v["job"]["runRetries"] = 1
    return v


def rank0_pod(cluster: Cluster):
    """Where rank 0's log lines land: the launcher (ssh, pdsh relays them) or worker 0 (nossh)."""
    return (cluster.pods_of("launcher") or cluster.pods_of("worker"))[0]


def job_pods(cluster: Cluster) -> list:
    """The pods that end with the run (the Job's): the launcher (ssh; sshd workers run on) or every worker."""
    return cluster.pods_of("launcher") or cluster.pods_of("worker")


def chart_startup(extensions: Path, mode: str) -> float:
    with Cluster(render(values(extensions, mode, steps=5, log_every=1, checkpoint_every=0))) as cluster:
        started = time.monotonic()
        for pod in cluster.pods:  # every pod at once
            cluster.start(pod)
        first = wait_for_text(rank0_pod(cluster), FIRST_STEP, 300)
        for pod in job_pods(cluster):
            pod.process.wait(timeout=120)
        return first - started


def bare_startup(extensions: Path) -> float:
    """`deepspeed --no_ssh --node_rank=i` started directly on every host: the chart's own deepspeed command
    and program, nothing around it."""
    with Cluster(render(values(extensions, "nossh", steps=5, log_every=1, checkpoint_every=0))) as cluster:
        workers = cluster.pods_of("worker")
        started = time.monotonic()
        processes = []
        for i, worker in enumerate(workers):
            command = worker.container["args"]
            processes.append(cluster.start(worker, [command[0], f"--node_rank={i}", *command[1:]],
                                           log_name=f"{worker.name}-bare"))
        worker0_log = cluster.tmp / f"{workers[0].name}-bare.log"
        first = wait_for(lambda: worker0_log.exists() and FIRST_STEP.search(worker0_log.read_text(errors="replace")),
                         300, "the first step", interval=0.05)
        for process in processes:
            process.wait(timeout=120)
        return first - started


def fault_trial(extensions: Path, mode: str) -> dict:
    with Cluster(render(values(extensions, mode, steps=200, log_every=1, checkpoint_every=20))) as cluster:
        for pod in cluster.pods:
            cluster.start(pod)
        log_pod = rank0_pod(cluster)
        wait_for_text(log_pod, re.compile(r"INFO step 5[0-9]/"), 300)
        worker1 = cluster.pods_of("worker")[1]
        victim = cluster.rank_pids(worker1, ranks_only=True)[0]
        done = max(step_losses(log_pod.log()))
        attempts = {pod.name: pod.attempt for pod in cluster.pods}
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        def resumed_step():
            log = log_pod.log()
            at = log.rfind("resumed from")
            return at >= 0 and re.search(r"INFO step \d+/", log[at:])

        recovered = wait_for(resumed_step, 300, "the first step after the resume", log_pod.log, 0.05)
        codes = [pod.process.wait(timeout=600) for pod in job_pods(cluster)]
        log = log_pod.log()
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", log).group(1))
        recreated = [pod.name for pod in cluster.pods if pod.attempt != attempts[pod.name]]
        return {"recovery_s": recovered - killed, "trained": done, "resumed": resumed, "lost": done - resumed,
                "recreated": len(recreated), "ok": codes == [0] * len(codes) and max(step_losses(log)) == 200}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    reason = namespaces_available()
    if reason:
        print(f"cannot run: {reason}")
        return 1
    ensure_user(UID, "/home/deepspeed")
    extensions = prebuilt_ops_for_pods(UID)
    rows = {"bare deepspeed --no_ssh per host": [], "chart, launchMode ssh": [], "chart, launchMode nossh": []}
    for _ in range(args.repeats):  # interleaved, so drift hits every row alike
        rows["bare deepspeed --no_ssh per host"].append(bare_startup(extensions))
        rows["chart, launchMode ssh"].append(chart_startup(extensions, "ssh"))
        rows["chart, launchMode nossh"].append(chart_startup(extensions, "nossh"))
    bare = statistics.median(rows["bare deepspeed --no_ssh per host"])
    print("start-up: all pods started -> first optimizer step (2 hosts x 1 CPU rank, ZeRO-2)")
    print(f"{'':<36}{'median s':>9}{'vs bare':>9}   runs")
    for name, runs in rows.items():
        print(f"{name:<36}{statistics.median(runs):>9.1f}{statistics.median(runs) / bare:>8.2f}x   "
              + " ".join(f"{x:.1f}" for x in runs))
    print("\nfault drill: SIGKILL a rank of worker 1 at step ~50 of 200, checkpoint every 20, collective timeout "
          "1 min, runRetries 1")
    print(f"{'mode':<7}{'trial':>6}{'kill -> first step of retry s':>32}{'trained':>9}{'resumed':>9}{'lost':>6}"
          f"{'pods recreated':>16}{'finished':>10}")
    for mode in ("ssh", "nossh"):
        for i in range(args.trials):
            t = fault_trial(extensions, mode)
            print(f"{mode:<7}{i + 1:>6}{t['recovery_s']:>32.1f}{t['trained']:>9}{t['resumed']:>9}{t['lost']:>6}"
                  f"{t['recreated']:>16}{str(t['ok']):>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
