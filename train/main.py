"""The training loop: set up DeepSpeed, resume, train, log on rank 0, checkpoint on all ranks, tear down."""

import logging
import math
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import default_pg_timeout

from podruntime import protocol
from train import checkpoint, dsconfig, mfu, rankstate
from train.checks import Inputs, check_devices, check_inputs, check_world_size
from train.config import ConfigError, TrainConfig, parse_args
from train.data import DataError, samples
from train.deepspeed_mirror import FirstCollectiveClock, groups_take_the_timeout
from train.model import GPT, build_model, count_parameters
from train.pipeline import PipelineGPT, stage_plan
from train.report import Run, RunReport, Utilisation

logger = logging.getLogger("train")
EXIT_SIGTERM = protocol.EXIT_STOPPED  # non-zero: the Job retries, the next attempt resumes from the saved step


def init_logger(rank: int) -> None:
    """INFO on rank 0, warnings and errors elsewhere, one format everywhere."""
    # DeepSpeed's ZeRO calls torch collectives that torch marks deprecated, once per step and rank.
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*",
                            category=FutureWarning)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


class NonFiniteLoss(Exception):
    """The mean loss is NaN or infinite (stop_on_nonfinite_loss): the attempt ends before the state is saved."""


class StopFlag:
    """Set by SIGTERM (pod eviction). Ranks agree on it each step, so all of them stop at the same step
    and can write the checkpoint together."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        rankstate.report("stopping")


def layout_of(engine, world_size: int, cfg: TrainConfig) -> dict:
    """How a checkpoint of this run is laid out: what a resume must match (train/checkpoint.py)."""
    return {"world_size": world_size, "zero_stage": engine.zero_optimization_stage(),
            "pipeline_stages": cfg.model.pipeline_stages}


def resume(engine, cfg: TrainConfig, inputs: Inputs, rank: int, layout: dict) -> tuple[int, int]:
    """(step, data position) of the newest complete checkpoint every rank agrees on; (0, 0) for a fresh start.
    A checkpoint of another layout (world size, ZeRO stage) is loaded through DeepSpeed's universal form, or its
    weights only with reset_optimizer; what changed in the ds_config since is logged, or refused."""
    own_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if not own_dir:
        return 0, 0
    ckpt_dir, owner, own = own_dir, checkpoint.release(), True
    tag = checkpoint.agree_on_resume_tag(ckpt_dir, rank, layout["world_size"], logger)
    other_release = checkpoint.resume_source()
    if not tag and other_release:  # the platform's opt-in: start from another release's checkpoint
        (ckpt_dir, owner), own = other_release, False  # the platform named that release: its name decides
        tag = checkpoint.agree_on_resume_tag(ckpt_dir, rank, layout["world_size"], logger)
    if not tag:
        return 0, 0
    manifest = checkpoint.read_manifest(ckpt_dir / tag)
    checkpoint.check_owner(manifest, ckpt_dir / tag, owner, own)
    if rank == 0:
        checkpoint.check_save_fits_grace(manifest, ckpt_dir / tag, logger)
    effect, kept = dsconfig.resume_changes(manifest.get("ds_config"), inputs.ds_config, cfg.reset_optimizer,
                                           cfg.ds_config)
    saved = checkpoint.saved_layout(manifest, layout)
    how = "same layout"
    if saved != layout:
        allowed = os.environ.get("DS_RESUME_ACROSS_WORLD_SIZES", "true") == "true"  # the chart's value
        how = checkpoint.cross_layout_load(ckpt_dir / tag, saved, layout, allowed, cfg.reset_optimizer)
    fresh = dict(load_optimizer_states=False, load_lr_scheduler_states=False) if cfg.reset_optimizer else {}
    if how == "universal":
        source = checkpoint.universal_copy(ckpt_dir, tag, rank, logger, into=own_dir)
        engine._config.load_universal_checkpoint = True  # for this load only: a later plain tag must not use it
        try:
            path, client_state = engine.load_checkpoint(str(source.parent), tag=tag)
        finally:
            engine._config.load_universal_checkpoint = False
    else:
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, **fresh)
    if path is None:
        raise checkpoint.CheckpointError(f"checkpoint {ckpt_dir / tag}: DeepSpeed could not load it")
    across = "" if how == "same layout" else f" (written with {checkpoint.describe_layout(saved)}; {how})"
    reset = ", optimizer and scheduler reset (reset_optimizer)" if cfg.reset_optimizer else ""
    logger.info(f"resumed from {ckpt_dir / tag} at step {client_state['step']}{across}{reset}")
    if effect:
        logger.info(f"ds_config changes since the checkpoint that take effect: {'; '.join(effect)}")
    if kept:
        logger.warning(f"ds_config changes since the checkpoint that do NOT take effect (the checkpoint's optimizer "
                       f"state wins; set reset_optimizer: true to apply them): {'; '.join(kept)}")
    return client_state["step"], client_state["data_position"]


def train_step(engine, inputs: Inputs, position: int) -> tuple[torch.Tensor, int]:
    """One optimizer step (accum micro-batches); returns this rank's mean loss and the new data position (in
    samples of the whole job). A pipeline runs the micro-batches itself (train_batch) and returns the mean loss
    over every rank."""
    micro, accum, _ = inputs.batch
    per_micro = micro * inputs.layout.data_parallel
    firsts = [samples(position + i * per_micro, micro, inputs.data_rank) for i in range(accum)]
    position += per_micro * accum
    if isinstance(engine.module, PipelineGPT):
        batches = (inputs.data.batch(first, micro) for first in firsts)
        return engine.train_batch(data_iter=batches).detach().float(), position
    step_loss = torch.zeros((), device=engine.device)
    for first in firsts:
        batch_inputs, targets = (t.to(engine.device) for t in inputs.data.batch(first, micro))
        loss = engine(batch_inputs, targets)
        engine.backward(loss)
        engine.step()
        step_loss += loss.detach().float() / accum
    return step_loss, position


def attempt_summary() -> str:
    """The job's attempt counter, as the chart's pod scripts give it to every rank (files/attempts.py: DS_ATTEMPT,
    DS_FAILURES, DS_FAILURE_BUDGET, DS_PREEMPTIONS); nothing outside the chart."""
    env = {key: os.environ.get(name, "") for key, name in rankstate.ATTEMPT_ENV.items() if key != "run"}
    if not all(v.isdigit() for v in env.values()):
        return ""
    return (f" | attempt {env['attempt']} ({env['failures']} of {env['failure_budget']} failures used, "
            f"{env['preemptions']} preemption{'' if env['preemptions'] == '1' else 's'})")


def agree(step_loss: torch.Tensor, stop: StopFlag, compute_s: float, rank: int, world_size: int
          ) -> tuple[float, bool, list[float]]:
    """One small all-reduce per step: the mean loss over ranks, whether any rank got SIGTERM, and every rank's
    own compute time (for the straggler check)."""
    shared = torch.zeros(2 + world_size, device=step_loss.device)
    shared[0], shared[1], shared[2 + rank] = step_loss, float(stop.requested), compute_s
    dist.all_reduce(shared)
    return shared[0].item() / world_size, shared[1].item() > 0, shared[2:].tolist()


def hosts(world_size: int) -> list[str]:
    """Every rank's host name, by rank (the straggler and hang lines name the host)."""
    names = [""] * world_size
    dist.all_gather_object(names, socket.gethostname())
    return names


