"""Train configuration: dataclasses, a YAML/JSON file (`--config`) and command-line overrides.

Precedence: field defaults < config file < flags. Every field is a flag: top-level fields as
`--checkpoint-dir`, nested ones as `--model.n-layer`. Batch sizes, precision, optimizer and ZeRO live in
the ds_config (`--ds-config`), not here.
"""

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train import yamlfile


class ConfigError(ValueError):
    """A configuration problem, with the file or flag and the key it concerns."""


def doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class ModelConfig:
    n_layer: int = doc("Transformer blocks.", 4)
    n_head: int = doc("Attention heads per block; must divide d_model.", 4)
    d_model: int = doc("Width of the residual stream.", 128)
    vocab_size: int = doc("Vocabulary size; token ids in the data must be below it.", 256)
    seq_len: int = doc("Tokens per sample (context length).", 64)
    dropout: float = doc("Dropout probability.", 0.0)
    hf_config: str = doc("Directory with a Hugging Face config.json: train that causal LM (built from the config, "
                         "nothing downloaded; needs `transformers`) instead of the built-in GPT.", "")
    pipeline_stages: int = doc("Pipeline stages the built-in GPT is split into (DeepSpeed PipelineModule); the world "
                               "size must be a multiple: stages x data-parallel ranks. ZeRO stage 0 or 1.", 1)

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
            _require(getattr(self, name) >= 1, f"model.{name}", "an integer >= 1", getattr(self, name))
        _require(self.d_model % self.n_head == 0, "model.d_model", f"a multiple of model.n_head ({self.n_head})",
                 self.d_model)
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "a probability in [0, 1)", self.dropout)
        _require(self.pipeline_stages >= 1, "model.pipeline_stages", "an integer >= 1", self.pipeline_stages)
        _require(self.pipeline_stages == 1 or not self.hf_config, "model.pipeline_stages",
                 "1 with model.hf_config (pipeline stages are built for the built-in GPT only)", self.pipeline_stages)


@dataclass
class DataConfig:
    path: str = doc("Token file (flat uint16/uint32 .bin, see `python -m train.tokenize`); empty: synthetic.", "")
    dtype: str = doc("Token dtype of the file: uint16 or uint32.", "uint16")
    seed: int = doc("Seed of the sample order (token file) or of the sequences (synthetic).", 1234)

    def __post_init__(self):
        _require(self.dtype in ("uint16", "uint32"), "data.dtype", "uint16 or uint32", self.dtype)


@dataclass
class TrainConfig:
    ds_config: str = doc("DeepSpeed config JSON: batch sizes, precision, optimizer, scheduler, ZeRO.", "")
    checkpoint_dir: str = doc("Checkpoints go here; a run resumes from the last complete one. Empty: none.", "")
    steps: int = doc("Optimizer steps to train for (in total, across resumes).", 100)
    log_every: int = doc("Log one line on rank 0 every this many steps.", 10)
    checkpoint_every: int = doc("Save a checkpoint every this many steps (0: only at the end).", 0)
    keep_checkpoints: int = doc("Complete checkpoints to keep; older ones are deleted.", 3)
    checkpoint_background: bool = doc("Save in the background: the steps wait only while the state is copied into "
                                      "host memory (as much as this rank's part of a checkpoint), a thread writes "
                                      "it, and the checkpoint counts once every rank's copy is durable. false: the "
                                      "steps wait for the write.", True)
    stop_on_nonfinite_loss: bool = doc("End the attempt when the mean loss is NaN or infinite, before any checkpoint "
                                       "of that state is saved (its cause: loss-nan; the same NaN at the same step "
                                       "after the resume stops the job). false: train on.", True)
    seed: int = doc("Seed of the model initialisation.", 0)
    reset_optimizer: bool = doc("On resume, load the model weights, step and data position only: optimizer and "
                                "lr-scheduler state start afresh from the ds_config (to change the optimizer type, the "
                                "precision or optimizer params, which a checkpoint's state would override).", False)
    peak_tflops: float = doc("Peak TFLOP/s of one accelerator in the run's precision, for the MFU in the progress "
                             "line and metrics.json; 0: from train/mfu.py's table of known GPUs (none on CPU).", 0.0)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        _require(bool(self.ds_config), "ds_config", "a path (--ds-config)", self.ds_config)
        for name in ("steps", "log_every", "keep_checkpoints"):
            _require(getattr(self, name) >= 1, name, "an integer >= 1", getattr(self, name))
        _require(self.checkpoint_every >= 0, "checkpoint_every", "an integer >= 0", self.checkpoint_every)
        _require(0 <= self.peak_tflops < 1e6, "peak_tflops", "a number of TFLOP/s >= 0 (0: from the table)",
                 self.peak_tflops)


