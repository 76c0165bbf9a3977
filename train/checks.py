"""The checks a rank runs before it joins the process group, below the program: a bad file or a wrong world fails
every rank at once, with exit 2 and one line, instead of after the rendezvous (or, worse, inside
deepspeed.initialize). check_config is the part that needs neither the rank's hardware, its disks nor the data: the
chart's config check hook (train/preflight.py) runs it too, without importing the training loop."""

import os
from dataclasses import dataclass
from pathlib import Path

from train import checkpoint, dsconfig
from train.config import ConfigError, TrainConfig
from train.data import make_data
from train.layout import Layout, LayoutError


@dataclass
class Inputs:
    """What a rank checked before joining the process group: a bad file fails every rank at once, with exit
    2 and one line, instead of after the rendezvous (or, worse, inside deepspeed.initialize)."""
    ds_config: dict
    batch: tuple[int, int, int]
    data: object
    layout: Layout
    data_rank: int  # this rank's data-parallel rank


def check_config(cfg: TrainConfig, world_size: int) -> tuple[Layout, dict, tuple[int, int, int]]:
    """The start checks that need neither this rank's hardware, its disks nor the data: the ones the chart's
    pre-install hook runs too (train/preflight.py), so that the chart alone refuses what every rank would."""
    try:
        layout = Layout(world_size, cfg.model.pipeline_stages)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    check_chart_paths(cfg)
    ds_config = dsconfig.load(cfg.ds_config)
    batch = dsconfig.check_run(ds_config, layout, cfg.ds_config, steps=cfg.steps)
    try:
        checkpoint.check_storage(ds_config, layout, checkpoint.storage(), cfg.ds_config)
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
    return layout, ds_config, batch


def check_inputs(cfg: TrainConfig, rank: int, world_size: int) -> Inputs:
    layout, ds_config, batch = check_config(cfg, world_size)
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 - the rank's own hardware, not the hook's

    dsconfig.check_precision(ds_config, get_accelerator(), cfg.ds_config)
    if cfg.checkpoint_dir:
        checkpoint.check_writable(Path(cfg.checkpoint_dir))
    # Both ends of a pipeline read alike: they share a data-parallel rank.
    data = make_data(cfg.data, cfg.model, layout.data_rank(rank), layout.data_parallel, batch[0])
    return Inputs(ds_config, batch, data, layout, layout.data_rank(rank))


def check_chart_paths(cfg: TrainConfig) -> None:
    """Under the chart, which ds_config runs and where checkpoints go are the chart's (its env on every rank):
    a config key or a later flag that points elsewhere would train with an unchecked config, or save where no
    restart finds it."""
    for key, env in (("ds_config", "DS_CONFIG_PATH"), ("checkpoint_dir", "DS_CHECKPOINT_DIR")):
        chart_path, ours = os.environ.get(env, ""), getattr(cfg, key)
        if chart_path and os.path.normpath(ours or ".") != os.path.normpath(chart_path):
            raise ConfigError(f"{key} {ours!r}, but the chart's is {chart_path!r} ({env}): the chart decides it "
                              f"(deepspeed.config, checkpoints.mountPath); remove {key} from train.config and "
                              "train.args")


def check_world_size(world_size: int) -> None:
    """Before the rendezvous, on every rank: a job that "completes" on fewer ranks than it was given is a
    failure, and a rank that counts another world size than its peers would hang in the rendezvous."""
    expected = int(os.environ.get("DS_WORLD_SIZE", world_size))  # the chart's workers x gpusPerWorker
    if world_size != expected:
        raise ConfigError(f"world size {world_size} (WORLD_SIZE from DeepSpeed's launcher), but the chart runs "
                          f"{expected} ranks (DS_WORLD_SIZE: worker.replicas x worker.gpusPerWorker): a worker, its "
                          "GPUs or its hostfile entry is wrong")


def check_devices() -> None:
    """Before anything else touches a device: a worker given GPUs (DS_GPUS_PER_WORKER, the chart's
    worker.gpusPerWorker when worker.gpuResourceName is set) whose ranks see fewer (a node's device plugin or
    driver, CUDA_VISIBLE_DEVICES) would fail each rank later with "invalid device ordinal", or train on the CPU."""
    wanted = int(os.environ.get("DS_GPUS_PER_WORKER") or 0)
    if not wanted:
        return
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    accelerator = get_accelerator()
    seen = 0 if accelerator.device_name() == "cpu" else accelerator.device_count()
    if seen < wanted:
        raise ConfigError(f"this worker's ranks see {seen} GPUs (DeepSpeed's accelerator: "
                          f"{accelerator.device_name()}), but worker.gpusPerWorker is {wanted}: the node gives the "
                          "pod fewer (its device plugin, driver or CUDA_VISIBLE_DEVICES)")
