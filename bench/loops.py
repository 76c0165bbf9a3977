"""The two reference loops of bench/train_overhead.py, run on every rank by `deepspeed --num_gpus N`:
--mode ddp: plain PyTorch DistributedDataParallel + AdamW; --mode deepspeed: a minimal deepspeed.initialize loop.
Same model (train.model.GPT), data (train.data.SyntheticData) and batch as `python -m train`. Prints one JSON
line per rank: tokens/s over the whole run and peak RSS."""

import argparse
import json
import resource
import time

import deepspeed
import torch
import torch.distributed as dist

from train import dsconfig
from train.config import DataConfig, ModelConfig
from train.data import SyntheticData
from train.layout import Layout
from train.model import GPT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "deepspeed"], required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--model", type=json.loads, required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    ds_config = dsconfig.load(args.ds_config)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum, global_batch = dsconfig.batch_sizes(ds_config, Layout(world), args.ds_config)
    model_cfg = ModelConfig(**args.model)
    data = SyntheticData(DataConfig(), model_cfg, rank, world)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    params = ds_config["optimizer"]["params"]
    if args.mode == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=params["lr"], weight_decay=params.get("weight_decay", 0))
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    position = 0
    started = time.perf_counter()
    for _ in range(args.steps):
        for _ in range(accum):
            inputs, targets = data.batch(position, micro)
            position += micro
            loss = engine(inputs, targets)
            if args.mode == "ddp":
                (loss / accum).backward()
            else:
                engine.backward(loss)
                engine.step()
        if args.mode == "ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), ds_config.get("gradient_clipping", 1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # as train/main.py does each step
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("BENCH " + json.dumps({"rank": rank, "tokens_per_s": global_batch * model_cfg.seq_len * args.steps / elapsed,
                                 "peak_rss_mib": peak}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
