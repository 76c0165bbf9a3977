"""How the chart hands its paths to a program: the one owner of each `train.argsConvention`.

Each convention lists the options the chart passes (after the program's own `train.args`, so that argparse's
last-occurrence rule keeps the chart's value whatever spelling the tenant used) and the settings of the program's
parser that the chart owns. `scripts/chart_data.py` writes both into `charts/deepspeed-training/files/generated/
conventions.json`: the chart builds the options from it (`deepspeed-training.conventionArgs`) and refuses in
`train.args` every spelling the parser takes for an owned setting, abbreviations included
(`deepspeed-training.validateProgram`).

The spellings come from the parsers themselves: this package's (train/config.py), a Hugging Face Trainer's
(`HfArgumentParser(TrainingArguments)`: `--output_dir` and `--output-dir`, ...), and `deepspeed.add_config_arguments`
for argparse DeepSpeed programs. DeepSpeed's launcher passes `--local_rank=N` to every program (before its
arguments): a later `--local_rank` would put the rank on another device, so it is owned in every convention.
"""

import argparse

# The value each passed option takes, by name: the chart's paths (deepspeed-training.programPaths), the
# collective timeout in seconds (deepspeed.collectiveTimeoutMinutes x 60), and whether each worker keeps its
# checkpoints on its own volume ("true"/"false": train/checkpoint.py storage_for).
VALUES = ("ds_config", "train_config", "checkpoint_dir", "collective_timeout_s", "per_worker_storage")

# convention -> [(option, value name or None for a flag, "=" to join them in one argument or " " for two)]
PASSES: dict[str, list[tuple[str, str | None, str | None]]] = {
    "train": [("--ds-config", "ds_config", "="), ("--config", "train_config", "="),
              ("--checkpoint-dir", "checkpoint_dir", "=")],
    # A Trainer otherwise sets its own 30-minute collective timeout (ddp_timeout), which no env reaches. It saves
    # its own files (state, weights, rng) from each node's main process on per-worker volumes, and from the job's
    # main process only on a shared one (each node would write the same names there).
    "huggingface": [("--deepspeed", "ds_config", " "), ("--output_dir", "checkpoint_dir", " "),
                    ("--ddp_timeout", "collective_timeout_s", " "),
                    ("--save_on_each_node", "per_worker_storage", " ")],
    "deepspeed": [("--deepspeed", None, None), ("--deepspeed_config", "ds_config", " ")],
    "none": [],
}

# Parser settings the chart owns beyond the ones it passes: deepspeed.initialize() takes `deepscale_config` as the
# ds_config (deepspeed/__init__.py, "Check for deepscale_config for backwards compat"; with both given it fails),
# and the launcher's `local_rank`.
ALSO_OWNED = {"train": ["local_rank"], "huggingface": ["local_rank"],
              "deepspeed": ["deepscale", "deepscale_config", "local_rank"], "none": []}
LAUNCHER_LOCAL_RANK = ("--local_rank", "--local-rank")  # what the launcher passes; programs spell it either way


def parser(convention: str) -> argparse.ArgumentParser | None:
    """The parser a program of this convention uses (None: the program's own, unknown here)."""
    if convention == "train":
        from train.config import build_parser
        return build_parser()
    if convention == "huggingface":
        from transformers import HfArgumentParser, TrainingArguments
        return HfArgumentParser(TrainingArguments)
    if convention == "deepspeed":
        import deepspeed
        result = deepspeed.add_config_arguments(argparse.ArgumentParser())
        result.add_argument("--local_rank", type=int)  # every DeepSpeed example program adds it
        return result
    return None


def owned_spellings(convention: str) -> list[str]:
    """Every option string of the program's parser that sets what the chart owns in this convention, sorted."""
    found = parser(convention)
    if found is None:
        return sorted(LAUNCHER_LOCAL_RANK)
    passed = {option for option, _, _ in PASSES[convention]}
    spellings = set()
    for action in found._actions:
        if passed & set(action.option_strings) or action.dest in ALSO_OWNED[convention]:
            spellings.update(action.option_strings)
    missing = passed - spellings
    if missing:
        raise RuntimeError(f"convention {convention}: its parser has no option {sorted(missing)}")
    return sorted(spellings)


def generated() -> dict:
    """What the chart reads: per convention, the options it passes and the spellings it refuses in train.args."""
    return {convention: {"passes": [list(p) for p in PASSES[convention]], "owned": owned_spellings(convention)}
            for convention in PASSES}
