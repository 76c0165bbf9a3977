"""values/ layers hold deltas only: no key repeats the value it would inherit (the chart's default, the train
package's default, or an earlier layer's), so a change in one place is never silently shadowed by a copy."""

import dataclasses

import pytest
import yaml

from scripts import deployctl
from tests.support.chart import CHART, ROOT
from train.config import TrainConfig

VALUES = ROOT / "values"
ENVS = sorted(p.stem for p in VALUES.glob("*.yaml") if p.stem != "base")
PROJECTS = sorted(p.name for p in (VALUES / "projects").iterdir() if p.is_dir())


def defaults() -> dict:
    """What the base layer inherits: the chart's values.yaml and the train package's config defaults."""
    train = {f.name: f.default for f in dataclasses.fields(TrainConfig) if not dataclasses.is_dataclass(f.type)
             and f.default is not dataclasses.MISSING}
    chart = yaml.safe_load((CHART / "values.yaml").read_text())
    chart["train"]["config"] = train
    return {"chart": chart}


def merged(*files) -> dict:
    out = defaults()
    for path in files:
        deployctl.merge(out, yaml.safe_load(path.read_text()) or {}, {}, "")
    return out


def repeats(layer: dict, parents: list[dict], path=()) -> list[str]:
    """Leaves of `layer` equal to the same leaf in every parent."""
    found = []
    for key, value in layer.items():
        here = (*path, key)
        if isinstance(value, dict):
            found += repeats(value, [p.get(key, {}) if isinstance(p.get(key), dict) else {} for p in parents], here)
        elif all(isinstance(p, dict) and key in p and p[key] == value for p in parents):
            found.append(".".join(map(str, here)))
    return found


def layers():
    yield "values/base.yaml", VALUES / "base.yaml", [defaults()]
    for env in ENVS:
        yield f"values/{env}.yaml", VALUES / f"{env}.yaml", [merged(VALUES / "base.yaml")]
    for project in PROJECTS:
        folder = VALUES / "projects" / project
        yield (f"values/projects/{project}/values.yaml", folder / "values.yaml",
               [merged(VALUES / "base.yaml", VALUES / f"{env}.yaml") for env in ENVS])
        for env in ENVS:
            if (folder / f"{env}.yaml").exists():
                yield (f"values/projects/{project}/{env}.yaml", folder / f"{env}.yaml",
                       [merged(VALUES / "base.yaml", VALUES / f"{env}.yaml", folder / "values.yaml")])


@pytest.mark.parametrize("name,path,parents", list(layers()), ids=[name for name, _, _ in layers()])
def test_a_layer_holds_only_deltas(name, path, parents):
    layer = yaml.safe_load(path.read_text()) or {}
    assert repeats(layer, parents) == [], f"{name} repeats what it inherits: {repeats(layer, parents)}"
