"""The ds_config the glue writes: the preset rendered with the derived batch, deepspeed.overrides over it, checked by
train/'s rules for the ranks' layout (train.dsconfig, train.layout)."""

import json
import logging
import os

from scripts.deployctl import common
from scripts.deployctl.common import DeployError, source_of
from scripts.deployctl.layers import merge, without_nulls
from scripts.jinja_render import TemplateError, render
from train import dsconfig
from train.layout import Layout, LayoutError


def runs_train_package(effective: dict) -> bool:
    """Whether the pods run this repository's `train` package (its config and model are ours to check)."""
    train = effective["train"]
    return not train["script"] and train["module"] == common.CHART_DEFAULTS["train"]["module"] and \
        train["argsConvention"] == "train"


def render_ds_config(settings: dict, origin: dict, effective: dict, steps: int, overrides: dict, checked: bool = True
                     ) -> tuple[dict, tuple]:
    """The preset rendered with the derived batch, deepspeed.overrides merged over it, then checked (unless
    `checked` is False: a read-only look at the cluster, which needs the release's names, not DeepSpeed's parser)."""
    ds = settings["deepspeed"]
    layout = layout_of(effective, origin)  # the batch keys count the ranks that see different data
    micro = ds["microBatch"]
    if ds.get("globalBatch"):  # the accumulation, completed as DeepSpeed (and train/dsconfig.py) does
        try:
            _, accum, _ = dsconfig.batch_sizes({"train_micro_batch_size_per_gpu": micro,
                                                "train_batch_size": ds["globalBatch"]}, layout, "")
        except dsconfig.DsConfigError:
            raise DeployError(
                f"{source_of(origin, ('deepspeed', 'globalBatch'))}: deepspeed.globalBatch {ds['globalBatch']} must "
                f"be a multiple of deepspeed.microBatch {micro} x {ranks_text(effective)}") from None
    else:
        accum = ds["gradientAccumulation"]
    variables = {"micro_batch": micro, "gradient_accumulation": accum,
                 "global_batch": micro * accum * layout.data_parallel, "lr": ds["lr"],
                 "weight_decay": ds["weightDecay"], "warmup_steps": ds["warmupSteps"],
                 "gradient_clipping": ds["gradientClipping"], "steps": steps}
    template = f"ds_config/{ds['preset']}.json.j2"
    preset_source = f"{source_of(origin, ('deepspeed', 'preset'))}: deepspeed.preset {ds['preset']!r}"
    try:
        ds_config = json.loads(render(common.TEMPLATES, template, variables))
    except TemplateError as err:
        raise DeployError(f"{preset_source}: {err}") from None
    except json.JSONDecodeError as err:
        raise DeployError(f"{preset_source}: templates/{template} did not render JSON: {err}") from None
    merge(ds_config, overrides, {}, "")
    ds_config = without_nulls(ds_config)
    override_files = sorted({src for path, src in origin.items() if path[:2] == ("deepspeed", "overrides")})
    ds_source = f"templates/{template}" + (
        f" + deepspeed.overrides from {', '.join(override_files)}" if overrides else "")
    if not checked:
        return ds_config, (micro, accum, micro * accum * layout.data_parallel)
    try:
        # The train package's schedule against its steps, as its ranks check; other programs count their own.
        batch = dsconfig.check_run(ds_config, layout, ds_source, steps=steps if runs_train_package(effective) else None,
                                   fills_auto=effective["train"]["fillsDsConfigAuto"])
    except dsconfig.DsConfigError as err:
        raise DeployError(str(err)) from None
    from train import checkpoint  # noqa: PLC0415 - imports DeepSpeed's comm, which only this check needs

    storage = checkpoint.storage_for(effective["worker"]["replicas"], bool(effective["checkpoints"]["existingClaim"]))
    try:
        checkpoint.check_storage(ds_config, layout, storage, ds_source)
    except checkpoint.CheckpointError as err:
        raise DeployError(f"{source_of(origin, ('chart', 'worker', 'replicas'))}: chart.worker.replicas "
                          f"{effective['worker']['replicas']}: {err}") from None
    return ds_config, batch


def layout_of(effective: dict, origin: dict | None = None) -> Layout:
    """The ranks' layout as the pods will form it (train/layout.py): workers x GPUs, over the train package's
    model.pipeline_stages (1 for other programs). Errors name the layer that set the stages (`origin`)."""
    stages = 1
    if effective["train"]["argsConvention"] == "train":
        model = effective["train"]["config"].get("model") or {}
        stages = model.get("pipeline_stages", 1) if isinstance(model, dict) else 1
    try:
        return Layout(effective["worker"]["replicas"] * effective["worker"]["gpusPerWorker"], stages)
    except LayoutError as err:
        where = source_of(origin or {}, ("chart", "train", "config", "model", "pipeline_stages"))
        raise DeployError(f"{where}: chart.train.config.model.pipeline_stages: {err} (chart.worker.replicas x "
                          "chart.worker.gpusPerWorker)") from None


def ranks_text(effective: dict) -> str:
    workers, gpus = effective["worker"]["replicas"], effective["worker"]["gpusPerWorker"]
    return f"{layout_of(effective).describe()} ({workers} workers x {gpus} GPUs)"


def quiet_deepspeed() -> None:
    """DeepSpeed logs warnings at import and from its parsers (accelerator detection, schedulers asked for an
    lr before a step); the glue only checks configs, so its output stays the plan."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no device detection (and its warning): only configs here
    from deepspeed.utils import logger as deepspeed_logger
    deepspeed_logger.setLevel(logging.ERROR)
