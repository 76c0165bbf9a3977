"""`make soak` (not in CI): the chart on the real kubelet for half an hour or more with a fault every few minutes,
and what each fault cost, measured two ways.

The cluster tier's sizing (charts/deepspeed-training/ci/09-small-node-values.yaml: two CPU workers on the one-node
Kubernetes of ../shared/k8s), the chart's default storage (a volume per worker pod, the peer copy) plus the local
RADOS Gateway as the bucket tier, a checkpoint every --checkpoint-every steps (the report says how many seconds that
was), the chart's default hang detection. Every --fault-every seconds, one fault, in turn:

    kill-rank            kill -9 of worker 1's rank (a crash: one failure spent)
    stop-rank            SIGSTOP of worker 1's rank (a hang: found by its signals, one failure)
    delete-worker        `kubectl delete pod` of worker 1 (SIGTERM: it saves; a preemption)
    force-delete-worker  the same with --grace-period=0 --force
    delete-all-pods      every pod of the release deleted (every volume lost: the bucket, a preemption)

A fault's loss is the time from the fault until rank 0 logs a step past the last step it had reached when the fault
stopped it (detection, restart, restore and the steps trained again). A fault is not injected before the last one's
run is back past its step and has trained --settle seconds more.

Goodput two ways: the chart's own accounting (the progress ConfigMap's `goodput`, train/goodput.py) and an
independent stopwatch here: the time during which rank 0 went past every step it had reached before (its logged
lines with the kubelet's timestamps: new progress, no stop), over the wall time since `helm install` returned.
Then the projection to one fault every 30 minutes (the MLCommons estimate for a 100,000-accelerator cluster):
the fault-free goodput less the mean loss per fault over 1,800 s.

    make soak [SOAK_ARGS="--minutes 30 --fault-every 180 --mode ssh"]

Not injected: a rank blocked without CPU or I/O (the unit and e2e tiers' probes do that: tests/test_watchdog_signals.py,
tests/e2e/test_hangs.py); injecting it into the train package's rank needs a debugger in the image.
"""

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import test_cluster as tier  # noqa: E402
from tests.support import s3  # noqa: E402

KINDS = ("kill-rank", "stop-rank", "delete-worker", "force-delete-worker", "delete-all-pods")
STEP_LINE = re.compile(r"^(\S+) .*INFO step (\d+)/")
GAP_S = 3.0  # no line from rank 0 for this long: training stopped


