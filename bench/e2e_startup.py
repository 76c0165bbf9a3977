"""Start-up cost of the chart's pods in both launch modes, and the fault drill, on namespace hosts
(tests/support/harness.py; root).

1. Start-up: time from "all pods started" (as a Job and StatefulSet start them) to the first logged optimizer
   step, for launchMode ssh (sshd workers + launcher: SSH checks, clearing stale ranks, pdsh) and nossh (the
   start barrier, then `deepspeed --no_ssh` per pod), against bare `deepspeed --no_ssh` started directly on
   each host with the same hostfile and program (no entrypoint scripts, no SSH, no barrier). Goal: <= 1.1x bare.
2. Fault drill, both modes, with the chart's default hang budgets: one rank of worker 1 mid-run is
   - crash: SIGKILLed;
   - hang in a collective: SIGSTOPped (its peers wait in their all_reduce; it answers nothing);
   - hang outside: blocked opening a FIFO at step 50 (tests/e2e/hang_probe.py: a data loader on a dead mount);
   - straggler: stopped 3/4 of the time in 30 ms slices;
   - preemption: worker 1's pod gets SIGTERM (a spot reclaim, an eviction); its replacement is started once it
     ended, as the StatefulSet (ssh) or the Job (nossh) would;
   and the drill measures the time from the fault (for a hang: from the last step before it) to its detection
   (the run failing, the watchdog's report, the straggler line, the ranks' agreed stop) and to the first
   optimizer step of the retry (in-pod retry), the steps lost, the pods recreated, and the job's failure budget
   used (podruntime/ledger.py: a preemption spends none). Goals: a crash <= 15 s, a hang detected and resumed
   <= 150 s after its last step, a preemption loses <= 1 step.
3. Recovery at N hosts (--hosts): a rank of worker 1 SIGKILLed at step ~50 (checkpoint every 20) -> the first
   optimizer step after the resume, for both modes (the in-pod retry) against bare `deepspeed --no_ssh` under the
   quickest supervisor there can be (kill every host's processes once the first host's deepspeed exits, start
   them all again at once). On 2 cores the absolute times grow with N (every rank shares them); the figure that
   counts is the chart's ratio to bare. Goal: it grows <= 1.2x from 2 to 8 hosts, as for start-up.
4. Overhead of hang detection on a healthy run: tokens/s of 300 steps with hangDetection on and off in both
   modes, and of bare `deepspeed --no_ssh` (no heartbeat at all), interleaved in the same run. Goal: within noise.

    sudo .venv/bin/python bench/e2e_startup.py [--repeats 3] [--hosts 2,4,8] [--trials 2] [--faults crash,...]
        [--no-startup] [--no-recovery] [--no-overhead]
"""

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podruntime import protocol  # noqa: E402
from tests.support.chart_pods import UID, e2e_values, render  # noqa: E402
from tests.support.faults import duty_cycle  # noqa: E402
from tests.support.harness import (  # noqa: E402
    Cluster,
    ensure_user,
    namespaces_available,
    prebuilt_ops_for_pods,
    step_losses,
    wait_for,
)
from train import goodput  # noqa: E402

FIRST_STEP = re.compile(r"\[rank 0\] INFO step 1/")


def wait_for_text(pod, pattern: re.Pattern, timeout: float) -> float:
    return wait_for(lambda: pattern.search(pod.log()), timeout, f"{pod.name}: {pattern.pattern!r}", pod.log, 0.05)


def values(extensions: Path, mode: str, workers: int = 2, **train) -> dict:
    v = e2e_values(extensions, workers=workers, **train)
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


def chart_startup(extensions: Path, mode: str, workers: int = 2) -> float:
    with Cluster(render(values(extensions, mode, workers, steps=5, log_every=1, checkpoint_every=0))) as cluster:
        started = time.monotonic()
        for pod in cluster.pods:  # every pod at once
            cluster.start(pod)
        first = wait_for_text(rank0_pod(cluster), FIRST_STEP, 300)
        for pod in job_pods(cluster):
            pod.process.wait(timeout=120)
        return first - started


