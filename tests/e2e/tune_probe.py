"""Program for the autotuning e2e test: an argparse DeepSpeed script (the `deepspeed` convention) whose first
forward allocates a few MiB, since DeepSpeed's autotuner divides by the activation memory it measures there (the
rank's RSS growth on CPU). It trains until the tuner's profiled steps end it, or for --steps."""

import argparse

import deepspeed
import torch

from train.main import exit_cleanly


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=20)
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 256, 512)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    return 0


if __name__ == "__main__":
    exit_cleanly(main())