def kubectl(*args: str, namespace: str, check: bool = False, timeout: float = 60) -> str:
    try:
        return tier.kubectl(*args, namespace=namespace, check=check, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ""


class Rank0Log:
    """Rank 0's logged steps with the kubelet's timestamps (`kubectl logs --timestamps`), read every `poll` seconds
    from every pod that holds rank 0 (the launcher in ssh, worker 0 in nossh; a replaced pod's too)."""

    def __init__(self, namespace: str, mode: str, poll: float = 2.0):
        self.namespace, self.poll = namespace, poll
        self.selector, self.container = (
            ("app.kubernetes.io/component=launcher", "launcher") if mode == "ssh" else
            (f"job-name={tier.NOSSH_WORKERS},batch.kubernetes.io/job-completion-index=0", "worker"))
        self.lines: dict[tuple[float, int], None] = {}  # (time, step), in the order first seen
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            pods = kubectl("get", "pods", "-l", self.selector, "-o", "name", namespace=self.namespace).split()
            for pod in pods:
                out = kubectl("logs", pod, "-c", self.container, "--timestamps", "--tail=400",
                              namespace=self.namespace, timeout=30)
                for line in out.splitlines():
                    match = STEP_LINE.match(line)
                    if match:
                        stamp = datetime.datetime.fromisoformat(match[1].replace("Z", "+00:00")).timestamp()
                        with self.lock:
                            self.lines.setdefault((stamp, int(match[2])), None)
            self.done.wait(self.poll)

    def steps(self) -> list[tuple[float, int]]:
        with self.lock:
            return sorted(self.lines)

    def newest(self, before: float | None = None) -> int:
        return max((s for t, s in self.steps() if before is None or t <= before), default=0)

    def recovery(self, at: float) -> tuple[int, float] | None:
        """(the step training had reached when the fault stopped it, when rank 0 first logged a step past it again)
        for a fault at `at`; None until then. The stop is the first gap of GAP_S or more in rank 0's lines after
        `at` (healthy lines come every few tens of milliseconds), so the steps trained while the fault took effect
        (a pod's deletion reaches its ranks a second or two later) count as reached, and lines still in a pipe do
        not count as the recovery."""
        steps = self.steps()
        previous = max((line for line in steps if line[0] <= at), default=None)
        for line in (line for line in steps if line[0] > at):
            if previous is not None and line[0] - previous[0] >= GAP_S:
                stopped = max(s for t, s in steps if t <= previous[0])
                back = min((t for t, s in steps if t >= line[0] and s > stopped), default=None)
                return (stopped, back) if back is not None else None
            previous = line
        return None

    def advancing_s(self, since: float = 0.0, until: float = float("inf")) -> tuple[float, int]:
        """(seconds, steps) during which rank 0 went past every step it had reached before: the intervals between
        its consecutive lines that are new progress (not steps trained again after a resume) and no stop (under
        GAP_S), between `since` and `until`. The stopwatch's productive time: the steps' own time and what lies
        between them (the step loop's logging, a save's stall), never a fault's."""
        seconds, steps, reached = 0.0, 0, -1
        lines = self.steps()
        for (t1, s1), (t2, s2) in zip(lines, lines[1:], strict=False):
            if since <= t1 and t2 <= until and s1 >= reached and s2 > s1 and t2 - t1 < GAP_S:
                seconds, steps = seconds + t2 - t1, steps + s2 - s1
            reached = max(reached, s1)
        return seconds, steps


def worker1(namespace: str, mode: str) -> str:
    return f"{tier.WORKERS}-1" if mode == "ssh" else tier.nossh_pod(namespace, 1)


def inject(kind: str, namespace: str, mode: str) -> None:
    pod = worker1(namespace, mode)
    if kind in ("kill-rank", "stop-rank"):
        signal = "-KILL" if kind == "kill-rank" else "-STOP"
        kubectl("exec", pod, "-c", "worker", "--", "pkill", signal, "-f", "--", "--local_rank=", namespace=namespace)
    elif kind == "delete-worker":
        kubectl("delete", "pod", pod, "--wait=false", namespace=namespace)
    elif kind == "force-delete-worker":
        kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false", namespace=namespace)
    else:
        kubectl("delete", "pods", "-l", f"app.kubernetes.io/instance={tier.RELEASE}", "--wait=false",
                namespace=namespace)


def chart_goodput(namespace: str) -> float | None:
    data = tier.progress_data(namespace)
    match = re.match(r"goodput ([\d.]+)%", data.get("goodput", ""))
    return float(match[1]) / 100 if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--fault-every", type=float, default=180, help="seconds between faults")
    parser.add_argument("--settle", type=float, default=30, help="seconds of training past a recovery before the "
                        "next fault")
    parser.add_argument("--mode", choices=("ssh", "nossh"), default="ssh")
    parser.add_argument("--checkpoint-every", type=int, default=400, help="steps (the tier's model trains about 40 "
                        "steps/s on 2 cores: a save every 10 s)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--lines", help="a JSON file for rank 0's timed steps and the faults")
    args = parser.parse_args()
    if tier.REASON:
        print(f"soak: {tier.REASON}")
        return 2
    if s3.unavailable():
        print(f"soak: {s3.unavailable()}")
        return 2
    kinds = args.kinds.split(",")
    s3.claim_session()  # a user of the gateway: a test session that ends beside the soak leaves it running
    gateway = s3.up()
    bucket = s3.new_bucket(gateway, "soak")
    namespace = f"soak-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", namespace, namespace="default", check=True)
    log = None
    try:
        kubectl("create", "secret", "generic", "ckpt-s3", *(f"--from-literal={key}={gateway[key]}" for key in (
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")), namespace=namespace, check=True)
        asked = time.time()
        tier.install(namespace, steps=10**7, launchMode=args.mode,
                     job={"runRetries": 100},  # failures: a crash, a hang, a pod killed outright
                     train_config={"checkpoint_every": args.checkpoint_every, "log_every": 2},
                     checkpoints={"objectStore": {"bucket": bucket, "endpoint": tier.endpoint_for_pods(gateway),
                                                  "credentialsSecret": "ckpt-s3"}})
        # The wall from here: helm has run the config check and created the release (the chart's own accounting
        # starts at its first attempt's begin, when the pods' loop starts, a few seconds later).
        installed = time.time()
        print(f"soak: helm install took {installed - asked:.1f}s (the config check included)", flush=True)
        log = Rank0Log(namespace, args.mode)
        tier.wait_for(lambda: log.newest() >= 2 * args.checkpoint_every, 600, "training to start",
                      lambda: tier.diagnose(namespace))
        print(f"soak: {namespace}, {args.mode}, training; a fault every {args.fault_every:.0f}s for "
              f"{args.minutes:.0f} minutes", flush=True)
        end = installed + 60 * args.minutes
        faults, next_at, turn, seen_fault = [], time.time() + args.fault_every, 0, ""
        while time.time() < end:
            time.sleep(max(0.0, min(next_at, end) - time.time()))
            if time.time() >= end:
                break
            kind = kinds[turn % len(kinds)]
            turn += 1
            at = time.time()
            inject(kind, namespace, args.mode)
            step, back = tier.wait_for(lambda at=at: log.recovery(at), 900, f"training past its step after {kind}",
                                       lambda: tier.diagnose(namespace))
            # The chart's own split of the loss (the progress ConfigMap's lastFault, rank 0's after the retry's
            # first step), once it names an attempt after the one before.
            parts = tier.wait_for(lambda seen=seen_fault: (line := tier.progress_data(namespace).get("lastFault", ""))
                                  != seen and line, 60, f"the chart's split of {kind}'s loss",
                                  lambda: str(tier.progress_data(namespace)))
            seen_fault = parts
            faults.append({"kind": kind, "at": at, "step": step, "loss": back - at, "chart": parts})
            print(f"soak: {kind}: stopped at step {step}, training past it {back - at:.1f}s after the fault; the "
                  f"chart: {parts}", flush=True)
            next_at = max(at + args.fault_every, time.time() + args.settle)
        time.sleep(10)  # the sidecar's last publication (at most every 2 s) of rank 0's newest record
        goodput = chart_goodput(namespace)
        last_t = log.steps()[-1][0]
        advancing, steps = log.advancing_s()
        stopwatch = advancing / (last_t - installed)
        # Fault-free: from rank 0's first logged step to the first fault: what lies between steps only.
        first_t = log.steps()[0][0]
        until = faults[0]["at"] if faults else last_t
        fault_free = log.advancing_s(until=until)[0] / (until - first_t)
        step_s = advancing / steps if steps else float("nan")
        print(report(faults, kinds, goodput, stopwatch, fault_free, step_s, last_t - installed, args))
        if args.lines:
            Path(args.lines).write_text(json.dumps({"installed": installed, "faults": faults, "lines": log.steps()}))
        print(f"the chart's accounting: {tier.progress_data(namespace).get('goodput', '')}")
        return 0
    except AssertionError as err:  # a wait that ran out: what the cluster showed is in it
        print(f"soak: {err}")
        return 1
    finally:
        if log is not None:
            log.done.set()
        tier.stop_endless_job(namespace)
        kubectl("delete", "namespace", namespace, "--wait=false", namespace="default")
        s3.leave()


def report(faults, kinds, goodput, stopwatch, fault_free, clean, wall, args) -> str:
    rows = ["| fault | n | loss median s | loss max s |", "| --- | --- | --- | --- |"]
    for kind in kinds:
        losses = [f["loss"] for f in faults if f["kind"] == kind]
        if losses:
            rows.append(f"| {kind} | {len(losses)} | {statistics.median(losses):.1f} | {max(losses):.1f} |")
    mean = statistics.mean(f["loss"] for f in faults) if faults else 0.0
    chart = f"{100 * goodput:.1f}%" if goodput is not None else "not published"
    rows += ["", "| goodput | value |", "| --- | --- |",
             f"| the chart's own (progress ConfigMap) | {chart} |",
             f"| stopwatch: rank 0 past its newest step, over {wall:.0f} s of wall since helm install returned "
             f"({clean:.4f} s/step: a save every {args.checkpoint_every * clean:.1f} s) | {100 * stopwatch:.1f}% |",
             f"| fault-free (first step to first fault) | {100 * fault_free:.1f}% |",
             f"| at this soak's interval ({args.fault_every:.0f} s, {len(faults)} faults) | {100 * stopwatch:.1f}% |",
             f"| projected at one fault every 30 minutes (mean loss {mean:.1f} s) | "
             f"{100 * (fault_free - mean / 1800):.1f}% |"]
    if goodput is not None:
        rows.append(f"| chart - stopwatch | {100 * (goodput - stopwatch):+.1f} points |")
    return "\n".join(rows) + "\n" + json.dumps({"faults": faults}, indent=None)


if __name__ == "__main__":
    sys.exit(main())
