"""Checks of a ds_config before DeepSpeed sees it: the one module the glue (scripts/deployctl), every rank
at start-up (train/main.py) and the chart's config check hook (train/preflight.py) apply.

DeepSpeed rejects unknown keys inside its sections, but silently ignores unknown TOP-LEVEL keys and `"auto"`,
and many mistakes pass its parser only to crash every rank inside `deepspeed.initialize` (an optimizer name
or parameter its constructor does not take, `steps_per_print: 0`, NVMe offload without a path, a monitor whose
package is missing) or to end every rank with exit 0 (the comms logger on object collectives). `validate`
refuses all of these before anything starts, each error naming the source and the key.

Our rules live here; what copies DeepSpeed's own behaviour (the keys it reads, how it picks an optimizer or a
scheduler class) is train/deepspeed_mirror.py, which names the DeepSpeed code and version it mirrors.
"""

import copy
import difflib
import importlib.util
import inspect
import json
import math
import re
from pathlib import Path

from train import deepspeed_mirror as mirror
from train import yamlfile
from train.layout import Layout


class DsConfigError(ValueError):
    """A ds_config problem; the message names the file and key."""


AUTO = "auto"  # Hugging Face Trainer and Accelerate fill these in; DeepSpeed alone drops them silently.

# Sections DeepSpeed reads as objects: a scalar there crashes its parser with a TypeError.
OBJECT_SECTIONS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "compile", "compression_training", "csv_monitor", "curriculum_learning", "data_efficiency",
    "data_types", "eigenvalue", "elasticity", "flops_profiler", "fp16", "hybrid_engine", "nebula", "optimizer",
    "pipeline", "progressive_layer_drop", "quantize_training", "scheduler", "sparse_attention", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "wandb", "weight_quantization", "zero_optimization",
})

# Monitor sections and the package each needs in the image when enabled (deepspeed/monitor/*.py).
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def load(path: str | Path) -> dict:
    """The ds_config file as DeepSpeed's loader reads it, but stricter: duplicate keys (DeepSpeed refuses
    them; json.loads keeps the last), NaN/Infinity and non-UTF-8 bytes are errors naming the file."""
    try:
        text = yamlfile.read_text(Path(path))
    except ValueError as err:
        raise DsConfigError(f"ds_config {path}: {err}; expected a JSON file") from None

    def no_duplicates(pairs):
        keys = [key for key, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise DsConfigError(f"ds_config {path}: key {key!r} appears twice in one object")
        return dict(pairs)

    try:  # NaN and Infinity load as floats, so that _check_numbers below names the key that holds one
        config = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=float)
    except json.JSONDecodeError as err:
        raise DsConfigError(f"ds_config {path}: not valid JSON: {err}") from None
    except RecursionError:
        raise DsConfigError(f"ds_config {path}: nested too deeply") from None
    if not isinstance(config, dict):
        raise DsConfigError(f"ds_config {path}: expected a JSON object at the top level")
    _check_numbers(config, str(path))
    return config


def auto_keys(config, path: str = "") -> list[str]:
    """Dotted paths of the `"auto"` values in `config`."""
    if isinstance(config, dict):
        return [key for k, v in config.items() for key in auto_keys(v, f"{path}.{k}" if path else str(k))]
    if isinstance(config, list):
        return [key for i, v in enumerate(config) for key in auto_keys(v, f"{path}[{i}]")]
    return [path] if config == AUTO else []


def _check_numbers(config, source: str, path: str = "") -> None:
    if isinstance(config, dict):
        for key, value in config.items():
            _check_numbers(value, source, f"{path}.{key}" if path else str(key))
    elif isinstance(config, list):
        for i, value in enumerate(config):
            _check_numbers(value, source, f"{path}[{i}]")
    elif isinstance(config, float) and not math.isfinite(config):
        raise DsConfigError(f"ds_config {source}: {path} is {config}; use a finite number")


