"""What the progress reporting costs, side by side on this machine (issue: progress ConfigMap and metrics):
(a) a rank's `rankstate.beat(step)` per step without DS_RANK_STATE_DIR (nothing written), (b) with it (the state
line, and rank 0's progress.json every PUBLISH_EVERY_S), (c) rank 0's goodput record per step (train/goodput.py),
and (d) the progress sidecar (podruntime/sidecar.py): its CPU
while a rank beats STEPS_PER_S steps a second and a scraper reads /metrics every second, as Prometheus would.

    python bench/progress_overhead.py [--seconds 20]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402

STEPS_PER_S = 100
BEATS = """
import os, sys, time
from train import rankstate
n, pace = int(sys.argv[1]), float(sys.argv[2])
rankstate.report("starting")
started = time.perf_counter()
for step in range(1, n + 1):
    t = time.perf_counter()
    rankstate.beat(step)
    if pace:
        time.sleep(max(0.0, 1 / pace - (time.perf_counter() - t)))
print((time.perf_counter() - started) / n if not pace else 0)
"""


GOODPUT_STEPS = """
import sys, time
from pathlib import Path
from train.goodput import Goodput
n = int(sys.argv[1])
record = Goodput(Path(sys.argv[2]), 0, 0.0)
record.flush()
started = time.perf_counter()
for step in range(1, n + 1):
    record.step(step, time.time(), 0.01)
print((time.perf_counter() - started) / n)
"""


def per_goodput_step_us(checkpoints: str, n: int = 200_000) -> float:
    out = subprocess.run([sys.executable, "-c", GOODPUT_STEPS, str(n), checkpoints], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return float(out.split()[-1]) * 1e6


def per_beat_us(env: dict, n: int = 200_000) -> float:
    out = subprocess.run([sys.executable, "-c", BEATS, str(n), "0"], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return float(out.split()[-1]) * 1e6


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "DS_RANK_STATE_DIR"}
    with tempfile.TemporaryDirectory() as state_dir:
        rows = [(name, f"{per_beat_us({**base, **env}):.2f} us/step") for name, env in (
            ("beat(), no state dir (reporting off)", {"RANK": "0"}),
            ("beat(), rank 1 (state line)", {"RANK": "1", "DS_RANK_STATE_DIR": state_dir}),
            ("beat(), rank 0 (state line + progress.json)", {"RANK": "0", "DS_RANK_STATE_DIR": state_dir}))]
        rows.append(("goodput record, rank 0 (the .step line; the record every 2 s)",
                     f"{per_goodput_step_us(state_dir):.2f} us/step"))
        port = free_port()
        sidecar = subprocess.Popen([sys.executable, "-I", str(ROOT / "charts/deepspeed-training/files"), "sidecar",
                                    "--metrics-port", str(port), "--progress", "--job", "--world-size", "2"],
                                   env={**base, "DS_RANK_STATE_DIR": state_dir},
                                   stdout=subprocess.DEVNULL)
        rank = subprocess.Popen([sys.executable, "-c", BEATS, str(int(STEPS_PER_S * (args.seconds + 5))),
                                 str(STEPS_PER_S)], env={**base, "RANK": "0", "DS_RANK_STATE_DIR": state_dir},
                                cwd=ROOT, stdout=subprocess.DEVNULL)
        time.sleep(3)
        start_cpu, start, scrapes = cpu_seconds(sidecar.pid), time.monotonic(), 0
        while time.monotonic() - start < args.seconds:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                response.read()
            scrapes += 1
            time.sleep(1)
        used = cpu_seconds(sidecar.pid) - start_cpu
        elapsed = time.monotonic() - start
        rss = int(next(line.split()[1] for line in Path(f"/proc/{sidecar.pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS")))
        rank.kill()
        sidecar.terminate()
        sidecar.wait()
        rows.append((f"progress sidecar ({STEPS_PER_S} steps/s, {scrapes} scrapes)",
                     f"{100 * used / elapsed:.2f}% of one CPU, {rss / 1024:.0f} MiB RSS"))
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | cost |\n| {'-' * width} | --- |")
    for name, cost in rows:
        print(f"| {name:<{width}} | {cost} |")


if __name__ == "__main__":
    main()
