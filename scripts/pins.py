"""Prints the versions pyproject.toml holds, the one place they are written: `python3 scripts/pins.py torch`
prints `2.13.0`, `python3 scripts/pins.py version` the project's own (the chart's and the images' tags). Used by
scripts/setup.sh, scripts/image.sh (and through it docker/Dockerfile*), scripts/test-cluster.sh, the Makefile and
scripts/chart_data.py (Chart.yaml)."""

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pins() -> dict[str, str]:
    """Every `==` pin, and the project's own version as `version`."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {**dict(r.split("==", 1) for r in requirements if "==" in r), "version": project["version"]}


if __name__ == "__main__":
    found = pins()
    missing = [name for name in sys.argv[1:] if name not in found]
    if missing:
        sys.exit(f"pins.py: no == pin for {', '.join(missing)} in {PYPROJECT.name}")
    print(" ".join(found[name] for name in sys.argv[1:]))
