"""The checks every rank runs at start, run once before anything is deployed: the chart's pre-install and
pre-upgrade hook Job (templates/config-check.yaml) runs this module in the workers' image, so that `helm install`
without the glue refuses what every rank would refuse, before a GPU is allocated. The glue (scripts/deployctl)
runs the same functions locally.

    python -m train.preflight [--fills-auto] [--cpu-ranks]  # any program: the ds_config at DS_CONFIG_PATH
    python -m train.preflight --train-package -- ARGS       # the train package, with the arguments its ranks get

The world size is DS_WORLD_SIZE (worker.replicas x worker.gpusPerWorker); --cpu-ranks: the ranks run on CPUs
(worker.gpuResourceName ""), so fused optimizers without a CPU kernel are refused. What needs a rank's own
hardware, disks or data (fp16 on its CPU, a writable checkpoint directory, the data files) is left to the rank.
Exit 0 and one line saying what passed, or exit 2 and one line naming the value (deepspeed.config, train.config,
train.args).
"""

import argparse
import logging
import os
import sys

# The chart's files and the values they are rendered from, for error lines that name what the user wrote.
VALUES_OF_ENV = {"DS_CONFIG_PATH": "deepspeed.config", "DS_TRAIN_CONFIG_PATH": "train.config"}


def by_value(text: str) -> str:
    """`text` with the chart's file paths replaced by the values they are rendered from."""
    for env, key in VALUES_OF_ENV.items():
        path = os.environ.get(env)
        if path:
            text = text.replace(path, f"{key} ({path})")
    if text.startswith("command line: "):  # the train package's parser: the chart's own arguments are checked
        text = "train.args: " + text.removeprefix("command line: ")  # at render, so it is one of train.args
    return text


def check(train_package: bool, fills_auto: bool, cpu_ranks: bool, argv: list[str]) -> str:
    """What passed, in one line; raises the rank's own errors (ConfigError, DsConfigError, LayoutError)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no device here, and none needed: only configs are checked
    from train import dsconfig
    from train.layout import Layout

    world_size = int(os.environ.get("DS_WORLD_SIZE", "1"))
    if train_package:
        from train.checks import check_config
        from train.config import parse_args
        cfg = parse_args(argv)
        layout, ds_config, batch = check_config(cfg, world_size)
    else:
        from train import checkpoint
        from train.config import ConfigError
        path = os.environ["DS_CONFIG_PATH"]
        layout = Layout(world_size)
        ds_config = dsconfig.load(path)
        batch = dsconfig.check_run(ds_config, layout, path, fills_auto=fills_auto)
        try:
            checkpoint.check_storage(ds_config, layout, checkpoint.storage(), path)
        except checkpoint.CheckpointError as err:
            raise ConfigError(str(err)) from None
    if cpu_ranks:
        dsconfig.check_optimizer_kernel(ds_config, "cpu", os.environ["DS_CONFIG_PATH"])
    micro, accum, total = ("auto" if n is None else n for n in batch)
    return (f"config check passed: ds_config for {layout.describe()} (world size {world_size}), batch micro "
            f"{micro} x accumulation {accum} = {total}" + (", train config and arguments" if train_package else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-package", action="store_true",
                        help="the ranks run `python -m train`: check its config and ARGS as they will")
    parser.add_argument("--fills-auto", action="store_true",
                        help="the program fills the ds_config's \"auto\" values (train.fillsDsConfigAuto)")
    parser.add_argument("--cpu-ranks", action="store_true",
                        help="the ranks run on CPUs (worker.gpuResourceName \"\")")
    parser.add_argument("args", nargs="*", help="the train package's arguments, after --")
    opts = parser.parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its import-time notes are not this check's output
    from podruntime import protocol
    from train.config import ConfigError
    from train.dsconfig import DsConfigError
    from train.layout import LayoutError
    try:
        protocol.check_version(os.environ.get(protocol.PROTOCOL_ENV), "config check")
        print(check(opts.train_package, opts.fills_auto, opts.cpu_ranks, opts.args), flush=True)
    except (ConfigError, DsConfigError, LayoutError, protocol.VersionSkew) as err:
        print(f"config check failed: {by_value(str(err))}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
