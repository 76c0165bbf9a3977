"""Start-up cost of the chart's pods, and the fault drill, on namespace hosts (tests/e2e/harness.py; root).

1. Time from "all pods started" (workers and launcher at once, as a Job and StatefulSet start) to the first
   logged optimizer step, against the same training started directly with `deepspeed --hostfile` from the
   launcher host once the workers' sshd already answers. Prints both and the ratio (goal <= 1.2).
2. Fault drill: N times, SIGKILL one worker's rank mid-run, let the launcher fail, start a new launcher
   attempt, and count the steps lost (trained before the kill, minus the checkpoint it resumed from).

    sudo .venv/bin/python bench/e2e_startup.py [--repeats 3] [--trials 3]
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

from tests.e2e.harness import Cluster, ensure_user, namespaces_available, prebuilt_ops_for_pods  # noqa: E402
from tests.e2e.test_e2e import UID, e2e_values, rank_pids, render, start_workers, step_losses  # noqa: E402

FIRST_STEP = re.compile(r"\[rank 0\] INFO step 1/")


def wait_for_text(pod, pattern: re.Pattern, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern.search(pod.log()):
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"{pod.name}: no {pattern.pattern!r} after {timeout}s:\n{pod.log()[-3000:]}")


def values(extensions: Path, **train) -> dict:
    v = e2e_values(extensions, **train)
    v["train"]["module"] = "train"
    return v


def chart_startup(extensions: Path) -> float:
    with Cluster(render(values(extensions, steps=5, log_every=1, checkpoint_every=0))) as cluster:
        started = time.monotonic()
        for pod in cluster.pods:  # every pod at once
            cluster.start(pod)
        launcher = cluster.pods_of("launcher")[0]
        first = wait_for_text(launcher, FIRST_STEP, 300)
        launcher.process.wait(timeout=120)
        return first - started


def direct_startup(extensions: Path) -> float:
    docs = render(values(extensions, steps=5, log_every=1, checkpoint_every=0))
    with Cluster(docs) as cluster:
        start_workers(cluster)  # hosts already up, sshd answering
        launcher = cluster.pods_of("launcher")[0]
        job = next(d for d in docs if d["kind"] == "Job")
        deepspeed_args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        script = ("source /etc/deepspeed/scripts/ssh-setup.sh && cp /etc/deepspeed/config/deepspeed_env "
                  "~/.deepspeed_env && export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND=\"-F $HOME/.ssh/config\" && "
                  "exec \"$@\"")
        started = time.monotonic()
        process = cluster.start(launcher, ["bash", "-c", script, "direct", *deepspeed_args], log_name="direct")
        first = wait_for_text(launcher, FIRST_STEP, 300)
        process.wait(timeout=120)
        return first - started


def fault_trial(extensions: Path) -> dict:
    with Cluster(render(values(extensions, steps=300, log_every=1, checkpoint_every=20))) as cluster:
        workers = start_workers(cluster)
        launcher = cluster.pods_of("launcher")[0]
        first = cluster.start(launcher)
        wait_for_text(launcher, re.compile(r"INFO step 5[0-9]/"), 300)
        victim = next(p for p in rank_pids(cluster, workers[1])
                      if "--local_rank=" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
        killed = time.monotonic()
        done = max(step_losses(launcher.log()))
        os.kill(victim, signal.SIGKILL)
        first.wait(timeout=180)
        failed_after = time.monotonic() - killed
        retry = cluster.start(launcher, log_name="retry", new_pod=True)
        code = retry.wait(timeout=600)
        log = launcher.log()
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", log).group(1))
        return {"failed_after_s": failed_after, "trained": done, "resumed": resumed, "lost": done - resumed,
                "retry_ok": code == 0 and max(step_losses(log)) == 300}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    reason = namespaces_available()
    if reason:
        print(f"cannot run: {reason}")
        return 1
    ensure_user(UID, "/home/deepspeed")
    extensions = prebuilt_ops_for_pods(UID)
    chart, direct = [], []
    for _ in range(args.repeats):  # interleaved
        direct.append(direct_startup(extensions))
        chart.append(chart_startup(extensions))
    print("start-up to the first optimizer step (2 workers x 1 CPU rank, ZeRO-2)")
    print(f"{'':<44}{'median s':>9}{'runs':>30}")
    print(f"{'chart pods, all started at once':<44}{statistics.median(chart):>9.1f}"
          f"{' '.join(f'{x:.1f}' for x in chart):>30}")
    print(f"{'deepspeed --hostfile on running hosts':<44}{statistics.median(direct):>9.1f}"
          f"{' '.join(f'{x:.1f}' for x in direct):>30}")
    print(f"{'ratio (goal <= 1.2)':<44}{statistics.median(chart) / statistics.median(direct):>9.2f}")
    print("\nfault drill: SIGKILL one rank at step ~50 of 300, checkpoint every 20, dist_timeout_s 20")
    print(f"{'trial':<7}{'job failed after s':>20}{'trained':>9}{'resumed':>9}{'steps lost':>12}{'retry ok':>10}")
    for i in range(args.trials):
        t = fault_trial(extensions)
        print(f"{i + 1:<7}{t['failed_after_s']:>20.1f}{t['trained']:>9}{t['resumed']:>9}{t['lost']:>12}"
              f"{str(t['retry_ok']):>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