def _require(ok: bool, key: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {expected}, got {got!r}")


def _flag(prefix: str, name: str) -> str:
    return "--" + prefix + name.replace("_", "-")


def _sections() -> dict[str, type]:
    """'' for TrainConfig's own scalar fields, 'model.' and 'data.' for the nested ones."""
    return {"": TrainConfig, "model.": ModelConfig, "data.": DataConfig}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the argument, on a rank (exit 2) and in the glue alike
        raise ConfigError(f"command line: {message}")


def _boolean(text: str) -> bool:
    """A flag's true or false (argparse's bool() would take any non-empty word, "false" included, as true)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


_boolean.__name__ = "boolean"  # argparse names the type in its one-line error: "invalid boolean value: 'x'"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m train", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", help="YAML or JSON train config file; flags override it.")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # added by deepspeed.launcher
    for prefix, cls in _sections().items():
        group = parser.add_argument_group(prefix.rstrip(".") or "train")
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type):
                continue
            group.add_argument(_flag(prefix, f.name), dest=prefix + f.name, default=None,
                               type=_boolean if f.type is bool else f.type,
                               help=f"{f.metadata['help']} (default: {f.default!r})")
    return parser


def from_mapping(values: dict, source: str) -> TrainConfig:
    values = dict(values)
    nested = {}
    for prefix, cls in _sections().items():
        if not prefix:
            continue
        section = prefix.rstrip(".")
        sub = values.pop(section, None) or {}
        if not isinstance(sub, dict):
            raise ConfigError(f"{source}: {section} must be a mapping, got {type(sub).__name__}")
        nested[section] = _construct(cls, sub, source, prefix)
    return _construct(TrainConfig, values, source, "", **nested)


# Keys that moved out of the train config, and where they are now.
MOVED_KEYS = {"dist_timeout_s": "the chart value deepspeed.collectiveTimeoutMinutes (DEEPSPEED_TIMEOUT, minutes), "
                                "one collective timeout for every program"}


def _construct(cls: type, values: dict, source: str, prefix: str, **extra):
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if not prefix and key in MOVED_KEYS:
            raise ConfigError(f"{source}: {key} is no longer a train config key: it is {MOVED_KEYS[key]}")
        if key not in known or dataclasses.is_dataclass(known[key].type):
            raise ConfigError(f"{source}: unknown key {prefix}{key!r}; known: {', '.join(sorted(known))}")
        expected = known[key].type
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            if not (expected is float and isinstance(value, int) and not isinstance(value, bool)):
                raise ConfigError(f"{source}: {prefix}{key} must be {expected.__name__}, got {value!r}")
    try:
        return cls(**values, **extra)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def parse_args(argv: list[str] | None = None, values: dict | None = None, source: str = "command line"
               ) -> TrainConfig:
    """The config of `python -m train ARGV`: the --config file (or `values`, its contents, where the caller has
    them: the glue), then the flags over it."""
    args = vars(build_parser().parse_args(argv))
    values = dict(values or {})
    config_path = args.pop("config")
    args.pop("local_rank")
    if config_path:
        try:
            values = yamlfile.load_mapping(Path(config_path), f"--config {config_path}")
        except yamlfile.YamlFileError as err:
            raise ConfigError(str(err)) from None
        source = config_path
    for dest, value in args.items():
        if value is None:
            continue
        section, _, name = dest.rpartition(".")
        target = values.setdefault(section, {}) if section else values
        if not isinstance(target, dict):
            raise ConfigError(f"{source}: {section} must be a mapping, got {type(target).__name__}")
        target[name] = value
    return from_mapping(values, source)