def _check_switches(config, source: str, path: str = "") -> None:
    """Every `enabled` is a boolean: DeepSpeed reads some sections' switch as Python truth (bf16, fp16: the string
    "false" turns them on) and coerces others, so a quoted value would train otherwise than it reads."""
    if isinstance(config, dict):
        for key, value in config.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "enabled" and not isinstance(value, bool) and value != AUTO:
                raise DsConfigError(f"ds_config {source}: {where} is {value!r}; expected true or false")
            _check_switches(value, source, where)
    elif isinstance(config, list):
        for i, value in enumerate(config):
            _check_switches(value, source, f"{path}[{i}]")


def batch_sizes(config: dict, layout: Layout, source: str) -> tuple[int | None, int | None, int | None]:
    """(micro batch per GPU, gradient accumulation, global batch), completed as DeepSpeed does over the layout's
    data-parallel ranks. A value the program fills in (`"auto"`) stays None, and only the arithmetic between
    given numbers is checked."""
    ranks, ranks_text = layout.data_parallel, layout.describe()
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    values = [config.get(name) for name in names]
    for name, value in zip(names, values, strict=True):
        if value is not None and value != AUTO and (not isinstance(value, int) or isinstance(value, bool)
                                                     or value < 1):
            raise DsConfigError(f"ds_config {source}: {name} must be an integer >= 1, got {value!r}")
    if AUTO in values:
        micro, accum, total = (None if v == AUTO else v for v in values)
        if None not in (micro, accum, total) or total is None or (micro is None and accum is None):
            return micro, accum, total  # nothing to check, or checked below with all three
        known = micro if micro is not None else accum
        if total % (known * ranks):
            raise DsConfigError(
                f"ds_config {source}: train_batch_size {total} is not divisible by "
                f"{names[0] if micro is not None else names[1]} {known} x {ranks_text}")
        return micro, accum, total
    micro, accum, total = values
    if total is None and micro is None:
        raise DsConfigError(f"ds_config {source}: set train_micro_batch_size_per_gpu or train_batch_size")
    accum_given = accum is not None
    if total is None:
        accum = accum or 1
        total = micro * accum * ranks
    elif micro is None:
        accum = accum or 1
        micro, rest = divmod(total, accum * ranks)
        if rest or micro == 0:
            raise DsConfigError(
                f"ds_config {source}: train_batch_size {total} is not divisible by gradient_accumulation_steps "
                f"{accum} x {ranks_text}")
    elif not accum_given:
        accum, rest = divmod(total, micro * ranks)
        if rest or accum == 0:
            raise DsConfigError(
                f"ds_config {source}: train_batch_size {total} is not divisible by train_micro_batch_size_per_gpu "
                f"{micro} x {ranks_text}")
    if micro * accum * ranks != total:
        raise DsConfigError(
            f"ds_config {source}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x {ranks_text} (= {micro * accum * ranks})")
    return micro, accum, total


