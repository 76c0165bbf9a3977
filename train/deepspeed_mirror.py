"""What DeepSpeed does with a ds_config internally, copied here so that train/dsconfig.py can check a config without
building an engine, and the hooks into DeepSpeed's comm layer (FirstCollectiveClock, groups_take_the_timeout). Each
piece names the
DeepSpeed code it mirrors, as of DeepSpeed 0.19.8 (the pin in pyproject.toml): a DeepSpeed upgrade re-reads
this file, and only this file. Our own rules stay in dsconfig.py.
"""

import time

# Top-level keys DeepSpeed reads (deepspeed/runtime/config.py and the section configs it builds).
TOP_LEVEL_KEYS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline",
    "prescale_gradients", "progressive_layer_drop", "quantize_training", "scheduler",
    "seq_parallel_communication_data_type", "sequence_parallel_size", "sparse_attention",
    "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism",
    "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization",
})


# The most hosts DeepSpeed's pdsh runner starts at once (deepspeed/launcher/constants.py PDSH_MAX_FAN_OUT, its
# `pdsh -f`): each host's ssh session lasts the whole run, so the hosts past it would never start their ranks.
PDSH_MAX_FAN_OUT = 1024


# The keys DeepSpeed reads in these sections (deepspeed/runtime/config.py get_optimizer_params/
# get_scheduler_params, 0.19.8): anything beside them, `lr` above `params` say, is silently ignored.
SECTION_KEYS = {"optimizer": {"type", "params", "legacy_fusion"}, "scheduler": {"type", "params"}}
# Schedulers with a total step count, the params that hold it and their warmup (deepspeed/runtime/lr_schedules.py).
SCHEDULE_LENGTH = {"WarmupDecayLR": ("total_num_steps", "warmup_num_steps"),
                   "WarmupCosineLR": ("total_num_steps", "warmup_num_steps")}


def optimizer_target(name: str, params: dict, config: dict):
    """(constructor, parameters DeepSpeed pops or passes itself) for optimizer `name`, or None for a name it does
    not know. Mirrors DeepSpeedEngine._configure_basic_optimizer (deepspeed/runtime/engine.py)."""
    import torch
    from deepspeed.runtime import config as ds

    zero = config.get("zero_optimization", {})
    offload = (zero.get("offload_optimizer") or {}).get("device") if isinstance(zero, dict) else None
    cpu_optimizer = offload in ("cpu", "nvme")
    lower = name.lower()
    if lower in (ds.ADAM_OPTIMIZER, ds.ADAMW_OPTIMIZER):
        popped = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
        if params.get("torch_adam"):
            return torch.optim.AdamW, (*popped, "foreach")
        if cpu_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return DeepSpeedCPUAdam, (*popped, "adamw_mode")
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam, popped
    if lower == ds.ADAGRAD_OPTIMIZER:
        if cpu_optimizer:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
            return DeepSpeedCPUAdagrad, ()
        return torch.optim.Adagrad, ()
    if lower == ds.LAMB_OPTIMIZER:
        from deepspeed.ops.lamb import FusedLamb
        return FusedLamb, ()
    if lower == ds.LION_OPTIMIZER:
        if cpu_optimizer:
            from deepspeed.ops.lion import DeepSpeedCPULion
            return DeepSpeedCPULion, ()
        from deepspeed.ops.lion import FusedLion
        return FusedLion, ()
    if lower in (ds.MUADAM_OPTIMIZER, ds.MUADAMW_OPTIMIZER, ds.MUSGD_OPTIMIZER, ds.MUON_OPTIMIZER):
        return "unchecked", ()  # mup's and Muon's parameter groups: DeepSpeed's own checks apply
    target = getattr(torch.optim, name, None)
    if isinstance(target, type) and issubclass(target, torch.optim.Optimizer):
        return target, ()
    return None, ()


def scheduler_target(name) -> tuple[object, list[str]]:
    """(scheduler class or None, the names DeepSpeed takes) for scheduler `name`. Mirrors
    DeepSpeedEngine._scheduler_from_config (deepspeed/runtime/engine.py): DeepSpeed's own schedules
    (lr_schedules.VALID_LR_SCHEDULES), else torch.optim.lr_scheduler's classes."""
    import torch
    from deepspeed.runtime import lr_schedules

    torch_schedulers = sorted(n for n, c in vars(torch.optim.lr_scheduler).items() if isinstance(c, type)
                              and issubclass(c, torch.optim.lr_scheduler.LRScheduler) and not n.startswith("_")
                              and c is not torch.optim.lr_scheduler.LRScheduler)
    known = list(lr_schedules.VALID_LR_SCHEDULES) + torch_schedulers
    if name in lr_schedules.VALID_LR_SCHEDULES:
        return getattr(lr_schedules, name), known
    if name in torch_schedulers:
        return getattr(torch.optim.lr_scheduler, name), known
    return None, known


# Every collective of DeepSpeed's comm layer goes through its backend object, deepspeed.comm.comm.cdb
# (deepspeed/comm/comm.py: `return cdb.all_reduce(...)` and so on; TorchBackend in deepspeed/comm/torch.py).
COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "broadcast",
               "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "barrier",
               "monitored_barrier")


class FirstCollectiveClock:
    """The time from `start()` to this rank's first DeepSpeed collective after it: the rank's own compute in a step
    (everything after the first collective may be waiting for peers). Wraps the backend's collectives once; the
    cost per call is one comparison."""

    def __init__(self):
        from deepspeed.comm import comm

        self.started = self.first = None
        for name in COLLECTIVES:
            method = getattr(comm.cdb, name, None)
            if method is not None:
                setattr(comm.cdb, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            if self.first is None and self.started is not None:
                self.first = time.perf_counter()
            return method(*args, **kwargs)
        return timed

    def start(self) -> None:
        self.started, self.first = time.perf_counter(), None

    def compute_s(self) -> float:
        """Seconds from start() to the first collective (to now, if none came)."""
        return (self.first or time.perf_counter()) - self.started


def groups_take_the_timeout(timeout) -> None:
    """DeepSpeed makes its own process groups with torch's new_group and no timeout (deepspeed/comm/torch.py
    new_group; ZeRO's data-parallel group is such a clone of the world group, deepspeed/utils/groups.py
    _clone_world_group): torch gives them its default (30 minutes on gloo, 10 on NCCL), not the world group's, so a
    peer that never comes held ZeRO's gradient all-reduce for 30 minutes whatever DEEPSPEED_TIMEOUT said. Every
    group made after this call without a timeout of its own gets `timeout` (the run's collective timeout)."""
    import torch.distributed as dist  # noqa: PLC0415

    original = dist.new_group
    if getattr(original, "takes_the_timeout", False):
        return

    def new_group(ranks=None, timeout=None, *args, **kwargs):
        return original(ranks, timeout if timeout is not None else groups_take_the_timeout.timeout, *args, **kwargs)

    new_group.takes_the_timeout = True
    groups_take_the_timeout.timeout = timeout
    dist.new_group = new_group
