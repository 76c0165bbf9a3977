"""Overhead of the train package, side by side on this machine in one invocation:
(a) a plain PyTorch DDP loop, (b) a minimal deepspeed.initialize loop with the same ds_config, (c) `python -m
train`, for each ZeRO stage on N CPU ranks. Prints tokens/s, c/b (our overhead; target >= 0.98), b/a
(DeepSpeed's) and peak RSS per rank.

    python bench/train_overhead.py [--stages 0 1 2 3] [--steps 40] [--repeats 1] [--variants]

--variants also runs ZeRO-2 ds_config variants (overlap, bucket sizes) against the same DDP baseline.
--pipeline adds `python -m train` with 2 pipeline stages against data parallelism: same model, same ranks and
global batch (ZeRO-1, the highest stage a pipeline can use).
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402
from tests.support.train_run import cpu_ds_config, train_env  # noqa: E402

MODEL = {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128, "vocab_size": 256}
VARIANTS = {
    "zero2 defaults": {"stage": 2},
    "zero2 overlap_comm": {"stage": 2, "overlap_comm": True},
    "zero2 contiguous, 5e8 buckets": {"stage": 2, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
                                      "allgather_bucket_size": 500_000_000},
    "zero2 overlap + 5e7 buckets": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 50_000_000},
}


def deepspeed_cmd(ranks: int) -> list[str]:
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
            str(free_port())]


def run_loop(mode: str, ds_path: Path, steps: int, ranks: int) -> tuple[float, float]:
    cmd = deepspeed_cmd(ranks) + [str(ROOT / "bench" / "loops.py"), "--mode", mode, "--ds-config", str(ds_path),
                                  "--steps", str(steps), "--model", json.dumps(MODEL)]
    out = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=900).stdout
    rows = [json.loads(row) for row in re.findall(r"BENCH (\{[^}]*\})", out)]  # ranks may share a line
    if len(rows) != ranks:
        raise RuntimeError(f"{mode} run failed:\n{out[-3000:]}")
    return min(r["tokens_per_s"] for r in rows), max(r["peak_rss_mib"] for r in rows)


def run_train(ds_path: Path, steps: int, ranks: int, tmp: Path, *extra: str) -> tuple[float, float]:
    ckpt = Path(tempfile.mkdtemp(dir=tmp))
    args = ["--module", "train", "--ds-config", str(ds_path), "--steps", str(steps), "--log-every", str(steps),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(steps + 1), *extra]
    for key, value in MODEL.items():
        args += [f"--model.{key.replace('_', '-')}", str(value)]
    # train saves the final step's checkpoint; metrics.json's tokens/s leaves saving time out, like the loops.
    out = subprocess.run(deepspeed_cmd(ranks) + args, cwd=ROOT, env=train_env(), capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"train run failed:\n{out.stdout[-3000:]}")
    metrics = json.loads((ckpt / "metrics.json").read_text())
    return metrics["tokens_per_s"], max(metrics["peak_rss_mib"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="median of this many runs per cell")
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--pipeline", action="store_true")
    args = parser.parse_args()
    configs = {f"ZeRO-{s}": {"stage": s} for s in args.stages}
    if args.variants:
        configs.update(VARIANTS)
    print(f"model {MODEL}, micro batch 8 x {args.ranks} ranks, {args.steps} steps, 1 thread per rank, fp32")
    header = f"{'config':<32} {'DDP tok/s':>10} {'ds tok/s':>10} {'train tok/s':>11} {'c/b':>6} {'b/a':>6}  " \
             f"{'peak RSS/rank MiB (a/b/c)':>26}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, zero in configs.items():
            ds_path = tmp / "ds_config.json"
            ds_path.write_text(json.dumps(cpu_ds_config(micro=8, zero_optimization=zero)))
            cells = {"a": [], "b": [], "c": []}
            for _ in range(args.repeats):  # interleaved, so drift hits all three alike
                cells["a"].append(run_loop("ddp", ds_path, args.steps, args.ranks))
                cells["b"].append(run_loop("deepspeed", ds_path, args.steps, args.ranks))
                cells["c"].append(run_train(ds_path, args.steps, args.ranks, tmp))
            a, b, c = (statistics.median(x[0] for x in cells[k]) for k in "abc")
            rss = "/".join(f"{max(x[1] for x in cells[k]):.0f}" for k in "abc")
            print(f"{name:<32} {a:>10,.0f} {b:>10,.0f} {c:>11,.0f} {c / b:>6.2f} {b / a:>6.2f}  {rss:>26}", flush=True)
        if args.pipeline:
            pipeline_rows(args, tmp)
    return 0


def pipeline_rows(args, tmp: Path) -> None:
    """2 pipeline stages against data parallelism on the same ranks, model and global batch (16 x ranks/2)."""
    global_batch = 8 * args.ranks
    layouts = {
        f"data parallel, {args.ranks} ranks": ({"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 8,
                                                 "gradient_accumulation_steps": 1}, []),
        f"2 pipeline stages x {args.ranks // 2} data-parallel": (
            {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 4}, ["--model.pipeline-stages", "2"]),
    }
    print(f"\npipeline vs data parallel: {args.ranks} ranks, global batch {global_batch}, ZeRO-1, {args.steps} steps")
    print(f"{'layout':<36} {'train tok/s':>11} {'vs data parallel':>17} {'peak RSS/rank MiB':>18}")
    results = {}
    for name, (batch, extra) in layouts.items():
        ds_path = tmp / "ds_pipeline.json"
        config = cpu_ds_config(micro=batch["train_micro_batch_size_per_gpu"],
                               accum=batch["gradient_accumulation_steps"], zero_optimization={"stage": 1})
        ds_path.write_text(json.dumps({**config, "train_batch_size": batch["train_batch_size"]}))
        runs = [run_train(ds_path, args.steps, args.ranks, tmp, *extra) for _ in range(args.repeats)]
        results[name] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
    base = next(iter(results.values()))[0]
    for name, (tokens, rss) in results.items():
        print(f"{name:<36} {tokens:>11,.0f} {tokens / base:>16.2f}x {rss:>18,.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