def validate(config: dict, layout: Layout, source: str, *, fills_auto: bool = False
             ) -> tuple[int | None, int | None, int | None]:
    """Checks `config` for the ranks of `layout`; returns batch_sizes(). `fills_auto`: the program fills the
    `"auto"` values (Hugging Face Trainer, Accelerate); otherwise they are refused. Raises DsConfigError."""
    unknown = sorted(set(config) - mirror.TOP_LEVEL_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, mirror.TOP_LEVEL_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise DsConfigError(
            f"ds_config {source}: unknown top-level key {', '.join(hints)}; DeepSpeed would silently ignore it")
    _check_numbers(config, source)
    autos = auto_keys(config)
    if autos and not fills_auto:
        raise DsConfigError(
            f"ds_config {source}: {', '.join(autos)} is \"auto\", which only programs such as the Hugging Face "
            "Trainer fill in (DeepSpeed drops it silently): give a value, or declare that the program fills it "
            "(chart value train.fillsDsConfigAuto)")
    _check_switches(config, source)
    for key in sorted(OBJECT_SECTIONS & set(config)):
        if not isinstance(config[key], dict):
            raise DsConfigError(f"ds_config {source}: {key} must be an object, got {config[key]!r}")
    sizes = batch_sizes(config, layout, source)
    _deepspeed_parse(config, sizes, source)  # first: the sections' own types, as DeepSpeed reads them
    _check_runtime_settings(config, layout.world_size, source)
    _check_silently_ignored(config, source)
    _check_optimizer(config, source)
    _check_scheduler(config, source)
    return sizes


def check_run(config: dict, layout: Layout, source: str, *, steps: int | None = None, fills_auto: bool = False
              ) -> tuple[int | None, int | None, int | None]:
    """Everything a ds_config is checked for before a run, short of a rank's own hardware: validate() for the
    layout's ranks, what its pipeline stages cannot run, and, where the run's step count is known (the train
    package's `steps`), the schedule against it. The glue, the chart's config check and every rank call this."""
    batch = validate(config, layout, source, fills_auto=fills_auto)
    check_pipeline(config, layout.pipeline_stages, source)
    if steps is not None:
        check_schedule_length(config, steps, source)
    return batch


def check_pipeline(config: dict, stages: int, source: str) -> None:
    """What pipeline parallelism (model.pipeline_stages > 1) cannot run: ZeRO 2 and 3 (DeepSpeed asserts in
    PipelineEngine after the optimizer is built), and ZeRO 0 with gradient clipping, which DeepSpeed computes
    from stage 0's gradients only (runtime/utils.clip_grad_norm_ takes the stage for a tensor-parallel rank)."""
    if stages == 1:
        return
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1):
        raise DsConfigError(f"ds_config {source}: zero_optimization.stage {stage}: pipeline parallelism "
                            f"(model.pipeline_stages {stages}) supports ZeRO stage 0 and 1 only")
    if stage == 0 and config.get("gradient_clipping"):
        raise DsConfigError(f"ds_config {source}: gradient_clipping with ZeRO stage 0 and model.pipeline_stages "
                            f"{stages}: DeepSpeed clips by the gradient norm of the first stage only; use "
                            "zero_optimization.stage 1 (it computes the norm over every stage)")


def precision(config: dict) -> str:
    for name in ("bf16", "bfloat16", "fp16"):
        if isinstance(config.get(name), dict) and config[name].get("enabled") is True:
            return "fp16" if name == "fp16" else "bf16"
    return "fp32"


def _leaves(config, path: str = "") -> dict:
    if isinstance(config, dict) and config:
        return {k: v for key, value in config.items() for k, v in _leaves(value, f"{path}{key}.").items()}
    return {path.rstrip("."): config}


def resume_changes(saved: dict | None, current: dict, reset_optimizer: bool, source: str
                   ) -> tuple[list[str], list[str]]:
    """What changed in the ds_config since the checkpoint was written: (takes effect, kept from the checkpoint),
    as "key: old -> new". DeepSpeed restores the optimizer's state, hyperparameters included, so optimizer.params
    changes do not take effect unless the optimizer is reset; a change of optimizer type or precision cannot
    take effect from a checkpoint at all and is refused (DsConfigError naming the key) unless it is."""
    if saved is None:  # a checkpoint from before the manifest recorded its ds_config
        return [], []
    refused = {"optimizer.type": (str((saved.get("optimizer") or {}).get("type", "")).lower(),
                                  str((current.get("optimizer") or {}).get("type", "")).lower()),
               "precision (fp16/bf16.enabled)": (precision(saved), precision(current))}
    for key, (old, new) in refused.items():
        if old != new and not reset_optimizer:
            raise DsConfigError(
                f"ds_config {source}: {key} changed since the checkpoint ({old or 'none'} -> {new or 'none'}): the "
                "checkpoint's optimizer state belongs to the old setting, so this cannot take effect on resume. "
                "Set the train config's reset_optimizer: true to resume the weights with a fresh optimizer, or "
                "change it back")
    old, new = _leaves(saved), _leaves(current)
    skip = re.compile(r"^(optimizer\.type|(fp16|bf16|bfloat16)\.enabled)$")
    effect, kept = [], []
    for key in sorted(old.keys() | new.keys()):
        if skip.match(key) or old.get(key, "(unset)") == new.get(key, "(unset)"):
            continue
        change = f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
        (kept if key.startswith("optimizer.params.") and not reset_optimizer else effect).append(change)
    return effect, kept


