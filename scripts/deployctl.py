"""The glue between values/ and the chart: layer, derive, render, validate, then hand to Helm.

    python scripts/deployctl.py {render,plan,template,deploy,diff,undeploy,demo} --env ENV [--project NAME]

render writes build/<project>/<env>/{values.yaml,ds_config.json,train_config.json}; every other command
renders first, so nothing reaches a cluster unvalidated. Errors name the file, the key and what was expected.
"""

import argparse
import copy
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the train package: one ds_config check for both (train.dsconfig)

from scripts.jinja_render import TemplateError, render  # noqa: E402
from train import dsconfig, yamlfile  # noqa: E402
from train.config import ConfigError, ModelConfig, TrainConfig, parse_args  # noqa: E402
from train.layout import Layout, LayoutError  # noqa: E402

VALUES, TEMPLATES, BUILD = ROOT / "values", ROOT / "templates", ROOT / "build"
CHART = ROOT / "charts" / "deepspeed-training"
SETTINGS_SCHEMA = Path(__file__).with_name("settings.schema.json")
CHART_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_NAME = yaml.safe_load((CHART / "Chart.yaml").read_text())["name"]
IMAGE_EXAMPLES = "/opt/deepspeed-examples"  # where docker/Dockerfile.hf puts examples/; the demo runs them from here


class DeployError(Exception):
    """Bad configuration or a refused deploy; the message says where and what was expected."""


# ---------------------------------------------------------------- layering

def load_yaml(path: Path) -> dict:
    if not path.resolve().is_relative_to(VALUES.resolve()):  # a link out of values/ (a tenant's project dir)
        raise DeployError(f"{path.relative_to(ROOT)}: links outside values/; layers must be files in values/")
    try:
        return yamlfile.load_mapping(path, str(path.relative_to(ROOT)))
    except yamlfile.YamlFileError as err:
        raise DeployError(str(err)) from None


def layer_files(env: str, project: str | None) -> list[Path]:
    envs = sorted(p.stem for p in VALUES.glob("*.yaml") if p.stem != "base")
    if env not in envs:
        raise DeployError(f"ENV={env}: no values/{env}.yaml; environments: {', '.join(envs)}")
    files = [VALUES / "base.yaml", VALUES / f"{env}.yaml"]
    if project:
        projects = sorted(p.name for p in (VALUES / "projects").iterdir() if p.is_dir())
        if project not in projects:
            raise DeployError(f"PROJECT={project}: no values/projects/{project}/; projects: {', '.join(projects)}")
        files.append(VALUES / "projects" / project / "values.yaml")
        per_env = VALUES / "projects" / project / f"{env}.yaml"
        if per_env.exists():
            files.append(per_env)
    return files


def merge(into: dict, layer: dict, origin: dict, source: str, path: tuple = ()) -> None:
    """Deep-merges `layer` into `into` as Helm merges -f files: maps merge, everything else replaces, and
    null removes what earlier layers set (it stays in `into` as None, so Helm drops the chart's default too;
    without_nulls() gives the effective values). `origin` records which file set each key path."""
    for key, value in layer.items():
        here = (*path, key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value, origin, source, here)
        else:
            into[key] = copy.deepcopy(value)
            origin[here] = source


def without_nulls(values):
    """`values` with the keys a layer set to null removed (what Helm's coalescing leaves)."""
    if isinstance(values, dict):
        return {k: without_nulls(v) for k, v in values.items() if v is not None}
    return values


def source_of(origin: dict, path) -> str:
    """The file that set `path` or its nearest parent."""
    path = tuple(path)
    while path and path not in origin:
        path = path[:-1]
    return origin.get(path, "values/base.yaml")


def dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


# ---------------------------------------------------------------- the render

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


# JSON Schema's "integer" takes 4.0; DeepSpeed and Kubernetes do not, and a float passed on would be refused later,
# in a derived key of a rendered file instead of the user's key and layer.
SchemaValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, type_checker=(
    jsonschema.Draft7Validator.TYPE_CHECKER.redefine("integer", lambda _, value: isinstance(value, int)
                                                     and not isinstance(value, bool))))


def check_schema(instance: dict, schema: dict, origin: dict, prefix: tuple, what: str) -> None:
    errors = sorted(SchemaValidator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    lines = []
    for e in errors[:10]:
        path = (*prefix, *e.absolute_path)
        blame = path
        if e.validator == "additionalProperties":  # blame the file that added the unknown key
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            blame = (*path, extra[0]) if extra else path
        elif e.validator == "required":  # blame the file that removed it (null), if one did
            missing = [key for key in e.validator_value if key not in e.instance]
            blame = (*path, missing[0]) if missing else path
        lines.append(f"{source_of(origin, blame)}: {dotted(path)}: {e.message}")
    if lines:
        raise DeployError("; ".join(lines) + f" ({what})")


# Keys only the platform's layers (values/base.yaml, values/<env>.yaml) may set: a project file is written by a
# tenant team but deployed with the platform's credentials.
PLATFORM_ONLY = {
    ("deploy", "kubeContexts"): "the kube contexts an environment may deploy to",
    ("deploy", "namespace"): "the namespace (per project: deploy.projectNamespaces)",
    ("deploy", "projectNamespaces"): "the projects' namespaces",
    ("deploy", "release"): "the Helm release (a project's is its directory name)",
    ("deploy", "relaxSecurityFor"): "the projects whose pods may relax the security defaults",
    ("chart", "allowSecurityRelaxations"): "relaxed security (per project: deploy.relaxSecurityFor)",
    ("chart", "serviceAccount"): "the pods' ServiceAccount (its token and cloud identity)",
    ("chart", "progress", "image"): "the progress sidecar's image (the container that holds the release's token)",
    ("chart", "checkpoints", "resumeAcrossWorldSizes"): "whether a job may resume on another world size",
    ("chart", "checkpoints", "resumeFrom"): "starting from another release's checkpoints (per project: "
                                            "deploy.projectResumeFrom)",
    ("deploy", "projectResumeFrom"): "the releases whose checkpoints a project may start from",
    ("deploy", "projectChoices"): "what projects may change in their pods' scheduling, identity and checkpoints",
}
MISSING = object()  # a key path that holds no value


def lookup(values, path: tuple):
    for part in path:
        if not isinstance(values, dict) or part not in values:
            return MISSING
        values = values[part]
    return values


def platform_view(merged: dict) -> dict:
    """What a layering means where the platform pins keys: deploy as set, chart as Helm sees it (the chart's
    defaults under it, nulls removing them)."""
    chart = copy.deepcopy(CHART_DEFAULTS)
    merge(chart, merged.get("chart") if isinstance(merged.get("chart"), dict) else {}, {}, "")
    deploy = merged.get("deploy") if isinstance(merged.get("deploy"), dict) else {}
    return {"deploy": without_nulls(deploy), "chart": without_nulls(chart)}


def layer_order(name: str) -> tuple:
    """Sorts layer files as they apply: a project's values.yaml before its <env>.yaml."""
    return (name.startswith("values/projects/"), name.endswith("/values.yaml") is False, name)


def check_platform_only(merged: dict, platform: dict, origin: dict, env: str) -> None:
    """The platform-only keys hold the platform's values however the project's layers got there: directly, or
    through a parent set to null (or replaced) and rebuilt without them."""
    ours, theirs = platform_view(merged), platform_view(platform)
    for key_path, what in PLATFORM_ONLY.items():
        if lookup(ours, key_path) != lookup(theirs, key_path):
            touched = [origin[key_path[:n]] for n in range(1, len(key_path) + 1) if key_path[:n] in origin]
            blamed = [f for f in touched if f.startswith("values/projects/")] or touched
            raise DeployError(f"{max(blamed, key=layer_order)}: {'.'.join(key_path)}: {what} is the platform's to set, "
                              f"in values/{env}.yaml or values/base.yaml; a project's layers may not change or "
                              "remove it (here through a parent key set to null or replaced)")


def load_layers(env: str, project: str | None) -> tuple[dict, dict, list[str]]:
    """(merged settings, origin of each key path, layer files). Project layers may not set the keys that
    only the platform's files (base and environment) decide."""
    files = layer_files(env, project)
    settings, origin = {}, {}
    for path in files:
        layer = load_yaml(path)
        name = str(path.relative_to(ROOT))
        if path.parent != VALUES:
            if path == files[2]:  # the platform's layers end here
                platform = copy.deepcopy(settings)
            for key_path, what in PLATFORM_ONLY.items():
                node = layer
                for part in key_path[:-1]:
                    node = node.get(part) if isinstance(node, dict) else None
                if isinstance(node, dict) and key_path[-1] in node:
                    raise DeployError(f"{name}: {'.'.join(key_path)}: {what} is the platform's to set, in "
                                      f"values/{env}.yaml or values/base.yaml, never in a project's files")
        merge(settings, layer, origin, name)
    if project:
        check_platform_only(settings, platform, origin, env)
    return settings, origin, [str(p.relative_to(ROOT)) for p in files]


def release_of(settings: dict, project: str | None) -> str:
    return settings["deploy"].get("release") or project or CHART_NAME


def check_glue_written(merged: dict, origin: dict) -> None:
    """chart.deepspeed.config is the glue's to write (the preset rendered, deepspeed.overrides over it): a layer's
    ds_config there would be replaced without a word, and the job would train with another one."""
    deepspeed = merged["chart"].get("deepspeed")
    if isinstance(deepspeed, dict) and "config" in deepspeed:
        raise DeployError(f"{source_of(origin, ('chart', 'deepspeed', 'config'))}: chart.deepspeed.config: the glue "
                          "writes the ds_config itself (deepspeed.preset with deepspeed.microBatch and the other "
                          "deepspeed.* settings); put ds_config keys under deepspeed.overrides")


def check_scalars(values, origin: dict, path: tuple = ()) -> None:
    """Settings a JSON schema lets through: non-finite numbers, strings with control characters (Python's `$`
    matches before a trailing newline), YAML types JSON has not (dates, binary)."""
    if isinstance(values, dict):
        for key, value in values.items():
            check_scalars(value, origin, (*path, key))
        return
    if isinstance(values, list):
        for i, value in enumerate(values):
            check_scalars(value, origin, (*path, i))
        return
    problem = None
    if isinstance(values, float) and not math.isfinite(values):
        problem = f"{values} is not a finite number"
    elif isinstance(values, str) and path[0] != "chart" and any(
            ord(c) < 32 or ord(c) in (0x7F, 0x85, 0x2028, 0x2029) for c in values):
        problem = f"{values!r} contains a control character or line break"
    elif values is not None and not isinstance(values, (str, int, float, bool)):
        problem = f"a YAML {type(values).__name__} is not a value JSON (and Helm) can carry; quote it"
    if problem:
        raise DeployError(f"{source_of(origin, path)}: {dotted(path)}: {problem}")


def chart_fullname(release: str, chart: dict) -> str:
    """The prefix of every object name the chart renders for `release` with these chart values: the chart's
    `deepspeed-training.fullname` (templates/_helpers.tpl), which tests/test_hostile_glue.py renders with helm to
    keep this copy equal."""
    def cut(name: str) -> str:  # `trunc 45 | trimSuffix "-"`
        name = name[:45]
        return name[:-1] if name.endswith("-") else name

    if chart.get("fullnameOverride"):
        return cut(chart["fullnameOverride"])
    name = chart.get("nameOverride") or CHART_NAME
    return cut(release if name in release else f"{release}-{name}")


def release_identity(settings: dict, project: str | None) -> tuple[str, str, str]:
    """(namespace, release, object-name prefix) of a project's release, as the layers give them."""
    namespace = settings["deploy"].get("projectNamespaces", {}).get(project, settings["deploy"]["namespace"])
    release = release_of(settings, project)
    return namespace, release, chart_fullname(release, settings.get("chart") or {})


def check_release_is_unique(settings: dict, origin: dict, env: str, project: str | None) -> None:
    """Two projects with one release name would replace each other's running job; two whose objects have the same
    names in one namespace (a project named `<other>-deepspeed-training`, a fullnameOverride) would fail or squat
    each other's install."""
    if not project:
        return
    namespace, mine, prefix = release_identity(settings, project)
    for other in sorted(p.name for p in (VALUES / "projects").iterdir() if p.is_dir() and p.name != project):
        other_settings = without_nulls(load_layers(env, other)[0])
        other_namespace, theirs, other_prefix = release_identity(other_settings, other)
        if theirs == mine:
            raise DeployError(f"{source_of(origin, ('deploy', 'release'))}: deploy.release {mine!r} is also the "
                              f"release of values/projects/{other}/: releases must be unique (leave deploy.release "
                              "empty to use the project's directory name)")
        if (other_namespace, other_prefix) == (namespace, prefix):
            names = [source_of(origin, ("chart", key)) for key in ("fullnameOverride", "nameOverride")
                     if ("chart", key) in origin]
            where = names[0] if names else f"values/projects/{project}/"
            raise DeployError(f"{where}: project {project} (release {mine}) and project {other} (release {theirs}) "
                              f"would both name their objects {prefix}-* in namespace {namespace}: the second "
                              "install would fail or take the first's objects; rename one project's directory (or "
                              "change chart.fullnameOverride / chart.nameOverride)")


def check_chart_values(chart: dict, origin: dict) -> dict:
    """The chart's values.schema.json against the chart defaults merged with ours, as Helm checks them;
    returns those effective values."""
    effective = yaml.safe_load((CHART / "values.yaml").read_text())
    merge(effective, chart, {}, "")
    effective = without_nulls(effective)
    check_schema(effective, json.loads((CHART / "values.schema.json").read_text()), origin, ("chart",),
                 "checked against charts/deepspeed-training/values.schema.json")
    return effective


def runs_train_package(effective: dict) -> bool:
    """Whether the pods run this repository's `train` package (its config and model are ours to check)."""
    train = effective["train"]
    return not train["script"] and train["module"] == CHART_DEFAULTS["train"]["module"] and \
        train["argsConvention"] == "train"


def render_ds_config(settings: dict, origin: dict, effective: dict, steps: int, overrides: dict
                     ) -> tuple[dict, tuple]:
    """The preset rendered with the derived batch, deepspeed.overrides merged over it, then checked."""
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
        ds_config = json.loads(render(TEMPLATES, template, variables))
    except TemplateError as err:
        raise DeployError(f"{preset_source}: {err}") from None
    except json.JSONDecodeError as err:
        raise DeployError(f"{preset_source}: templates/{template} did not render JSON: {err}") from None
    merge(ds_config, overrides, {}, "")
    ds_config = without_nulls(ds_config)
    override_files = sorted({src for path, src in origin.items() if path[:2] == ("deepspeed", "overrides")})
    ds_source = f"templates/{template}" + (
        f" + deepspeed.overrides from {', '.join(override_files)}" if overrides else "")
    try:
        # The train package's schedule against its steps, as its ranks check; other programs count their own.
        batch = dsconfig.check_run(ds_config, layout, ds_source, steps=steps if runs_train_package(effective) else None,
                                   fills_auto=effective["train"]["fillsDsConfigAuto"])
    except dsconfig.DsConfigError as err:
        raise DeployError(str(err)) from None
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


def build(env: str, project: str | None) -> Rendered:
    merged, origin, sources = load_layers(env, project)
    settings = without_nulls(merged)
    check_schema(settings, json.loads(SETTINGS_SCHEMA.read_text()), origin, (),
                 "checked against scripts/settings.schema.json")
    check_scalars(merged, origin)
    check_glue_written(merged, origin)
    check_release_is_unique(settings, origin, env, project)
    if project in settings["deploy"].get("projectNamespaces", {}):  # the platform's per-project namespace
        settings["deploy"]["namespace"] = settings["deploy"]["projectNamespaces"][project]
    if project and project in settings["deploy"].get("relaxSecurityFor", []):  # the platform's per-project opt-in
        merged["chart"]["allowSecurityRelaxations"] = True
        origin[("chart", "allowSecurityRelaxations")] = source_of(origin, ("deploy", "relaxSecurityFor"))
    if project in settings["deploy"].get("projectResumeFrom", {}):  # the platform's per-project opt-in
        merged["chart"].setdefault("checkpoints", {})["resumeFrom"] = settings["deploy"]["projectResumeFrom"][project]
        origin[("chart", "checkpoints", "resumeFrom")] = source_of(origin, ("deploy", "projectResumeFrom"))
    effective = check_chart_values(merged["chart"], origin)
    world_size = effective["worker"]["replicas"] * effective["worker"]["gpusPerWorker"]
    train_config = effective["train"]["config"]
    ours = runs_train_package(effective)
    if ours:
        try:  # the train package's own config and argument check, as the pods will run it (--steps in args included)
            args = [re.sub(r"\{(ds_config|train_config|checkpoint_dir|data_dir)\}", "/x", str(a))
                    for a in effective["train"]["args"]]
            steps = parse_args(["--ds-config=ds_config.json", *args], train_config, "chart.train.config").steps
        except ConfigError as err:
            if str(err).startswith("command line:"):  # train's parser refused an argument of chart.train.args
                raise DeployError(f"{source_of(origin, ('chart', 'train', 'args'))}: chart.train.args: "
                                  f"{str(err).removeprefix('command line: ')}") from None
            named = blame(origin, ("chart", "train", "config"), str(err))
            files = sorted({n.rsplit(" from ", 1)[1] for n in named}) or [source_of(origin, ("chart", "train"))]
            raise DeployError(f"{', '.join(files)}: {err}") from None
    else:
        steps = train_config.get("steps", TrainConfig.steps)
    overrides = merged["deepspeed"].get("overrides") or {}  # with its nulls: null removes a preset key
    ds_config, batch = render_ds_config(settings, origin, effective, steps, overrides)
    warnings = []
    if not effective["worker"]["gpuResourceName"]:  # CPU ranks: what DeepSpeed's CPU accelerator can run
        where = (f"templates/ds_config/{settings['deepspeed']['preset']}.json.j2 with chart.worker.gpuResourceName "
                 f"\"\" ({source_of(origin, ('chart', 'worker', 'gpuResourceName'))})")
        try:
            dsconfig.check_optimizer_kernel(ds_config, "cpu", where)
        except dsconfig.DsConfigError as err:
            raise DeployError(str(err)) from None
        # This machine's CPU says nothing of the workers': each rank checks its own at start (exit 2).
        warnings += [f"{section}.enabled on CPU ranks ({where}): DeepSpeed runs it only on CPUs with avx512_fp16; "
                     "a rank whose CPU lacks it stops at start (exit 2)"
                     for section in dsconfig.CPU_DEPENDENT_PRECISIONS if ds_config.get(section, {}).get("enabled")]
    chart = copy.deepcopy(merged["chart"])
    chart.setdefault("deepspeed", {})["config"] = ds_config
    out = BUILD / (project or "base") / env
    return Rendered(env, project, settings, chart, effective, ds_config, batch, world_size, out, sources, ours, origin,
                    warnings)


def write(r: Rendered) -> None:
    """build/<project>/<env>/: values.yaml (JSON, which is YAML: Helm reads back exactly the types we checked,
    where a YAML dump could turn the tag "0370e25" into a number or "y" into a boolean), ds_config.json and
    train_config.json."""
    r.out.mkdir(parents=True, exist_ok=True)
    values = render(TEMPLATES, "values.yaml.j2", {
        "env": r.env, "project": r.project, "sources": r.sources, "chart": r.chart, "world_size": r.world_size,
        "workers": r.effective["worker"]["replicas"], "gpus": r.effective["worker"]["gpusPerWorker"],
        "batch": [("auto" if n is None else n) for n in r.batch], "preset": r.settings["deepspeed"]["preset"],
        "ranks": layout_of(r.effective).describe()})
    write_file(r.out / "values.yaml", values)
    write_file(r.out / "ds_config.json", json.dumps(r.ds_config, indent=2) + "\n")
    write_file(r.out / "train_config.json", json.dumps(r.effective["train"]["config"], indent=2) + "\n")


def write_file(path: Path, text: str) -> None:
    """Replace `path` whole: two runs for one ENV/PROJECT at once (a plan beside a deploy, parallel CI jobs on
    one checkout) each read back a complete file, never the other's half-written one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what write_text would have made
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- plan

def pipeline_plan(r: Rendered) -> list[str]:
    """The plan's lines for the pipeline layout: stages x data-parallel ranks, and each stage's layers."""
    layout = layout_of(r.effective)
    if layout.pipeline_stages == 1:
        return []
    from train.pipeline import stage_plan

    model = ModelConfig(**r.effective["train"]["config"].get("model", {}))
    lines = [f"  layout      {layout.pipeline_stages} pipeline stages x {layout.data_parallel} data-parallel ranks "
             f"(stage s, data-parallel rank d is rank s x {layout.data_parallel} + d)"]
    lines += [f"  stage {i:<5} {layers}: {count / 1e6:,.1f}M parameters" for i, (layers, count) in
              enumerate(stage_plan(model))]
    return lines


def memory_estimate(r: Rendered) -> tuple[int, int, int, str]:
    """(parameters, GPU bytes, CPU bytes, how) from DeepSpeed's ZeRO estimators for the configured model."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from train.model import build_model, count_parameters, largest_layer_parameters

    model_values = r.effective["train"]["config"].get("model", {})
    with torch.device("meta"):  # shapes only: no memory, no time, even for billions of parameters
        model = build_model(ModelConfig(**model_values))
    params = count_parameters(model)
    zero = r.ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    gpus, nodes = r.effective["worker"]["gpusPerWorker"], r.effective["worker"]["replicas"]
    if stage == 3:
        offload_params = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
        # DeepSpeed 0.19 returns (cpu, gpu, largest layer's memory)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer_parameters(model), gpus, nodes,
                                                            cpu_offload=offload, cpu_offload_params=offload_params)
        how = "ZeRO-3 estimator"
    elif stage in (1, 2):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
        how = "ZeRO-2 estimator" + (" (ZeRO-1 needs somewhat more: its gradients are not partitioned)"
                                    if stage == 1 else "")
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=False)
        how = "no partitioning (ZeRO-0)"
    return params, gpu, cpu, how


def kube_context(r: Rendered, requested: str | None, need_cluster: bool) -> str | None:
    allowed = r.settings["deploy"]["kubeContexts"]
    context = requested or (allowed[0] if allowed else None)
    if context is None and need_cluster and shutil.which("kubectl"):
        proc = subprocess.run(["kubectl", "config", "current-context"], capture_output=True, text=True)
        context = proc.stdout.strip() or None
    if allowed and context not in allowed:
        raise DeployError(f"values/{r.env}.yaml: deploy.kubeContexts allows {allowed}; refusing to deploy ENV={r.env} "
                          f"to kube context {context!r}")
    return context


def human(size: float) -> str:
    return f"{size / 1024 ** 3:.1f} GiB" if size >= 1024 ** 3 else f"{size / 1024 ** 2:.0f} MiB"


RELAXATIONS_ANNOTATION = "deepspeed-training/security-relaxations"  # set by the chart's _validate.tpl
# What checkpoints.resumeFrom (deploy.projectResumeFrom) grants, said wherever it is set.
RESUME_FROM_TRUST = ("checkpoints.resumeFrom {source}: DeepSpeed loads checkpoints with "
                     "torch.load(weights_only=False), which runs code stored in them: this release's ranks run the "
                     "code of release {source}, with this release's secrets and volumes (whoever can write that "
                     "release's checkpoint directory can)")
LAUNCH_MODES = {"ssh": "ssh (a launcher Job runs deepspeed over pdsh to the workers' sshd)",
                "nossh": "nossh (an Indexed Job: each worker runs deepspeed for its node rank, no sshd)"}


def worker_pod_template(manifests: str) -> dict:
    """The workers' pod template: the StatefulSet's (launchMode ssh) or the Indexed Job's (nossh)."""
    for doc in yaml.safe_load_all(manifests):
        if doc and doc.get("kind") in ("StatefulSet", "Job") and \
                doc["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker":
            return doc["spec"]["template"]
    raise DeployError("the chart rendered no worker pods")


def security_relaxations(manifests: str) -> list[str]:
    """The relaxed security defaults the chart reports on the worker pods (empty for the defaults)."""
    text = worker_pod_template(manifests)["metadata"].get("annotations", {}).get(RELAXATIONS_ANNOTATION, "")
    return [item for item in text.split("; ") if item]


# What the platform's layers decide in the rendered objects, whichever values produce it (a component's own
# value, the global fallback, a parent set to null): name -> (what it is, the chart keys that feed it). A
# project's render may differ from the platform's alone only where deploy.projectChoices lists its value.
PLACEMENT = ("global", "worker", "launcher")  # a component's own value, else the global one
PINNED_FIELDS = {
    "serviceAccount": ("ServiceAccount (name and annotations: the pods' token and cloud identity)",
                       [("serviceAccount",)]),
    "priorityClassName": ("PriorityClass (preemption of other tenants)", [(c, "priorityClassName") for c in PLACEMENT]),
    "nodeSelector": ("nodeSelector (the node pool)", [(c, "nodeSelector") for c in PLACEMENT]),
    "tolerations": ("tolerations (tainted nodes)", [(c, "tolerations") for c in PLACEMENT]),
    "affinity": ("affinity (the node pool)", [(c, "affinity") for c in PLACEMENT]),
    "schedulerName": ("scheduler", [("scheduling",)]),
    "kueueQueueName": ("Kueue queue (admission and quota)", [("scheduling",)]),
    "volcanoQueue": ("Volcano queue", [("scheduling",)]),
    "checkpointVolume": ("checkpoint volume (claim and directory)", [("checkpoints",)]),
    # The sidecar holds the release's token: it runs the platform's image. With chart.progress.image empty it would
    # run the workers' image, which projects choose: the platform pins chart.progress.image (values/base.yaml), or
    # the project runs without the sidecar (chart.progress.enabled: false, chart.launcher.scaleDownWorkers: false).
    "progressImage": ("progress sidecar's image (it holds the release's token: the platform pins "
                      "chart.progress.image, or the project sets chart.progress.enabled: false and "
                      "chart.launcher.scaleDownWorkers: false)", [("progress",), ("image",)]),
}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def pinned_fields(manifests: str) -> dict[str, dict]:
    """{component: {field: value}} of PINNED_FIELDS for the worker and launcher pods of a render."""
    docs = [doc for doc in yaml.safe_load_all(manifests) if doc]
    accounts = {d["metadata"]["name"]: d["metadata"].get("annotations", {}) for d in docs
                if d["kind"] == "ServiceAccount"}
    volcano = [d["spec"].get("queue", "") for d in docs
               if d["kind"] == "PodGroup" and d["apiVersion"].startswith("scheduling.volcano.sh/")]
    found = {}
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Job"):
            continue
        template, spec = doc["spec"]["template"], doc["spec"]["template"]["spec"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        account = spec.get("serviceAccountName", "default")
        fields = {
            "serviceAccount": {"name": account, "annotations": accounts.get(account, {})},
            **{name: spec.get(name, empty) for name, empty in (("priorityClassName", ""), ("nodeSelector", {}),
                                                               ("tolerations", []), ("affinity", {}),
                                                               ("schedulerName", ""))},
            "kueueQueueName": template["metadata"]["labels"].get(QUEUE_LABEL, ""),
            "volcanoQueue": volcano[0] if volcano else "",
            # None: no sidecar, so no token to guard (a project may always run without it)
            "progressImage": next((c["image"] for c in spec.get("initContainers", []) if c["name"] == "progress"),
                                  None),
        }
        if component == "worker":  # the launcher mounts checkpoints only for the autotuner
            volume = next((v for v in spec.get("volumes", []) if v["name"] == "checkpoints"), {})
            mount = next((m for m in spec["containers"][0].get("volumeMounts", []) if m["name"] == "checkpoints"), {})
            fields["checkpointVolume"] = {
                "source": (volume.get("persistentVolumeClaim") or {}).get("claimName") or
                ("emptyDir" if "emptyDir" in volume else "a PVC per worker"), "subPath": mount.get("subPath", "")}
        found[component] = fields
    return found


def check_pins(r: Rendered, manifests: str) -> None:
    """A project's layers may not move its pods off what the platform's layers pinned (scheduling, identity,
    checkpoint volume), by any path: its render is compared with a render of the platform's layers alone."""
    try:
        platform = build(r.env, None)
    except DeployError as err:
        raise DeployError(f"the platform's layers alone do not render, so what the project may change cannot be "
                          f"checked: {err}") from None
    platform.out = r.out / "platform"
    write(platform)
    ours, theirs = pinned_fields(manifests), pinned_fields(helm_template(platform, release_name(r),
                                                                         r.settings["deploy"]["namespace"]))
    choices = r.settings["deploy"].get("projectChoices", {})
    project_files = [f for f in r.sources if f.startswith("values/projects/")]
    for component, fields in ours.items():
        base = theirs.get(component) or theirs["worker"]  # a launcher the platform's own mode has not
        for name, value in fields.items():
            if value == base.get(name, value) or value in choices.get(name, []) or value is None:
                continue
            what, keys = PINNED_FIELDS[name]
            feeding = [("chart", *key) for key in keys]
            files = sorted({source for path, source in r.origin.items() if source in project_files and any(
                path[:len(key)] == key or key[:len(path)] == path for key in feeding)}) or project_files
            allowed = choices.get(name, [])
            raise DeployError(
                f"{', '.join(files)}: the {component} pods' {what} would be {json.dumps(value)}, but the platform's "
                f"layers (values/{r.env}.yaml, values/base.yaml) give {json.dumps(base[name])}; a project may change "
                f"it only to a value the platform lists in deploy.projectChoices.{name} "
                f"({', '.join(json.dumps(a) for a in allowed) if allowed else 'none listed'}); set through "
                f"{', '.join('chart.' + '.'.join(key) for key in keys)}")


def plan(r: Rendered, context: str | None, manifests: str) -> str:
    batch = ["auto (filled by the program)" if n is None else n for n in r.batch]
    zero = r.ds_config.get("zero_optimization", {})
    precision = "bf16" if r.ds_config.get("bf16", {}).get("enabled") else (
        "fp16" if r.ds_config.get("fp16", {}).get("enabled") else "fp32")
    worker, train = r.effective["worker"], r.effective["train"]
    gpu_name = worker["gpuResourceName"]
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    program = train["script"] or f"--module {train['module']}"
    hang = r.effective["hangDetection"]
    lines = [
        f"plan: ENV={r.env} PROJECT={r.project or '-'} (layers: {', '.join(r.sources)})",
        f"  release     {release_name(r)} in namespace {r.settings['deploy']['namespace']}, kube context "
        f"{context or '(current)'}",
        f"  workers     {worker['replicas']} x {worker['gpusPerWorker']} {gpu_name or 'CPU ranks'} = world size "
        f"{r.world_size}",
        f"  batch       micro {batch[0]} x accumulation {batch[1]} x {layout_of(r.effective).describe()} = "
        f"global {batch[2]}",
        f"  deepspeed   preset {r.settings['deepspeed']['preset']}: ZeRO stage {zero.get('stage', 0)}, {precision}, "
        f"optimizer offload {offload}",
        f"  launch      {LAUNCH_MODES[r.effective['launchMode']]}, a failure budget of "
        f"{r.effective['job']['runRetries']} failed runs per job, retried in the pods (preemptions do not count); "
        f"collective timeout {r.effective['deepspeed']['collectiveTimeoutMinutes']} min",
        "  hangs       " + (f"watchdog in the worker pods: {hang['startupSeconds']} s to a rank's first step, then "
                             f"{hang['stepSeconds']} s (or 10x its step time) per step, {hang['checkpointSeconds']} s "
                             "per save or restore" if hang["enabled"]
                             else "no watchdog (hangDetection.enabled: false): only the collective timeout"),
        f"  program     {program} ({train['argsConvention']} arguments"
        + (", fills the ds_config's \"auto\" values)" if train["fillsDsConfigAuto"] else ")"),
    ]
    if r.runs_train_package and r.effective["train"]["config"].get("model", {}).get("hf_config"):
        lines.append("  model       a Hugging Face config read in the pods (model.hf_config): no estimate here")
    elif r.runs_train_package:
        params, gpu_bytes, cpu_bytes, how = memory_estimate(r)
        lines += [f"  model       {params / 1e6:,.1f}M parameters",
                  *pipeline_plan(r),
                  f"  memory      model states ~{human(gpu_bytes)} per GPU, ~{human(cpu_bytes)} host per node "
                  f"({how}; activations come on top)"]
        limit = r.settings["deepspeed"]["gpuMemoryGiB"]
        if gpu_name and gpu_bytes > limit * 1024 ** 3:
            lines.append(f"  WARNING: model states need ~{gpu_bytes / 1024 ** 3:.1f} GiB per GPU but the GPUs have "
                         f"{limit} GiB (deepspeed.gpuMemoryGiB): use more GPUs, ZeRO-3 or offload (preset "
                         "zero3-offload-bf16)")
    else:
        lines.append("  model       the program's own (no estimate)")
    lines += [f"  WARNING: {warning}" for warning in r.warnings]
    if resume_from := r.effective["checkpoints"]["resumeFrom"]:
        lines.append(f"  WARNING: {RESUME_FROM_TRUST.format(source=resume_from)}")
    for relaxation in security_relaxations(manifests):
        lines.append(f"  WARNING: security relaxed (allowSecurityRelaxations): {relaxation}")
    lines.append(f"  rendered    {r.out.relative_to(ROOT)}/values.yaml, ds_config.json, train_config.json, "
                 "manifests.yaml")
    return "\n".join(lines)


# ---------------------------------------------------------------- helm

def release_name(r: Rendered) -> str:
    return release_of(r.settings, r.project)


def helm() -> str:
    found = shutil.which("helm") or shutil.which("helm", path=str(ROOT / ".tools" / "bin"))
    if not found:
        raise DeployError("helm not found: run `make setup`")
    return found


def helm_args(r: Rendered, context: str | None) -> list[str]:
    args = ["--namespace", r.settings["deploy"]["namespace"]]
    return args + (["--kube-context", context] if context else [])


def run(cmd: list[str], dry_run: bool = False, env: dict | None = None) -> int:
    print("+ " + shlex.join(cmd), flush=True)
    return 0 if dry_run else subprocess.run(cmd, env=env).returncode


def helm_message(stderr: str) -> str:
    """helm's error on one line: without its "Error:" prefixes, template positions and --debug hint."""
    lines = []
    for line in stderr.splitlines():
        line = re.sub(r"^Error: (execution error at \([^)]*\): )?", "", line.strip())
        if line and not line.startswith("Use --debug") and line != "deepspeed-training:":
            lines.append(line.lstrip("- "))
    return "; ".join(lines)


def blame(origin: dict, prefix: tuple, message: str) -> list[str]:
    """['chart.x.y from values/a.yaml', ...] for the keys under `prefix` that an error message names (as
    x.y, or helm 4's /x/y), so the message can name the layer to fix."""
    named = []
    for path, source in origin.items():
        if path[:len(prefix)] == prefix and len(path) > len(prefix):
            key = ".".join(str(p) for p in path[len(prefix):])
            if re.search(rf"(^|[^\w.]){re.escape(key)}([^\w]|$)", message) or \
                    f"/{'/'.join(str(p) for p in path[len(prefix):])}'" in message:
                named.append(f"{'.'.join(path)} from {source}")
    return sorted(named)


def blame_chart_error(r: Rendered, stderr: str) -> str:
    named = blame(r.origin, ("chart",), stderr)
    return f" ({', '.join(named)})" if named else ""


def helm_template(r: Rendered, release: str | None = None, namespace: str | None = None) -> str:
    """The manifests Helm would apply (the chart's own checks run here too); `r` as another release would
    render it."""
    cmd = [helm(), "template", release or release_name(r), str(CHART), "-f", str(r.out / "values.yaml"),
           "--namespace", namespace or r.settings["deploy"]["namespace"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        where = f"{r.out.relative_to(ROOT)}/values.yaml{blame_chart_error(r, proc.stderr)}"
        raise DeployError(f"the chart refuses {where}: {helm_message(proc.stderr)}")
    write_file(r.out / "manifests.yaml", proc.stdout)
    return proc.stdout


def deploy(r: Rendered, context: str | None, dry_run: bool, wait: bool, manifests: str) -> int:
    cmd = [helm(), "upgrade", "--install", release_name(r), str(CHART), "-f", str(r.out / "values.yaml"),
           *helm_args(r, context), "--create-namespace"]
    if wait or r.settings["deploy"]["wait"]:
        cmd += ["--wait", "--timeout", r.settings["deploy"]["timeout"]]
    if dry_run:
        print("DRY_RUN: not applied. It would apply:")
        for doc in yaml.safe_load_all(manifests):
            if doc:
                print(f"  {doc['kind']:<16} {r.settings['deploy']['namespace']}/{doc['metadata']['name']}")
        print(f"  (full manifests: {(r.out / 'manifests.yaml').relative_to(ROOT)})")
    return run(cmd, dry_run)


def demo(r: Rendered, manifests: str) -> int:
    """The rendered program as a local DeepSpeed job, one rank per worker slot: the `deepspeed` command of the
    chart's Job (the launcher's, or in launchMode nossh the workers'), so the chart's program conventions apply,
    with its pod paths pointed at build/."""
    ckpt = BUILD / "demo" / (r.project or "base") / "checkpoints"  # one per project: programs differ
    job = next(doc for doc in yaml.safe_load_all(manifests) if doc and doc["kind"] == "Job")
    launcher = job["spec"]["template"]["spec"]["containers"][0]
    runner = launcher["args"]
    start = next(i for i, arg in enumerate(runner[1:], 1) if arg == "--module" or not arg.startswith("--"))
    chart_env = {e["name"]: e["value"] for e in launcher["env"] if "value" in e}
    local = {chart_env["DS_CONFIG_PATH"]: str(r.out / "ds_config.json"),
             chart_env["DS_TRAIN_CONFIG_PATH"]: str(r.out / "train_config.json"),
             chart_env["DS_CHECKPOINT_DIR"]: str(ckpt),
             IMAGE_EXAMPLES: str(ROOT / "examples")}
    program = []
    for arg in runner[start:]:
        for pod_path, local_path in local.items():
            arg = arg.replace(pod_path, local_path)
        program.append(arg)
    cmd = ["deepspeed", "--num_gpus", str(r.world_size), *program]
    env = dict(os.environ)
    for item in r.effective["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
    env["DEEPSPEED_TIMEOUT"] = chart_env["DEEPSPEED_TIMEOUT"]  # the one collective timeout, as the pods get it
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"demo: world size {r.world_size} on this machine ({r.world_size} CPU ranks)", flush=True)
    if not shutil.which("deepspeed"):
        raise DeployError("deepspeed is not on PATH: run `make setup`, then `make demo` (the Makefile adds .venv/bin)")
    code = run(cmd, env=env)
    if code == 0:
        print(f"demo: done; checkpoints in {ckpt.relative_to(ROOT)}. A rerun resumes from the last checkpoint; "
              f"`rm -rf {ckpt.relative_to(ROOT)}` starts over.")
    return code


def status(r: Rendered, context: str | None, dry_run: bool, manifests: str) -> int:
    """Where the release's run stands: its progress ConfigMap (the chart's progress sidecars keep it), read with
    the kubernetes client."""
    names = [doc["metadata"]["name"] for doc in yaml.safe_load_all(manifests)
             if doc and doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-progress")]
    if not names:
        raise DeployError(f"release {release_name(r)} renders no progress ConfigMap (progress.enabled is false)")
    namespace = r.settings["deploy"]["namespace"]
    print("+ " + shlex.join(["kubectl", *(["--context", context] if context else []), "--namespace", namespace,
                             "get", "configmap", names[0], "-o", "jsonpath={.data.summary}"]), flush=True)
    if dry_run:
        return 0
    from kubernetes import client, config  # noqa: PLC0415 - only for a cluster command
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    try:
        config.load_kube_config(context=context)
        data = client.CoreV1Api().read_namespaced_config_map(names[0], namespace).data or {}
    except ApiException as err:
        raise DeployError(f"{namespace}/{names[0]}: {err.status} {err.reason} (is release {release_name(r)} "
                          "installed?)") from None
    except Exception as err:  # no kubeconfig, no cluster: one line
        raise DeployError(f"cannot read {namespace}/{names[0]}: {type(err).__name__}: {err}") from None
    print(progress_text(data))
    return 0


# What a terminal must not receive from the cluster: control characters (C0, DEL, C1: escape sequences that clear the
# screen, set the window title or write the clipboard with OSC 52), format characters (bidirectional overrides that
# reorder what a person reads) and line or paragraph separators.
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]")


def printable(value, limit: int = 400) -> str:
    """`value` as one line a terminal shows as it is: unprintable characters replaced by `?`, at most `limit`
    characters (an object of the cluster can hold a megabyte in one field)."""
    text = UNPRINTABLE.sub("?", str(value))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def progress_text(data: dict) -> str:
    """The progress ConfigMap's data for a person: its summary line, then every field, each printable()."""
    lines = [printable(data.get("summary", "(no summary yet)"), 1000)]
    lines += [f"  {printable(key, 40):<16} {printable(data[key])}" for key in sorted(k for k in data if k != "summary")]
    return "\n".join(lines)


NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def name_arg(value: str) -> str:
    """ENV and PROJECT name files under values/: plain lower-case names only (they may come from CI)."""
    if not NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a name of lower-case letters, digits and '-'")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deployctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["render", "plan", "template", "deploy", "diff", "undeploy", "demo",
                                            "status"])
    parser.add_argument("--env", required=True, type=name_arg, help="values/<env>.yaml")
    parser.add_argument("--project", default=None, type=name_arg, help="values/projects/<project>/")
    parser.add_argument("--kube-context", default=None, help="must be one of deploy.kubeContexts when that is set")
    parser.add_argument("--dry-run", action="store_true", help="print the helm command and the objects; apply nothing")
    parser.add_argument("--wait", action="store_true", help="helm --wait")
    args = parser.parse_args(argv)
    quiet_deepspeed()
    try:
        r = build(args.env, args.project)
        write(r)
        if args.command == "render":
            print(f"rendered {r.out.relative_to(ROOT)}/values.yaml, ds_config.json, train_config.json")
            return 0
        manifests = helm_template(r)  # the chart's own checks, before any plan, demo or cluster command
        if args.project:
            check_pins(r, manifests)
        if args.command == "demo":
            return demo(r, manifests)
        if args.command == "template":
            sys.stdout.write(manifests)
            return 0
        cluster_cmd = args.command in ("deploy", "diff", "undeploy", "status")
        context = kube_context(r, args.kube_context, need_cluster=cluster_cmd and not args.dry_run)
        if args.command == "status":
            return status(r, context, args.dry_run, manifests)
        print(plan(r, context, manifests), flush=True)
        if args.command == "plan":
            return 0
        if args.command == "deploy":
            return deploy(r, context, args.dry_run, args.wait, manifests)
        if args.command == "diff":
            plugins = subprocess.run([helm(), "plugin", "list"], capture_output=True, text=True).stdout
            if "diff" not in plugins.split():
                raise DeployError("make diff needs the helm-diff plugin (helm plugin install databus23/helm-diff)")
            return run([helm(), "diff", "upgrade", release_name(r), str(CHART), "-f", str(r.out / "values.yaml"),
                        *helm_args(r, context)], args.dry_run)
        return run([helm(), "uninstall", release_name(r), *helm_args(r, context)], args.dry_run)
    except DeployError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a bug of ours, but still one line and a refusal, never a half-applied deploy
        print(f"error: deployctl {args.command} --env {args.env}: internal error {type(err).__name__}: {err} "
              "(please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
