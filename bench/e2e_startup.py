"""Start-up cost of the chart's pods, and the fault drill, on namespace hosts (tests/e2e/harness.py; root).

1. Time from "all pods started" (workers and launcher at once, as a Job and StatefulSet start) to the first
   logged optimizer step, against the launcher pod's own command started once the workers' sshd already
   answers (what is left once pods exist: the SSH checks, clearing stale ranks, `deepspeed --hostfile`).
   Prints both and the ratio (goal <= 1.2).
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

from tests.e2e.chart_pods import UID, e2e_values, render  # noqa: E402
from tests.e2e.harness import Cluster, ensure_user, namespaces_available, prebuilt_ops_for_pods, step_losses, wait_for  # noqa: E402

FIRST_STEP = re.compile(r"\[rank 0\] INFO step 1/")


def wait_for_text(pod, pattern: re.Pattern, timeout: float) -> float:
    return wait_for(lambda: pattern.search(pod.log()), timeout, f"{pod.name}: {pattern.pattern!r}", pod.log, 0.05)


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


def warm_startup(extensions: Path) -> float:
    """The launcher pod's own command once every worker's sshd already answers (the chart without pod start)."""
    with Cluster(render(values(extensions, steps=5, log_every=1, checkpoint_every=0))) as cluster:
        cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        started = time.monotonic()
        process = cluster.start(launcher)
        first = wait_for_text(launcher, FIRST_STEP, 300)
        process.wait(timeout=120)
        return first - started


def fault_trial(extensions: Path) -> dict:
    with Cluster(render(values(extensions, steps=300, log_every=1, checkpoint_every=20))) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        first = cluster.start(launcher)
        wait_for_text(launcher, re.compile(r"INFO step 5[0-9]/"), 300)
        victim = next(p for p in cluster.rank_pids(workers[1])
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
    chart, warm = [], []
    for _ in range(args.repeats):  # interleaved
        warm.append(warm_startup(extensions))
        chart.append(chart_startup(extensions))
    print("start-up to the first optimizer step (2 workers x 1 CPU rank, ZeRO-2)")
    print(f"{'':<44}{'median s':>9}{'runs':>30}")
    print(f"{'chart pods, all started at once':<44}{statistics.median(chart):>9.1f}"
          f"{' '.join(f'{x:.1f}' for x in chart):>30}")
    print(f"{'launcher on already-running workers':<44}{statistics.median(warm):>9.1f}"
          f"{' '.join(f'{x:.1f}' for x in warm):>30}")
    print(f"{'ratio (goal <= 1.2)':<44}{statistics.median(chart) / statistics.median(warm):>9.2f}")
    print("\nfault drill: SIGKILL one rank at step ~50 of 300, checkpoint every 20, dist_timeout_s 20")
    print(f"{'trial':<7}{'job failed after s':>20}{'trained':>9}{'resumed':>9}{'steps lost':>12}{'retry ok':>10}")
    for i in range(args.trials):
        t = fault_trial(extensions)
        print(f"{i + 1:<7}{t['failed_after_s']:>20.1f}{t['trained']:>9}{t['resumed']:>9}{t['lost']:>12}"
              f"{str(t['retry_ok']):>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