def check_optimizer_kernel(config: dict, device_name: str, source: str) -> None:
    """Fused optimizers without a kernel for the ranks' device kind (DeepSpeed's, not the hardware's: the same
    answer on any machine, so the glue checks it too)."""
    optimizer = (config.get("optimizer") or {}).get("type", "")
    zero = config.get("zero_optimization") or {}
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if device_name == "cpu" and str(optimizer).lower() in ("lamb", "lion") and not offloaded:
        raise DsConfigError(f"ds_config {source}: optimizer.type {optimizer}: DeepSpeed's fused {optimizer} has no "
                            "CPU implementation; on CPU ranks use Adam/AdamW with torch_adam, or offload the "
                            "optimizer (zero_optimization.offload_optimizer.device cpu)")


# Half precisions DeepSpeed's CPU accelerator runs only on some CPUs (fp16: avx512_fp16, asked of the CPU itself).
CPU_DEPENDENT_PRECISIONS = ("fp16",)


def check_precision(config: dict, accelerator, source: str) -> None:
    """What this rank's accelerator cannot run: fp16/bf16 its hardware lacks (DeepSpeed's CPU accelerator runs fp16
    only where the CPU has avx512_fp16) and fused optimizers without a kernel for it. Run on the rank itself,
    which alone knows its hardware; refused before every rank would fail in deepspeed.initialize."""
    check_optimizer_kernel(config, accelerator.device_name(), source)
    for section, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if config.get(section, {}).get("enabled") is True and not supported():
            raise DsConfigError(f"ds_config {source}: {section}.enabled: the {accelerator.device_name()} accelerator "
                                f"of these ranks does not support {section}; turn it off or use GPU workers")


