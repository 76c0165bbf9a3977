"""Checks of a ds_config before DeepSpeed sees it, shared by the train package and scripts/deployctl.py.

DeepSpeed rejects unknown keys inside its sections but silently ignores unknown TOP-LEVEL keys, so a typo
such as `trian_batch_size` or `optimzer` trains with defaults. `validate` refuses those, checks the batch
arithmetic against the world size, then runs DeepSpeed's own parser. Every error names the source and key.
"""

import copy
import difflib
import json
from pathlib import Path

# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the section configs it builds).
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


class DsConfigError(ValueError):
    """A ds_config problem; the message names the file and key."""


def load(path: str | Path) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise DsConfigError(f"ds_config {path}: cannot read: {err.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise DsConfigError(f"ds_config {path}: not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise DsConfigError(f"ds_config {path}: expected a JSON object at the top level")
    return config


def batch_sizes(config: dict, world_size: int, source: str) -> tuple[int, int, int]:
    """(micro batch per GPU, gradient accumulation, global batch), completed as DeepSpeed does."""
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    micro, accum, total = (config.get(name) for name in names)
    for name, value in zip(names, (micro, accum, total), strict=True):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DsConfigError(f"ds_config {source}: {name} must be an integer >= 1, got {value!r}")
    if total is None and micro is None:
        raise DsConfigError(f"ds_config {source}: set train_micro_batch_size_per_gpu or train_batch_size")
    accum_given = accum is not None
    if total is None:
        accum = accum or 1
        total = micro * accum * world_size
    elif micro is None:
        accum = accum or 1
        micro, rest = divmod(total, accum * world_size)
        if rest or micro == 0:
            raise DsConfigError(
                f"ds_config {source}: train_batch_size {total} is not divisible by gradient_accumulation_steps "
                f"{accum} x world size {world_size}")
    elif not accum_given:
        accum, rest = divmod(total, micro * world_size)
        if rest or accum == 0:
            raise DsConfigError(
                f"ds_config {source}: train_batch_size {total} is not divisible by train_micro_batch_size_per_gpu "
                f"{micro} x world size {world_size}")
    if micro * accum * world_size != total:
        raise DsConfigError(
            f"ds_config {source}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x world size {world_size} (= {micro * accum * world_size})")
    return micro, accum, total


def validate(config: dict, world_size: int, source: str) -> tuple[int, int, int]:
    """Checks `config` for `world_size` ranks; returns batch_sizes(). Raises DsConfigError."""
    unknown = sorted(set(config) - TOP_LEVEL_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, TOP_LEVEL_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise DsConfigError(
            f"ds_config {source}: unknown top-level key {', '.join(hints)}; DeepSpeed would silently ignore it")
    sizes = batch_sizes(config, world_size, source)
    _deepspeed_parse(config, sizes, source)
    return sizes


def _deepspeed_parse(config: dict, sizes: tuple[int, int, int], source: str) -> None:
    """DeepSpeed's own parser (it validates every section). Outside a process group it assumes world size
    1, so it gets the micro batch and accumulation and derives the global batch itself; the arithmetic for
    the real world size is batch_sizes()'s."""
    from deepspeed.runtime.config import DeepSpeedConfig

    trial = copy.deepcopy(config)
    trial.pop("train_batch_size", None)
    trial["train_micro_batch_size_per_gpu"], trial["gradient_accumulation_steps"] = sizes[0], sizes[1]
    try:
        DeepSpeedConfig(trial)
    except Exception as err:  # DeepSpeed raises pydantic's ValidationError, AssertionError, ValueError...
        if hasattr(err, "errors") and hasattr(err, "title"):  # pydantic: name the section's model and field
            detail = "; ".join(f"{err.title}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        else:
            detail = " ".join(str(err).split())
        raise DsConfigError(f"ds_config {source}: DeepSpeed rejects it: {type(err).__name__}: {detail}") from None
