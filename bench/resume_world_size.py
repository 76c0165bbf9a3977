"""Resume on another world size, side by side with the uninterrupted run: for each ZeRO stage, 12 steps on 2 CPU
ranks (checkpoints at 6 and 12, global batch 12), then the step-6 checkpoint resumed on 1 and on 3 ranks through
the train package's universal conversion. Prints the conversion time, the loss at the checkpoint and the first
resumed step against the uninterrupted run, and the largest per-step difference over steps 7-12.

    python bench/resume_world_size.py [--stages 1 2 3] [--to 1 3]
"""

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.train_run import cpu_ds_config, run_train, write_ds_config  # noqa: E402
from train import checkpoint  # noqa: E402

ARGS = ["--model.n-layer=2", "--model.d-model=64", "--model.seq-len=32", "--log-every=1", "--checkpoint-every=6"]


def train(tmp: Path, ckpt: Path, ranks: int, stage: int) -> str:
    ds = write_ds_config(tmp, cpu_ds_config(stage=stage, micro=2, accum=None, train_batch_size=12))
    result = run_train([f"--ds-config={ds}", f"--checkpoint-dir={ckpt}", "--steps=12", *ARGS], ranks=ranks,
                       timeout=600)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-3000:])
    return result.stdout


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"\[rank 0\] INFO step (\d+)/\d+ \| loss ([\d.]+)", out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--to", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    print(f"{'ZeRO':<6}{'from':>5}{'to':>4}{'converted in s':>16}{'loss step 6':>13}{'step 7 resumed':>16}"
          f"{'step 7 uninterrupted':>22}{'max |diff| 7-12':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for stage in args.stages:
            reference = losses(train(tmp, tmp / f"z{stage}", 2, stage))
            for to in args.to:
                ckpt = tmp / f"z{stage}-to{to}"
                shutil.copytree(tmp / f"z{stage}", ckpt)
                shutil.rmtree(ckpt / checkpoint.tag_for(12))
                out = train(tmp, ckpt, to, stage)
                seconds = float(re.search(r"to the universal checkpoint \S+ in ([\d.]+)s", out).group(1))
                resumed = losses(out)
                worst = max(abs(resumed[s] - reference[s]) for s in resumed)
                print(f"{stage:<6}{2:>5}{to:>4}{seconds:>16.1f}{reference[6]:>13.4f}{resumed[7]:>16.4f}"
                      f"{reference[7]:>22.4f}{worst:>17.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