def _check_silently_ignored(config: dict, source: str) -> None:
    """Settings DeepSpeed accepts and then ignores or applies otherwise, so a run trains something else than its
    config says."""
    for section, known in mirror.SECTION_KEYS.items():
        extra = sorted(set(config.get(section) or {}) - known) if isinstance(config.get(section), dict) else []
        if extra:
            raise DsConfigError(f"ds_config {source}: {section}.{extra[0]}: DeepSpeed reads only "
                                f"{', '.join(sorted(known))} in {section} and ignores the rest; put it in "
                                f"{section}.params")
    if "bf16" in config and "bfloat16" in config:
        raise DsConfigError(f"ds_config {source}: bf16 and bfloat16 are one section under two names, and DeepSpeed "
                            "reads only one of them; keep bf16")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(zero, dict) and (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        raise DsConfigError(f"ds_config {source}: zero_optimization.offload_param: parameters are offloaded with ZeRO "
                            f"stage 3 only; with stage {stage} DeepSpeed ignores it (use offload_optimizer)")
    total, warmup = _schedule_length(config)
    if total is not None and warmup is not None and warmup > total:
        raise DsConfigError(f"ds_config {source}: scheduler.params.warmup_num_steps {warmup} is longer than "
                            f"total_num_steps {total}: the learning rate would never reach its peak")


def _schedule_length(config: dict) -> tuple[int | None, int | None]:
    """(total steps, warmup steps) of a scheduler that has its own length (mirror.SCHEDULE_LENGTH), each None
    unless given as an integer."""
    scheduler = config.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    keys = mirror.SCHEDULE_LENGTH.get(scheduler.get("type")) if isinstance(params, dict) else None
    numbers = [params.get(key) for key in keys] if keys else [None, None]
    return tuple(n if isinstance(n, int) and not isinstance(n, bool) else None for n in numbers)


def check_schedule_length(config: dict, steps: int, source: str) -> None:
    """A scheduler with its own total step count must end with the run (the train package's `steps`): one that
    decays over another count trains with another schedule than the config says. A warmup longer than the run
    never reaches the learning rate the config names."""
    total, _ = _schedule_length(config)
    if total is not None and total != steps:
        raise DsConfigError(f"ds_config {source}: scheduler.params.total_num_steps {total}, but the run trains "
                            f"{steps} steps (steps in the train config or --steps): make them equal")
    scheduler = config.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    warmup = params.get("warmup_num_steps") if isinstance(params, dict) else None
    if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup > steps:
        raise DsConfigError(f"ds_config {source}: scheduler.params.warmup_num_steps {warmup} is longer than the run's "
                            f"{steps} steps (steps in the train config or --steps): the learning rate would never "
                            "reach its peak")


def _check_runtime_settings(config: dict, world_size: int, source: str) -> None:
    """Settings DeepSpeed's parser accepts that then fail or misbehave on every rank."""
    tp_size = config.get("tensor_parallel", {}).get("autotp_size")
    if isinstance(tp_size, int) and tp_size > 1 and world_size % tp_size:
        raise DsConfigError(f"ds_config {source}: tensor_parallel.autotp_size {tp_size} does not divide world size "
                            f"{world_size}")
    steps_per_print = config.get("steps_per_print")
    if steps_per_print is not None and (not isinstance(steps_per_print, int) or isinstance(steps_per_print, bool)
                                        or steps_per_print < 1):
        raise DsConfigError(f"ds_config {source}: steps_per_print must be an integer >= 1 (DeepSpeed takes the step "
                            f"modulo it), got {steps_per_print!r}")
    if "comms_logger" in config:  # any comms_logger section turns it on, even {"enabled": false}
        raise DsConfigError(
            f"ds_config {source}: comms_logger: DeepSpeed's comms logger ends every rank with exit(0) at the first "
            "object collective (all_gather_object), so a run would report success without finishing, and any "
            "comms_logger section turns it on (even enabled: false); remove the section (use flops_profiler or "
            "wall_clock_breakdown to profile)")
    zero = config.get("zero_optimization", {})
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) if isinstance(zero, dict) else None
        if isinstance(offload, dict) and offload.get("device") == "nvme" and not offload.get("nvme_path"):
            raise DsConfigError(f"ds_config {source}: zero_optimization.{section}.device is nvme but "
                                f"zero_optimization.{section}.nvme_path is not set: give the NVMe mount's path")
    for section, package in MONITOR_PACKAGES.items():
        if config.get(section, {}).get("enabled") and importlib.util.find_spec(package) is None:
            raise DsConfigError(f"ds_config {source}: {section}.enabled needs the Python package {package!r}, "
                                "which this environment lacks: use an image that has it (make image-hf) or "
                                "turn the section off (csv_monitor needs nothing)")


