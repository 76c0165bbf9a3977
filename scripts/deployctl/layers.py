"""The layering: base < env < project values, merged as Helm merges -f files; the platform's keys and the
project's by any path (a parent set to null included); one release and one set of object names per project."""

import copy
import json
import math
from pathlib import Path

import jsonschema
import yaml

from scripts.deployctl import common
from scripts.deployctl.common import DeployError, dotted, source_of
from train import yamlfile


def load_yaml(path: Path) -> dict:
    if not path.resolve().is_relative_to(common.VALUES.resolve()):  # a link out of values/ (a tenant's project dir)
        raise DeployError(f"{path.relative_to(common.ROOT)}: links outside values/; layers must be files in values/")
    try:
        return yamlfile.load_mapping(path, str(path.relative_to(common.ROOT)))
    except yamlfile.YamlFileError as err:
        raise DeployError(str(err)) from None


def layer_files(env: str, project: str | None) -> list[Path]:
    envs = sorted(p.stem for p in common.VALUES.glob("*.yaml") if p.stem != "base")
    if env not in envs:
        raise DeployError(f"ENV={env}: no values/{env}.yaml; environments: {', '.join(envs)}")
    files = [common.VALUES / "base.yaml", common.VALUES / f"{env}.yaml"]
    if project:
        projects = sorted(p.name for p in (common.VALUES / "projects").iterdir() if p.is_dir())
        if project not in projects:
            raise DeployError(f"PROJECT={project}: no values/projects/{project}/; projects: {', '.join(projects)}")
        files.append(common.VALUES / "projects" / project / "values.yaml")
        per_env = common.VALUES / "projects" / project / f"{env}.yaml"
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
    ("chart", "checkpoints", "objectStore"): "the bucket checkpoints are uploaded to, and its credentials",
    ("chart", "checkpoints", "resumeFrom"): "starting from another release's checkpoints (per project: "
                                            "deploy.projectResumeFrom)",
    ("deploy", "projectResumeFrom"): "the releases whose checkpoints a project may start from",
    ("deploy", "projectIds"): "the projects' identities, which own their storage",
    ("deploy", "projectAdopts"): "the identities whose storage a project takes over",
    ("chart", "checkpoints", "owner"): "the project's identity (per project: deploy.projectIds)",
    ("chart", "checkpoints", "adoptOwner"): "another project's storage taken over (per project: deploy.projectAdopts)",
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
    chart = copy.deepcopy(common.CHART_DEFAULTS)
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
        name = str(path.relative_to(common.ROOT))
        if path.parent != common.VALUES:
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
    return settings, origin, [str(p.relative_to(common.ROOT)) for p in files]


def release_of(settings: dict, project: str | None) -> str:
    return settings["deploy"].get("release") or project or common.CHART_NAME


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


def other_projects(project: str) -> list[str]:
    """Every project of values/projects/ but `project`, by name."""
    return sorted(p.name for p in (common.VALUES / "projects").iterdir() if p.is_dir() and p.name != project)


def check_release_is_unique(settings: dict, origin: dict, env: str, project: str | None) -> None:
    """Two projects with one release name would replace each other's running job. (Two whose objects share names
    in one namespace are refused on their renders: names.check_names_are_unique.)"""
    if not project:
        return
    mine = release_of(settings, project)
    for other in other_projects(project):
        theirs = release_of(without_nulls(load_layers(env, other)[0]), other)
        if theirs == mine:
            raise DeployError(f"{source_of(origin, ('deploy', 'release'))}: deploy.release {mine!r} is also the "
                              f"release of values/projects/{other}/: releases must be unique (leave deploy.release "
                              "empty to use the project's directory name)")


def check_chart_values(chart: dict, origin: dict) -> dict:
    """The chart's values.schema.json against the chart defaults merged with ours, as Helm checks them;
    returns those effective values."""
    effective = yaml.safe_load((common.CHART / "values.yaml").read_text())
    merge(effective, chart, {}, "")
    effective = without_nulls(effective)
    check_schema(effective, json.loads((common.CHART / "values.schema.json").read_text()), origin, ("chart",),
                 "checked against charts/deepspeed-training/values.schema.json")
    return effective