def utilisation(cfg: TrainConfig, model, half_precision: bool) -> Utilisation:
    n_layer, d_model = model.shape()
    if isinstance(model, PipelineGPT):  # a stage holds part of the model: count the whole one, shapes only
        with torch.device("meta"):
            model = GPT(cfg.model)
    flops = mfu.model_flops_per_token(model, n_layer, d_model, cfg.model.seq_len)
    device = mfu.device_name()
    peak = cfg.peak_tflops or mfu.peak_tflops(device, half_precision)
    if peak:
        logger.info(f"MFU against {peak:g} TFLOP/s per {device} ({'16' if half_precision else '32'}-bit), "
                    f"{flops / 1e6:,.1f} MFLOPs per token")
    else:
        logger.info(f"no MFU: no peak TFLOP/s known for {device} (set peak_tflops)")
    return Utilisation(flops, peak)


def start_engine(cfg: TrainConfig, inputs: Inputs, world_size: int):
    """(engine, model, half precision) of the configured model, and the run's start line."""
    micro, accum, global_batch = inputs.batch
    plan = stage_plan(cfg.model) if cfg.model.pipeline_stages > 1 else []
    if plan:
        model = PipelineGPT(cfg.model, cfg.seed)
        parameters = sum(n for _, n in plan) - cfg.model.vocab_size * cfg.model.d_model  # the tied copy once
    else:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model)
        parameters = count_parameters(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=inputs.ds_config)
    dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    logger.info(
        f"world size {world_size} | ZeRO stage {engine.zero_optimization_stage()} | {dtype} | batch {micro} micro x "
        f"{accum} accumulation x {inputs.layout.describe()} = {global_batch} | {parameters / 1e6:.2f}M "
        f"parameters ({model.describe()}) | {get_accelerator().device_name()} / {torch.distributed.get_backend()} | "
        f"collective timeout {default_pg_timeout.total_seconds() / 60:.0f} min{attempt_summary()}")
    for stage, (layers, count) in enumerate(plan):
        logger.info(f"pipeline stage {stage}: {layers} | {count / 1e6:.2f}M parameters")
    return engine, model, dtype != "fp32"