def _bind(params: dict, target, owner: str, key_path: str, source: str, *, passed=(), required=True) -> None:
    """Checks `params` against `target`'s constructor: every key is a parameter it takes (`passed` are set
    by DeepSpeed itself), required ones are present, and numbers, flags and tuples have their default's type."""
    signature = inspect.signature(target)
    taken = [p for p in list(signature.parameters.values())[1:]  # the params/optimizer argument
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in passed]
    if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # takes anything
    by_name = {p.name: p for p in taken}
    for key, value in params.items():
        if key not in by_name:
            close = difflib.get_close_matches(key, by_name, n=1)
            raise DsConfigError(
                f"ds_config {source}: {key_path}.{key}: {owner} takes no parameter {key!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "") + f"; it takes {', '.join(by_name)}")
        if value == AUTO:
            continue
        default, annotation = by_name[key].default, by_name[key].annotation
        if default is not inspect.Parameter.empty and default is not None:
            kind = type(default)
        else:  # no default: a plain annotation, if any, says the type
            kind = annotation if annotation in (bool, int, float, str) else None
        ok = True
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind in (int, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is tuple:
            ok = (isinstance(value, list) and len(value) == len(default)
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))
        elif kind is str:
            ok = isinstance(value, str)
        if not ok:
            expected = {bool: "true or false", int: "a number", float: "a number", str: "a string",
                        tuple: f"a list of {len(default) if kind is tuple else 0} numbers"}[kind]
            raise DsConfigError(f"ds_config {source}: {key_path}.{key} must be {expected} ({owner}), got {value!r}")
    if required:
        missing = [p.name for p in taken if p.default is inspect.Parameter.empty and p.name not in params]
        if missing:
            raise DsConfigError(f"ds_config {source}: {key_path} needs {', '.join(missing)} ({owner})")


def _check_optimizer(config: dict, source: str) -> None:
    optimizer = config.get("optimizer")
    if optimizer is None:
        return
    name, params = optimizer.get("type"), optimizer.get("params", {})
    if not isinstance(name, str) or not name:
        raise DsConfigError(f"ds_config {source}: optimizer.type must be an optimizer name, got {name!r}")
    if not isinstance(params, dict):
        raise DsConfigError(f"ds_config {source}: optimizer.params must be an object, got {params!r}")
    if "max_grad_norm" in params:
        raise DsConfigError(f"ds_config {source}: optimizer.params.max_grad_norm: DeepSpeed refuses it; use the "
                            "top-level gradient_clipping")
    if name == "LBFGS":
        raise DsConfigError(f"ds_config {source}: optimizer.type LBFGS needs a closure at every step, which "
                            "DeepSpeed's engine.step() never passes")
    target, passed = mirror.optimizer_target(name, params, config)
    if target is None:
        import torch
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
        known = sorted(DEEPSPEED_OPTIMIZERS) + sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type)
                                                        and issubclass(c, torch.optim.Optimizer)
                                                        and c is not torch.optim.Optimizer)
        close = [k for k in known if k.lower() == name.lower()] or difflib.get_close_matches(name, known, n=1)
        raise DsConfigError(f"ds_config {source}: optimizer.type {name!r} is neither a DeepSpeed optimizer nor a "
                            f"torch.optim class" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + f"; known: {', '.join(known)}")
    if target == "unchecked":
        if importlib.util.find_spec("mup") is None and name.lower().startswith("mu") and name.lower() != "muon":
            raise DsConfigError(f"ds_config {source}: optimizer.type {name!r} needs the Python package 'mup', "
                                "which this environment lacks")
        return
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, int) and stage > 0 and not config.get("zero_allow_untested_optimizer"):
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
        if target not in ZERO_SUPPORTED_OPTIMIZERS:
            raise DsConfigError(f"ds_config {source}: optimizer.type {name!r} ({target.__name__}) is not one DeepSpeed "
                                f"tests with ZeRO stage {stage}: set zero_allow_untested_optimizer: true to use it")
    if name.lower() == "lamb" and config.get("fp16", {}).get("loss_scale", 0) != 0:
        raise DsConfigError(f"ds_config {source}: optimizer lamb needs dynamic loss scaling: fp16.loss_scale 0")
    if params.get("amsgrad") is True and target.__module__.startswith("deepspeed."):
        raise DsConfigError(f"ds_config {source}: optimizer.params.amsgrad: {target.__name__} does not support it")
    for flag in ("torch_adam", "adam_w_mode", "fp32_optimizer_states"):
        if flag in params and params[flag] != AUTO and not isinstance(params[flag], bool):
            raise DsConfigError(f"ds_config {source}: optimizer.params.{flag} must be true or false, "
                                f"got {params[flag]!r}")
    own = {k: v for k, v in params.items() if k not in passed}
    _bind(own, target, f"optimizer {name} -> {target.__module__}.{target.__name__}", "optimizer.params", source,
          passed=passed, required=False)
    if not auto_keys(own):
        _probe_optimizer(target, own, name, source)


def _probe_optimizer(target, params: dict, name: str, source: str) -> None:
    """The value checks a constructor makes (lr >= 0, betas in [0, 1), ...), on a stand-in parameter: torch's
    own class, or for DeepSpeed's fused and CPU optimizers (whose construction builds ops) torch's AdamW with
    the settings they share."""
    import torch
    if not target.__module__.startswith("torch."):
        target, params = torch.optim.AdamW, {k: v for k, v in params.items()
                                             if k in ("lr", "betas", "eps", "weight_decay")}
    try:
        target([torch.nn.Parameter(torch.zeros(1))], **params)
    except Exception as err:
        raise DsConfigError(f"ds_config {source}: optimizer {name} refuses optimizer.params: "
                            f"{type(err).__name__}: {' '.join(str(err).split())}") from None