def start_bare(cluster: Cluster, log_suffix: str) -> list:
    """`deepspeed --no_ssh --node_rank=i` started directly on every worker host: the chart's own deepspeed command
    and program, nothing around it; logs in <pod>-<log_suffix>.log."""
    return [cluster.start(w, [w.container["args"][0], f"--node_rank={i}", *w.container["args"][1:]],
                          log_name=f"{w.name}-{log_suffix}") for i, w in enumerate(cluster.pods_of("worker"))]


def bare_startup(extensions: Path, workers: int = 2) -> float:
    """Bare deepspeed on every host (start_bare): all started to the first logged step."""
    with Cluster(render(values(extensions, "nossh", workers, steps=5, log_every=1, checkpoint_every=0))) as cluster:
        workers = cluster.pods_of("worker")
        started = time.monotonic()
        processes = start_bare(cluster, "bare")
        worker0_log = cluster.tmp / f"{workers[0].name}-bare.log"
        first = wait_for(lambda: worker0_log.exists() and FIRST_STEP.search(worker0_log.read_text(errors="replace")),
                         300, "the first step", interval=0.05)
        for process in processes:
            process.wait(timeout=120)
        return first - started


FAULTS = ("crash", "collective", "outside", "straggler", "preemption")
DETECTED = {"crash": re.compile(r"DeepSpeed exited with status [1-9]"), "collective": re.compile(r"hang on "),
            "outside": re.compile(r"hang on "), "straggler": re.compile(r"straggler: rank 1 "),
            "preemption": re.compile(r"SIGTERM: stopped at step \d+")}
BUDGET_USED = re.compile(r"attempt \d+ \((\d+) of \d+ failures used")


def fault_trial(extensions: Path, mode: str, fault: str, workers: int = 2) -> dict:
    v = values(extensions, mode, workers, steps=200 if fault != "straggler" else 100000, log_every=1,
               checkpoint_every=20)
    if fault == "outside":
        v["train"]["module"] = "tests.e2e.hang_probe"
        v["env"] += [{"name": "HANG_RANK", "value": "1"}, {"name": "HANG_AT_STEP", "value": "50"}]
    with Cluster(render(v)) as cluster:
        for pod in cluster.pods:
            cluster.start(pod)
        log_pod = rank0_pod(cluster)
        wait_for_text(log_pod, re.compile(r"INFO step (4[5-9]|5[0-9])/"), 300)
        worker1 = cluster.pods_of("worker")[1]
        victim = cluster.rank_pids(worker1, ranks_only=True)[0]
        attempts = {pod.name: pod.attempt for pod in cluster.pods}
        logs = lambda: "".join(pod.log() for pod in cluster.pods)  # noqa: E731 - the watchdogs log in the workers
        if fault == "straggler":
            slowed = time.monotonic()
            stop = threading.Event()
            slowing = threading.Thread(target=duty_cycle, args=(victim, stop))
            slowing.start()
            try:
                named = wait_for(lambda: DETECTED[fault].search(logs()), 300, "the straggler line", logs, 0.05)
            finally:
                stop.set()
                slowing.join()
            for pod in cluster.pods:
                cluster.kill(pod)
            return {"detected_s": named - slowed, "recovery_s": None, "trained": None, "resumed": None,
                    "lost": None, "recreated": 0, "ok": True}
        if fault == "outside":  # the probe blocks at the start of step 50: the fault begins after step 49
            wait_for_text(log_pod, re.compile(r"INFO step 49/"), 300)
            killed = time.monotonic()
        elif fault == "preemption":
            killed = time.monotonic()
            cluster.signal_main(worker1.process, signal.SIGTERM)  # the kubelet's signal to the pod's PID 1
            worker1.process.wait(timeout=120)
            cluster.start(worker1, new_pod=True)  # its replacement, once it ended
        else:
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
        done = max(step_losses(log_pod.log()))
        detected = wait_for(lambda: DETECTED[fault].search(logs()), 600, f"{fault} detected", logs, 0.05)

        def resumed_step():
            log = log_pod.log()
            at = log.rfind("resumed from")
            return at >= 0 and re.search(r"INFO step \d+/", log[at:])

        recovered = wait_for(resumed_step, 300, "the first step after the resume", log_pod.log, 0.05)
        codes = [pod.process.wait(timeout=600) for pod in job_pods(cluster)]
        log = log_pod.log()
        resumed = int(re.search(r"resumed from \S+step_(\d+) at step", log).group(1))
        recreated = [pod.name for pod in cluster.pods if pod.attempt != attempts[pod.name]]
        if fault == "preemption":  # the ranks trained on to the agreed stop, and saved that step
            done = int(DETECTED[fault].search(log).group(0).split()[-1])
        # The chart's own split of the fault's loss (train/goodput.py fault_parts), from rank 0's progress file.
        parts = cluster.progress(cluster.pods_of("worker")[0]).get("fault") or {}
        return {"detected_s": detected - killed, "recovery_s": recovered - killed, "trained": done, "resumed": resumed,
                "lost": done - resumed, "recreated": len(recreated), "budget": int(BUDGET_USED.findall(log)[-1]),
                "parts": parts, "ok": codes == [0] * len(codes) and max(step_losses(log)) == 200}


