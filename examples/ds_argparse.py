"""A DeepSpeedExamples-style program: argparse with `deepspeed.add_config_arguments`, launched by the chart
with the `deepspeed` convention (`--deepspeed --deepspeed_config <ds_config>`) or as a script with the `none`
convention and placeholders (`--deepspeed_config={ds_config} --save_dir={checkpoint_dir}`).

    deepspeed prog.py --deepspeed --deepspeed_config ds_config.json [--steps N] [--save_dir DIR]

A small regression MLP on synthetic data; the loss is printed on rank 0 every 5 steps. Checkpoints go to --save_dir
(default: $DS_CHECKPOINT_DIR, set by the chart on every rank) every --save_every steps and at the end, as DeepSpeed
saves them (engine.save_checkpoint, `latest` naming the newest); a run resumes with engine.load_checkpoint from
`latest`, as DeepSpeedExamples do. On the chart's per-worker volumes every node has its own `latest` (the chart's
rank wrapper marks it: DeepSpeed writes it on global rank 0 only). Its one line for the chart's hang detection:
`rankstate.beat(step)`.
"""

import argparse
import os

import deepspeed
import torch

from train import rankstate  # the train package is in every image of the chart
from train.main import exit_cleanly


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save_dir", default=os.environ.get("DS_CHECKPOINT_DIR", ""))
    parser.add_argument("--save_every", type=int, default=0, help="0: only at the end")
    return deepspeed.add_config_arguments(parser).parse_args()


def main() -> int:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank, micro = engine.global_rank, engine.train_micro_batch_size_per_gpu()
    weights = torch.linspace(-1, 1, 16)
    generator = torch.Generator().manual_seed(1 + rank)
    start = 0
    if args.save_dir and os.path.isfile(os.path.join(args.save_dir, "latest")):
        path, client = engine.load_checkpoint(args.save_dir)
        start = client["step"] if client else 0
        print(f"ds_argparse: rank {rank} resumed from {path} at step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 16, generator=generator)
            loss = torch.nn.functional.mse_loss(engine(x).squeeze(-1), x @ weights)
            engine.backward(loss)
            engine.step()
        rankstate.beat(step)  # the chart's hang detection: one line
        if rank == 0 and step % 5 == 0:
            print(f"ds_argparse: step {step}/{args.steps} loss {loss.item():.4f} "
                  f"world {engine.world_size} config {args.deepspeed_config}", flush=True)
        if args.save_dir and (step == args.steps or args.save_every and step % args.save_every == 0):
            engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})
            if rank == 0:
                print(f"ds_argparse: saved {args.save_dir}/step{step}", flush=True)
    return 0


if __name__ == "__main__":
    exit_cleanly(main())
