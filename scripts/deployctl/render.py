"""One render of ENV x PROJECT: the layers checked, the chart's values, the ds_config and what the pods will train,
written to build/<project>/<env>/ for Helm."""

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

from scripts.deployctl import common
from scripts.deployctl.common import DeployError, blame, source_of, write_file
from scripts.deployctl.dsconf import layout_of, render_ds_config, runs_train_package
from scripts.deployctl.layers import (
    check_chart_values,
    check_glue_written,
    check_release_is_unique,
    check_scalars,
    check_schema,
    load_layers,
    without_nulls,
)
from scripts.jinja_render import render
from train import dsconfig
from train.config import ConfigError, TrainConfig, parse_args


@dataclass
class Rendered:
    env: str
    project: str | None
    settings: dict
    chart: dict  # the chart values we render (nulls kept: Helm drops the defaults they name)
    effective: dict  # chart defaults merged with ours, as Helm sees them
    ds_config: dict
    batch: tuple[int | None, int | None, int | None]  # None: "auto", filled by the program
    world_size: int
    out: Path
    sources: list[str]
    runs_train_package: bool
    origin: dict  # key path -> the layer file that set it
    warnings: list[str]  # what may fail on the workers but cannot be known here; the plan prints them


def build(env: str, project: str | None, check_ds_config: bool = True) -> Rendered:
    """ENV x PROJECT rendered and checked: every layer's error names the file, the key and what was expected.
    check_ds_config=False: the ds_config rendered but not put through DeepSpeed's parser (and the CPU ranks' kernel
    check), for a read-only look at the cluster (status, why, logs: ~1.7 s of DeepSpeed's import saved)."""
    merged, origin, sources = load_layers(env, project)
    settings = without_nulls(merged)
    check_schema(settings, json.loads(common.SETTINGS_SCHEMA.read_text()), origin, (),
                 "checked against scripts/settings.schema.json")
    check_scalars(merged, origin)
    check_glue_written(merged, origin)
    check_release_is_unique(settings, origin, env, project)
    apply_platform_grants(settings, merged, origin, project)
    effective = check_chart_values(merged["chart"], origin)
    world_size = effective["worker"]["replicas"] * effective["worker"]["gpusPerWorker"]
    ours = runs_train_package(effective)
    steps = train_steps(effective, origin) if ours else effective["train"]["config"].get("steps", TrainConfig.steps)
    overrides = merged["deepspeed"].get("overrides") or {}  # with its nulls: null removes a preset key
    ds_config, batch = render_ds_config(settings, origin, effective, steps, overrides, checked=check_ds_config)
    warnings = cpu_rank_warnings(settings, origin, effective, ds_config) if check_ds_config else []
    chart = copy.deepcopy(merged["chart"])
    chart.setdefault("deepspeed", {})["config"] = ds_config
    out = common.BUILD / (project or "base") / env
    return Rendered(env, project, settings, chart, effective, ds_config, batch, world_size, out, sources, ours, origin,
                    warnings)


def apply_platform_grants(settings: dict, merged: dict, origin: dict, project: str | None) -> None:
    """What the platform's layers grant one project: its namespace, relaxed security, another release's
    checkpoints to start from, the identity that owns its storage and one whose storage it takes over."""
    deploy = settings["deploy"]
    if project in deploy.get("projectNamespaces", {}):
        deploy["namespace"] = deploy["projectNamespaces"][project]
    if project and project in deploy.get("relaxSecurityFor", []):
        merged["chart"]["allowSecurityRelaxations"] = True
        origin[("chart", "allowSecurityRelaxations")] = source_of(origin, ("deploy", "relaxSecurityFor"))
    ids = deploy.get("projectIds") or {}
    if project in ids and (others := sorted(p for p, i in ids.items() if i == ids[project] and p != project)):
        raise DeployError(f"{source_of(origin, ('deploy', 'projectIds'))}: deploy.projectIds: projects {project} and "
                          f"{', '.join(others)} have the identity {ids[project]}: each project needs its own (it owns "
                          "the project's storage)")
    for grant, key in (("projectResumeFrom", "resumeFrom"), ("projectIds", "owner"), ("projectAdopts", "adoptOwner")):
        if project in (deploy.get(grant) or {}):
            merged["chart"].setdefault("checkpoints", {})[key] = deploy[grant][project]
            origin[("chart", "checkpoints", key)] = source_of(origin, ("deploy", grant))


def train_steps(effective: dict, origin: dict) -> int:
    """The train package's steps, through its own config and argument check as the pods will run it (--steps in
    chart.train.args included); its errors name the layer."""
    try:
        args = [re.sub(r"\{(ds_config|train_config|checkpoint_dir|data_dir)\}", "/x", str(a))
                for a in effective["train"]["args"]]
        return parse_args(["--ds-config=ds_config.json", *args], effective["train"]["config"],
                          "chart.train.config").steps
    except ConfigError as err:
        if str(err).startswith("command line:"):  # train's parser refused an argument of chart.train.args
            raise DeployError(f"{source_of(origin, ('chart', 'train', 'args'))}: chart.train.args: "
                              f"{str(err).removeprefix('command line: ')}") from None
        named = blame(origin, ("chart", "train", "config"), str(err))
        files = sorted({n.rsplit(" from ", 1)[1] for n in named}) or [source_of(origin, ("chart", "train"))]
        raise DeployError(f"{', '.join(files)}: {err}") from None


def cpu_rank_warnings(settings: dict, origin: dict, effective: dict, ds_config: dict) -> list[str]:
    """CPU ranks (no GPU resource): an optimizer DeepSpeed's CPU accelerator cannot run is refused; a precision that
    depends on the workers' CPUs (this machine's says nothing of theirs) is a warning."""
    if effective["worker"]["gpuResourceName"]:
        return []
    where = (f"templates/ds_config/{settings['deepspeed']['preset']}.json.j2 with chart.worker.gpuResourceName "
             f"\"\" ({source_of(origin, ('chart', 'worker', 'gpuResourceName'))})")
    try:
        dsconfig.check_optimizer_kernel(ds_config, "cpu", where)
    except dsconfig.DsConfigError as err:
        raise DeployError(str(err)) from None
    return [f"{section}.enabled on CPU ranks ({where}): DeepSpeed runs it only on CPUs with avx512_fp16; a rank "
            "whose CPU lacks it stops at start (exit 2)"
            for section in dsconfig.CPU_DEPENDENT_PRECISIONS if ds_config.get(section, {}).get("enabled")]


def write(r: Rendered) -> None:
    """build/<project>/<env>/: values.yaml (JSON, which is YAML: Helm reads back exactly the types we checked,
    where a YAML dump could turn the tag "0370e25" into a number or "y" into a boolean), ds_config.json and
    train_config.json."""
    r.out.mkdir(parents=True, exist_ok=True)
    values = render(common.TEMPLATES, "values.yaml.j2", {
        "env": r.env, "project": r.project, "sources": r.sources, "chart": r.chart, "world_size": r.world_size,
        "workers": r.effective["worker"]["replicas"], "gpus": r.effective["worker"]["gpusPerWorker"],
        "batch": [("auto" if n is None else n) for n in r.batch], "preset": r.settings["deepspeed"]["preset"],
        "ranks": layout_of(r.effective).describe()})
    write_file(r.out / "values.yaml", values)
    write_file(r.out / "ds_config.json", json.dumps(r.ds_config, indent=2) + "\n")
    write_file(r.out / "train_config.json", json.dumps(r.effective["train"]["config"], indent=2) + "\n")