RESUMED_STEP = re.compile(r"resumed from .*?INFO step \d+/", re.S)


def bare_recovery(extensions: Path, workers: int = 2) -> tuple[float, dict]:
    """Recovery of bare `deepspeed --no_ssh` per host under the quickest supervisor there can be: when the first
    host's deepspeed exits (its launch.py saw the killed rank), every host's processes are killed and the same
    command starts again on every host (the train package resumes from the last checkpoint). Seconds from the
    SIGKILL of a rank of worker 1 at step ~50 (checkpoint every 20) to the first step after the resume, and the
    same parts as the chart's split (train/goodput.py fault_parts) at the supervisor's own moments: detect from the
    last step to the first deepspeed's exit, stop until every process ended, reschedule 0 (it starts at once)."""
    v = values(extensions, "nossh", workers, steps=200, log_every=1, checkpoint_every=20)
    with Cluster(render(v)) as cluster:
        hosts = cluster.pods_of("worker")
        records = cluster.checkpoint_dir() / "_job" / "goodput" / "local"
        wall = lambda mono: time.time() - (time.monotonic() - mono)  # noqa: E731

        def log(attempt: int) -> str:
            path = cluster.tmp / f"{hosts[0].name}-bare{attempt}.log"
            return path.read_text(errors="replace") if path.exists() else ""

        def record() -> dict | None:
            """Rank 0's newest goodput record, with its last steps (the .step line, newer than the last flush)."""
            found = sorted(records.glob("*.json")) if records.is_dir() else []
            if not found:
                return None
            newest = json.loads(found[-1].read_text())
            step, productive, updated = found[-1].with_suffix(".step").read_text().split()
            if int(step) > newest["last_step"]:
                newest.update(last_step=int(step), productive_s=float(productive), updated=float(updated))
            return newest

        processes = start_bare(cluster, "bare1")
        wait_for(lambda: re.search(r"INFO step (4[5-9]|5[0-9])/", log(1)), 300, "step ~50", lambda: log(1), 0.05)
        os.kill(cluster.rank_pids(hosts[1], ranks_only=True)[0], signal.SIGKILL)
        killed = time.monotonic()
        detected = wait_for(lambda: any(p.poll() is not None for p in processes), 600, "a host's deepspeed to exit",
                            interval=0.05)
        for host in hosts:
            cluster.kill(host)
        for process in processes:
            process.wait(timeout=60)
        stopped = time.monotonic()
        before = record()  # the retry's Goodput removes it (a run outside the chart is a job of its own)
        processes = start_bare(cluster, "bare2")
        recovered = wait_for(lambda: RESUMED_STEP.search(log(2)), 300, "the first step after the resume",
                             lambda: log(2), 0.05)
        wait_for(lambda: (r := record()) and r.get("first_step"), 60, "the retry's goodput record")
        after = record()
        for host in hosts:
            cluster.kill(host)
        rendezvous, load = after.get("rendezvous_s") or 0.0, after["restore_s"]
        parts = {"detect": wall(detected) - before["updated"], "stop": stopped - detected, "reschedule": 0.0,
                 "start": after["first_step"] - wall(stopped) - rendezvous - load, "rendezvous": rendezvous,
                 "load": load, "first_step": after["first_step_s"], "recompute": goodput._lost(before, after)}
        return recovered - killed, {**parts, "total": sum(parts.values())}


