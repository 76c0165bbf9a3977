"""What every part of the glue shares: where things are (the tests point them at a copy of values/), the one error
type (a message naming the file, the key and what was expected), and the layer that set a key."""

import os
import re
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
VALUES, TEMPLATES, BUILD = ROOT / "values", ROOT / "templates", ROOT / "build"
CHART = ROOT / "charts" / "deepspeed-training"
SETTINGS_SCHEMA = ROOT / "scripts" / "settings.schema.json"
CHART_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_NAME = yaml.safe_load((CHART / "Chart.yaml").read_text())["name"]
IMAGE_EXAMPLES = "/opt/deepspeed-examples"  # where docker/Dockerfile.hf puts examples/; the demo runs them from here
# libyaml's parser where PyYAML has it (its wheels do): the same documents, 18x faster on a release's manifests
# (0.11 s -> 0.006 s for the example's), which one command reads several times and the tests thousands of times.
_MANIFEST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def manifest_docs(manifests: str) -> list:
    """The documents of a render (helm template's output), empty ones left out."""
    return [doc for doc in yaml.load_all(manifests, Loader=_MANIFEST_LOADER) if doc]


class DeployError(Exception):
    """Bad configuration or a refused deploy; the message says where and what was expected."""


def source_of(origin: dict, path) -> str:
    """The file that set `path` or its nearest parent."""
    path = tuple(path)
    while path and path not in origin:
        path = path[:-1]
    return origin.get(path, "values/base.yaml")


def dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


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