def _check_scheduler(config: dict, source: str) -> None:
    scheduler = config.get("scheduler")
    if scheduler is None:
        return
    name, params = scheduler.get("type"), scheduler.get("params", {})
    if not isinstance(params, dict):
        raise DsConfigError(f"ds_config {source}: scheduler.params must be an object, got {params!r}")
    target, known = mirror.scheduler_target(name)
    if target is None:
        close = difflib.get_close_matches(str(name), known, n=1)
        raise DsConfigError(f"ds_config {source}: scheduler.type {name!r} is neither a DeepSpeed nor a torch "
                            "scheduler" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + f"; known: {', '.join(known)}")
    if "params" not in scheduler:
        raise DsConfigError(f"ds_config {source}: scheduler.params is missing; DeepSpeed calls the scheduler with it "
                            "(use {} for the defaults)")
    _bind(params, target, f"scheduler {name}", "scheduler.params", source)
    if not auto_keys(params):  # the constructor's own checks (warmup_num_steps > 0, ...), on a stand-in optimizer
        import logging

        quiet = logging.getLogger("DeepSpeed")
        level, quiet.level = quiet.level, logging.ERROR  # its schedulers warn when asked for an lr before a step
        try:
            target(_stand_in_optimizer(config), **params)
        except Exception as err:
            raise DsConfigError(f"ds_config {source}: scheduler {name} refuses scheduler.params: "
                                f"{type(err).__name__}: {' '.join(str(err).split())}") from None
        finally:
            quiet.level = level


def _stand_in_optimizer(config: dict):
    """A small optimizer like the configured one, for a scheduler to be tried on (OneCycleLR needs momentum or
    betas): torch's own class where the config names one, else torch's AdamW (DeepSpeed's Adam family)."""
    import torch
    optimizer = config.get("optimizer") or {}
    name, params = optimizer.get("type", ""), dict(optimizer.get("params") or {})
    target, passed = mirror.optimizer_target(name, params, config) if name else (None, ())
    parameter = [torch.nn.Parameter(torch.zeros(1))]
    if isinstance(target, type) and target.__module__.startswith("torch.") and not auto_keys(params):
        try:
            return target(parameter, **{k: v for k, v in params.items() if k not in passed})
        except Exception:
            pass  # refused by _check_optimizer already
    return torch.optim.AdamW(parameter, lr=1.0)


def _deepspeed_parse(config: dict, sizes: tuple, source: str) -> None:
    """DeepSpeed's own parser (it validates every section). Outside a process group it assumes world size
    1, so it gets the micro batch and accumulation and derives the global batch itself; the arithmetic for
    the real world size is batch_sizes()'s. Keys the program fills in ("auto") are left out."""
    from deepspeed.runtime.config import DeepSpeedConfig

    trial = _without_auto(copy.deepcopy(config))
    trial.pop("train_batch_size", None)
    trial["train_micro_batch_size_per_gpu"], trial["gradient_accumulation_steps"] = sizes[0] or 1, sizes[1] or 1
    try:
        DeepSpeedConfig(trial)
    except Exception as err:  # DeepSpeed raises pydantic's ValidationError, AssertionError, ValueError...
        if hasattr(err, "errors") and hasattr(err, "title"):  # pydantic: name the section's model and field
            detail = "; ".join(f"{err.title}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        else:
            detail = " ".join(str(err).split())
        raise DsConfigError(f"ds_config {source}: DeepSpeed rejects it: {type(err).__name__}: {detail}") from None


def _without_auto(config):
    if isinstance(config, dict):
        return {k: _without_auto(v) for k, v in config.items() if v != AUTO}
    if isinstance(config, list):
        return [_without_auto(v) for v in config if v != AUTO]
    return config