def print_parts(parts: dict[str, list[dict]]) -> None:
    """The recovery's loss by its parts (medians; the chart's from its own split), and the chart's seconds above
    bare DeepSpeed's for each."""
    names = list(parts)
    medians = {name: {part: statistics.median([run.get(part, 0.0) for run in runs]) for part in (
        *protocol.FAULT_PARTS, "total")} for name, runs in parts.items() if runs}
    bare = medians.get(names[0], {})
    short = {name: "bare" if i == 0 else name.removeprefix("chart, launchMode ") for i, name in enumerate(names)}
    print("the same, by parts (median s; chart parts from its own split, bare from the supervisor's moments; "
          "+mode: the chart's seconds above bare)")
    print(f"{'part':<12}" + "".join(f"{short[name]:>10}" for name in medians)
          + "".join(f"{'+' + short[name]:>10}" for name in names[1:] if name in medians))
    for part in (*protocol.FAULT_PARTS, "total"):
        print(f"{part:<12}" + "".join(f"{medians[name][part]:>10.2f}" for name in medians)
              + "".join(f"{medians[name][part] - bare.get(part, 0.0):>+10.2f}" for name in names[1:]
                        if name in medians), flush=True)


TOKENS_S = re.compile(r"INFO step (\d+)/\d+ \| .*? \| ([\d,]+) tokens/s")


def steady_tokens_s(log: str) -> float:
    """Median tokens/s of the logged steps after the first 50 (start-up and warm-up left out)."""
    return statistics.median(float(t.replace(",", "")) for step, t in TOKENS_S.findall(log) if int(step) > 50)