def train(cfg: TrainConfig, inputs: Inputs, rank: int, world_size: int, stop: StopFlag,
          rendezvous_s: float | None = None) -> int:
    engine, model, half = start_engine(cfg, inputs, world_size)
    global_batch, ckpt_dir = inputs.batch[2], Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    report = RunReport(logger, Run(rank, world_size, cfg.steps, cfg.log_every, global_batch,
                                   global_batch * cfg.model.seq_len, ckpt_dir, hosts(world_size),
                                   utilisation(cfg, model, half), rendezvous_s))
    layout = layout_of(engine, world_size, cfg)
    report.restoring()
    start_step, position = resume(engine, cfg, inputs, rank, layout)
    report.resumed(start_step)
    saver = checkpoint.Checkpointer(engine, ckpt_dir, cfg.checkpoint_every, cfg.keep_checkpoints, layout,
                                    inputs.ds_config, start_step, cfg.checkpoint_background) if ckpt_dir else None
    # A rank's own compute in a step: until its first collective. Not for pipeline stages, which wait for each
    # other's activations from the start of a step.
    clock = FirstCollectiveClock() if cfg.model.pipeline_stages == 1 else None
    status = 0
    for step in range(start_step + 1, cfg.steps + 1):
        report.step_begins()
        if clock:
            clock.start()
        step_loss, position = train_step(engine, inputs, position)
        loss, stopping, compute = agree(step_loss, stop, clock.compute_s() if clock else 0.0, rank, world_size)
        report.step(step, loss, engine.get_lr()[0], compute, stopping, engine)
        if cfg.stop_on_nonfinite_loss and not math.isfinite(loss):  # every rank has the same mean: all stop here
            last = f"; the last checkpoint is step {saver.last_saved}" if saver and saver.last_saved else ""
            raise NonFiniteLoss(f"loss is {loss} at step {step} (the mean over ranks): stopped before saving this "
                                f"state{last} (stop_on_nonfinite_loss: false trains on)")
        saved = saver.save(step, {"step": step, "data_position": position}, last_step=step == cfg.steps,
                           stopping=stopping) if saver else None
        if saved:
            report.saved(step, *saved, stopping)
        elif saver:
            saver.poll()  # a background save: committed once every rank's writes are durable
        for committed in saver.take_committed() if saver else []:
            report.committed(committed)
        if stopping:
            logger.warning(f"SIGTERM: stopped at step {step}" + (f", checkpoint at step {saver.last_saved}"
                                                                  if saver else ""))
            status = EXIT_SIGTERM
            break
    report.end(status)
    return status


def main(argv: list[str] | None = None) -> int:
    stop = StopFlag()  # first: a SIGTERM during start-up must not kill this rank while its peers wait
    rankstate.report("starting")
    rank = int(os.environ.get("RANK", "0"))
    init_logger(rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by DeepSpeed's launcher for every rank
    try:
        check_world_size(world_size)
        check_devices()
        cfg = parse_args(argv)
        inputs = check_inputs(cfg, rank, world_size)
    except (ConfigError, dsconfig.DsConfigError, DataError, checkpoint.CheckpointError) as err:
        logger.error(str(err))
        rankstate.fail("config-error", str(err))
        return protocol.EXIT_CONFIG_ERROR
    # DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes, the chart's deepspeed.collectiveTimeoutMinutes.
    rendezvous = time.perf_counter()
    deepspeed.init_distributed(timeout=default_pg_timeout)
    rendezvous_s = time.perf_counter() - rendezvous  # a fault's loss by its parts (train/goodput.py)
    groups_take_the_timeout(default_pg_timeout)  # ZeRO's own groups too: torch would give them 30 min on gloo
    status = 1
    try:
        if dist.get_world_size() != world_size:
            raise ConfigError(f"WORLD_SIZE {world_size} but the process group has {dist.get_world_size()} ranks")
        status = train(cfg, inputs, dist.get_rank(), world_size, stop, rendezvous_s)
    except NonFiniteLoss as err:
        logger.error(str(err))
        rankstate.fail("loss-nan", str(err))
        status = 1  # retried: a NaN that recurs at the same step after the resume stops the job (the ledger)
    except (ConfigError, dsconfig.DsConfigError, DataError, checkpoint.CheckpointError) as err:
        logger.error(str(err))  # on every rank that hit it: a data or disk problem may be one rank's
        rankstate.fail("storage-error" if isinstance(err, checkpoint.StorageError) else "config-error", str(err),
                       echo=getattr(err, "echo", False))
        status = protocol.EXIT_CONFIG_ERROR
    finally:
        # Leaving without tearing the process group down can abort the process after training.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        release_shm_buffer()
    return status


def exit_cleanly(status: int) -> None:
    """Leaves without C++ static teardown. With gloo's threads still alive, a rank sometimes aborts there
    ("terminate called without an active exception", exit -6) after a finished run, which fails the whole job;
    every program the chart launches should end this way once its results are written."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    rankstate.clear()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# DeepSpeed's CPU shm_comm op names its /dev/shm segment SHM_BUFFER_NAME + "_<uid>_<master addr>_<master port>
# _<rank>" (deepspeed/ops/csrc/cpu/comm/shm.cpp, SHM_BUFFER_NAME).
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"


def release_shm_buffer() -> None:
    """DeepSpeed's CPU shm_comm op never unlinks its /dev/shm segment (~66 MB per rank): in a pod, whose /dev/shm
    is a memory-backed emptyDir with a size limit, every run and retry would leave one behind."""
    name = (f"{SHM_BUFFER_NAME}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass
