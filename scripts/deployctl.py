"""The glue between values/ and the chart: layer, derive, render, validate, then hand to Helm.

    python scripts/deployctl.py {render,plan,template,deploy,diff,undeploy,demo} --env ENV [--project NAME]

render writes build/<project>/<env>/{values.yaml,ds_config.json,train_config.json}; every other command
renders first, so nothing reaches a cluster unvalidated. Errors name the file, the key and what was expected.
"""

import argparse
import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the train package: one ds_config check for both (train.dsconfig)

from scripts.jinja_render import TemplateError, render  # noqa: E402
from train import dsconfig  # noqa: E402
from train.config import ConfigError, ModelConfig, from_mapping  # noqa: E402

VALUES, TEMPLATES, BUILD = ROOT / "values", ROOT / "templates", ROOT / "build"
CHART = ROOT / "charts" / "deepspeed-training"
SETTINGS_SCHEMA = Path(__file__).with_name("settings.schema.json")


class DeployError(Exception):
    """Bad configuration or a refused deploy; the message says where and what was expected."""


# ---------------------------------------------------------------- layering

def load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        raise DeployError(f"{path.relative_to(ROOT)}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: "
                          f"{err.problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DeployError(f"{path.relative_to(ROOT)}: expected a mapping at the top level, got {type(data).__name__}")
    return data


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
    """Deep-merges `layer` into `into` (maps merge, everything else replaces) and records in `origin`
    which file set each key path, so errors can name it."""
    for key, value in layer.items():
        here = (*path, key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value, origin, source, here)
        else:
            into[key] = copy.deepcopy(value)
            origin[here] = source


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
    chart: dict
    ds_config: dict
    batch: tuple[int, int, int]
    world_size: int
    out: Path
    sources: list[str]


def check_schema(instance: dict, schema: dict, origin: dict, prefix: tuple, what: str) -> None:
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    lines = []
    for e in errors[:10]:
        path = (*prefix, *e.absolute_path)
        blame = path
        if e.validator == "additionalProperties":  # blame the file that added the unknown key
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            blame = (*path, extra[0]) if extra else path
        lines.append(f"{source_of(origin, blame)}: {dotted(path)}: {e.message}")
    if lines:
        raise DeployError(f"{what}:\n  " + "\n  ".join(lines))


def build(env: str, project: str | None) -> Rendered:
    files = layer_files(env, project)
    settings, origin = {}, {}
    for path in files:
        merge(settings, load_yaml(path), origin, str(path.relative_to(ROOT)))
    sources = [str(p.relative_to(ROOT)) for p in files]
    check_schema(settings, json.loads(SETTINGS_SCHEMA.read_text()), origin, (), "values do not match "
                 "scripts/settings.schema.json")

    ds, chart = settings["deepspeed"], settings["chart"]
    effective = yaml.safe_load((CHART / "values.yaml").read_text())  # Helm checks its defaults merged with ours
    merge(effective, chart, {}, "")
    check_schema(effective, json.loads((CHART / "values.schema.json").read_text()), origin, ("chart",),
                 "chart values do not match charts/deepspeed-training/values.schema.json")
    workers, gpus = chart["worker"]["replicas"], chart["worker"]["gpusPerWorker"]
    world_size = workers * gpus
    micro = ds["microBatch"]
    if ds.get("globalBatch"):
        accum, rest = divmod(ds["globalBatch"], micro * world_size)
        if rest or accum == 0:
            raise DeployError(
                f"{source_of(origin, ('deepspeed', 'globalBatch'))}: deepspeed.globalBatch {ds['globalBatch']} must "
                f"be a multiple of deepspeed.microBatch {micro} x world size {world_size} "
                f"({workers} workers x {gpus} GPUs)")
    else:
        accum = ds["gradientAccumulation"]
    train_config = chart.get("train", {}).get("config", {})
    variables = {"micro_batch": micro, "gradient_accumulation": accum, "global_batch": micro * accum * world_size,
                 "lr": ds["lr"], "weight_decay": ds["weightDecay"], "warmup_steps": ds["warmupSteps"],
                 "gradient_clipping": ds["gradientClipping"], "steps": train_config.get("steps", 100)}
    template = f"ds_config/{ds['preset']}.json.j2"
    preset_source = f"{source_of(origin, ('deepspeed', 'preset'))}: deepspeed.preset {ds['preset']!r}"
    try:
        ds_config = json.loads(render(TEMPLATES, template, variables))
    except TemplateError as err:
        raise DeployError(f"{preset_source}: {err}") from None
    except json.JSONDecodeError as err:
        raise DeployError(f"{preset_source}: templates/{template} did not render JSON: {err}") from None
    merge(ds_config, ds.get("overrides") or {}, {}, "")
    ds_source = f"templates/{template}" + (" + deepspeed.overrides" if ds.get("overrides") else "")
    try:
        batch = dsconfig.validate(ds_config, world_size, ds_source)
    except dsconfig.DsConfigError as err:
        raise DeployError(str(err)) from None

    chart = copy.deepcopy(chart)
    chart.setdefault("deepspeed", {})["config"] = ds_config
    try:  # the train package's own config check, as the pods will run it
        from_mapping({**train_config, "ds_config": "ds_config.json"}, f"{source_of(origin, ('chart', 'train'))}: "
                     "chart.train.config")
    except ConfigError as err:
        raise DeployError(str(err)) from None

    out = BUILD / (project or "base") / env
    return Rendered(env, project, settings, chart, ds_config, batch, world_size, out, sources)


def write(r: Rendered) -> None:
    r.out.mkdir(parents=True, exist_ok=True)
    values = render(TEMPLATES, "values.yaml.j2", {
        "env": r.env, "project": r.project, "sources": r.sources, "chart": r.chart, "world_size": r.world_size,
        "batch": r.batch, "preset": r.settings["deepspeed"]["preset"]})
    (r.out / "values.yaml").write_text(values)
    (r.out / "ds_config.json").write_text(json.dumps(r.ds_config, indent=2) + "\n")
    (r.out / "train_config.json").write_text(json.dumps(r.chart.get("train", {}).get("config", {}), indent=2) + "\n")


# ---------------------------------------------------------------- plan

def memory_estimate(r: Rendered) -> tuple[int, int, int, str]:
    """(parameters, GPU bytes, CPU bytes, how) from DeepSpeed's ZeRO estimators for the configured model."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from train.model import build_model, count_parameters, largest_layer_parameters

    model_values = r.chart.get("train", {}).get("config", {}).get("model", {})
    with torch.device("meta"):  # shapes only: no memory, no time, even for billions of parameters
        model = build_model(ModelConfig(**model_values))
    params = count_parameters(model)
    zero = r.ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    gpus, nodes = r.chart["worker"]["gpusPerWorker"], r.chart["worker"]["replicas"]
    if stage == 3:
        offload_params = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
        cpu, gpu = estimate_zero3_model_states_mem_needs(params, largest_layer_parameters(model), gpus, nodes,
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


def plan(r: Rendered, context: str | None) -> str:
    micro, accum, total = r.batch
    zero = r.ds_config.get("zero_optimization", {})
    precision = "bf16" if r.ds_config.get("bf16", {}).get("enabled") else (
        "fp16" if r.ds_config.get("fp16", {}).get("enabled") else "fp32")
    worker = r.chart["worker"]
    gpu_name = worker.get("gpuResourceName", "nvidia.com/gpu")
    params, gpu_bytes, cpu_bytes, how = memory_estimate(r)
    gib = 1024 ** 3
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    lines = [
        f"plan: ENV={r.env} PROJECT={r.project or '-'} (layers: {', '.join(r.sources)})",
        f"  release     {release_name(r)} in namespace {r.settings['deploy']['namespace']}, kube context "
        f"{context or '(current)'}",
        f"  workers     {worker['replicas']} x {worker['gpusPerWorker']} {gpu_name or 'CPU ranks'} = world size "
        f"{r.world_size}",
        f"  batch       micro {micro} x accumulation {accum} x world {r.world_size} = global {total}",
        f"  deepspeed   preset {r.settings['deepspeed']['preset']}: ZeRO stage {zero.get('stage', 0)}, {precision}, "
        f"optimizer offload {offload}",
        f"  model       {params / 1e6:,.1f}M parameters",
        f"  memory      model states ~{human(gpu_bytes)} per GPU, ~{human(cpu_bytes)} host per node "
        f"({how}; activations come on top)",
    ]
    limit = r.settings["deepspeed"]["gpuMemoryGiB"]
    if gpu_name and gpu_bytes > limit * gib:
        lines.append(f"  WARNING: model states need ~{gpu_bytes / gib:.1f} GiB per GPU but the GPUs have {limit} GiB "
                     "(deepspeed.gpuMemoryGiB): use more GPUs, ZeRO-3 or offload (preset zero3-offload-bf16)")
    lines.append(f"  rendered    {r.out.relative_to(ROOT)}/values.yaml, ds_config.json, train_config.json")
    return "\n".join(lines)


# ---------------------------------------------------------------- helm

def release_name(r: Rendered) -> str:
    return r.settings["deploy"]["release"] or r.project or "deepspeed-training"


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


def helm_template(r: Rendered) -> str:
    """The manifests Helm would apply (the chart's own checks run here too)."""
    cmd = [helm(), "template", release_name(r), str(CHART), "-f", str(r.out / "values.yaml"),
           *helm_args(r, None)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeployError(f"helm template of {r.out.relative_to(ROOT)}/values.yaml failed:\n{proc.stderr.strip()}")
    (r.out / "manifests.yaml").write_text(proc.stdout)
    return proc.stdout


def deploy(r: Rendered, context: str | None, dry_run: bool, wait: bool) -> int:
    manifests = helm_template(r)
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


def demo(r: Rendered) -> int:
    """The rendered ds_config and train arguments as a local DeepSpeed job: one rank per worker slot."""
    ckpt = BUILD / "demo" / "checkpoints"
    cmd = ["deepspeed", "--num_gpus", str(r.world_size), "--module", r.chart.get("train", {}).get("module", "train"),
           f"--ds-config={r.out / 'ds_config.json'}", f"--config={r.out / 'train_config.json'}",
           f"--checkpoint-dir={ckpt}", *r.chart.get("train", {}).get("args", [])]
    env = dict(os.environ)
    for item in r.chart.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"demo: world size {r.world_size} on this machine ({r.world_size} CPU ranks)", flush=True)
    if not shutil.which("deepspeed"):
        raise DeployError("deepspeed is not on PATH: run `make setup`, then `make demo` (the Makefile adds .venv/bin)")
    code = run(cmd, env=env)
    if code == 0:
        print(f"demo: done; checkpoints and metrics.json in {ckpt.relative_to(ROOT)}. A rerun resumes from the last "
              f"checkpoint; `rm -rf {ckpt.parent.relative_to(ROOT)}` starts over.")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deployctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["render", "plan", "template", "deploy", "diff", "undeploy", "demo"])
    parser.add_argument("--env", required=True, help="values/<env>.yaml")
    parser.add_argument("--project", default=None, help="values/projects/<project>/")
    parser.add_argument("--kube-context", default=None, help="must be one of deploy.kubeContexts when that is set")
    parser.add_argument("--dry-run", action="store_true", help="print the helm command and the objects; apply nothing")
    parser.add_argument("--wait", action="store_true", help="helm --wait")
    args = parser.parse_args(argv)
    try:
        r = build(args.env, args.project)
        write(r)
        if args.command == "render":
            print(f"rendered {r.out.relative_to(ROOT)}/values.yaml, ds_config.json, train_config.json")
            return 0
        if args.command == "demo":
            return demo(r)
        cluster_cmd = args.command in ("deploy", "diff", "undeploy")
        context = kube_context(r, args.kube_context, need_cluster=cluster_cmd and not args.dry_run)
        if args.command == "plan":
            print(plan(r, context))
            return 0
        if args.command == "template":
            sys.stdout.write(helm_template(r))
            return 0
        print(plan(r, context), flush=True)
        if args.command == "deploy":
            return deploy(r, context, args.dry_run, args.wait)
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


if __name__ == "__main__":
    sys.exit(main())