def healthy_run(extensions: Path, mode: str, detection: bool | None) -> float:
    """tokens/s of 300 steps: the chart in `mode` with hang detection on or off, or (None) bare deepspeed."""
    v = values(extensions, "nossh" if detection is None else mode, steps=300, log_every=10, checkpoint_every=0)
    v["hangDetection"] = {"enabled": bool(detection)}
    with Cluster(render(v)) as cluster:
        if detection is None:
            workers = cluster.pods_of("worker")
            processes = start_bare(cluster, "bare")
            for process in processes:
                process.wait(timeout=300)
            return steady_tokens_s((cluster.tmp / f"{workers[0].name}-bare.log").read_text(errors="replace"))
        for pod in cluster.pods:
            cluster.start(pod)
        for pod in job_pods(cluster):
            pod.process.wait(timeout=300)
        return steady_tokens_s(rank0_pod(cluster).log())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hosts", default="2",
                        help="comma-separated host counts for the start-up and recovery tables, e.g. 2,4,8")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: " + ", ".join(FAULTS))
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up table")
    parser.add_argument("--no-recovery", action="store_true", help="skip the recovery table")
    parser.add_argument("--no-overhead", action="store_true", help="skip the hang detection overhead table")
    args = parser.parse_args()
    reason = namespaces_available()
    if reason:
        print(f"cannot run: {reason}")
        return 1
    ensure_user(UID, "/home/deepspeed")
    extensions = prebuilt_ops_for_pods(UID)
    for hosts in () if args.no_startup else (int(n) for n in args.hosts.split(",")):
        rows = {"bare deepspeed --no_ssh per host": [], "chart, launchMode ssh": [], "chart, launchMode nossh": []}
        for _ in range(args.repeats):  # interleaved, so drift hits every row alike
            rows["bare deepspeed --no_ssh per host"].append(bare_startup(extensions, hosts))
            rows["chart, launchMode ssh"].append(chart_startup(extensions, "ssh", hosts))
            rows["chart, launchMode nossh"].append(chart_startup(extensions, "nossh", hosts))
        bare = statistics.median(rows["bare deepspeed --no_ssh per host"])
        print(f"start-up: all pods started -> first optimizer step ({hosts} hosts x 1 CPU rank, ZeRO-2)")
        print(f"{'':<36}{'median s':>9}{'vs bare':>9}   runs")
        for name, runs in rows.items():
            print(f"{name:<36}{statistics.median(runs):>9.1f}{statistics.median(runs) / bare:>8.2f}x   "
                  + " ".join(f"{x:.1f}" for x in runs), flush=True)
    for hosts in () if args.no_recovery else (int(n) for n in args.hosts.split(",")):
        rows = {"bare deepspeed, quickest supervisor": [], "chart, launchMode ssh": [], "chart, launchMode nossh": []}
        parts = {name: [] for name in rows}
        for _ in range(args.repeats):  # interleaved, so drift hits every row alike
            seconds, split = bare_recovery(extensions, hosts)
            rows["bare deepspeed, quickest supervisor"].append(seconds)
            parts["bare deepspeed, quickest supervisor"].append(split)
            for mode in ("ssh", "nossh"):
                trial = fault_trial(extensions, mode, "crash", hosts)
                assert trial["ok"], trial
                rows[f"chart, launchMode {mode}"].append(trial["recovery_s"])
                parts[f"chart, launchMode {mode}"].append(trial["parts"])
        bare = statistics.median(rows["bare deepspeed, quickest supervisor"])
        print(f"recovery: a rank SIGKILLed at step ~50 -> first optimizer step after the resume ({hosts} hosts x 1 "
              "CPU rank, ZeRO-2, checkpoint every 20)")
        print(f"{'':<36}{'median s':>9}{'vs bare':>9}   runs")
        for name, runs in rows.items():
            print(f"{name:<36}{statistics.median(runs):>9.1f}{statistics.median(runs) / bare:>8.2f}x   "
                  + " ".join(f"{x:.1f}" for x in runs), flush=True)
        print_parts(parts)
    if not args.no_overhead:
        runs = {(mode, on): [] for mode in ("ssh", "nossh") for on in (True, False)} | {("bare", None): []}
        for _ in range(args.repeats):  # interleaved, so drift hits every row alike
            for mode, on in runs:
                runs[(mode, on)].append(healthy_run(extensions, mode, on))
        bare = statistics.median(runs[("bare", None)])
        print("\nhang detection overhead: tokens/s of a healthy run (300 steps, median of steps 60-300; 2 hosts x 1 "
              "CPU rank, ZeRO-2)")
        print(f"{'':<44}{'median':>9}{'vs bare':>9}   runs")
        for (mode, on), values_ in runs.items():
            name = "bare deepspeed --no_ssh (no heartbeat)" if on is None else \
                f"chart, {mode}, hang detection {'on' if on else 'off'}"
            print(f"{name:<44}{statistics.median(values_):>9,.0f}{statistics.median(values_) / bare:>8.2f}x   "
                  + " ".join(f"{x:,.0f}" for x in values_))
    faults = [f for f in args.faults.split(",") if f]
    if faults:
        print("\nfault drill: a rank of worker 1 at step ~50 of 200, checkpoint every 20, the chart's hang budgets "
              "(300 s to the first step, 120 s per step), runRetries 1")
        print(f"{'fault':<11}{'mode':<7}{'trial':>6}{'detected after s':>18}{'resumed after s':>17}{'trained':>9}"
              f"{'resumed':>9}{'lost':>6}{'pods recreated':>16}{'budget used':>13}{'finished':>10}")
        show = lambda x: "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)  # noqa: E731
    for fault in faults:
        for mode in ("ssh", "nossh"):
            for i in range(args.trials):
                t = fault_trial(extensions, mode, fault)
                print(f"{fault:<11}{mode:<7}{i + 1:>6}{show(t['detected_s']):>18}{show(t['recovery_s']):>17}"
                      f"{show(t['trained']):>9}{show(t['resumed']):>9}{show(t['lost']):>6}{t['recreated']:>16}"
                      f"{show(t.get('budget')):>13}{str(t['ok']):>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
