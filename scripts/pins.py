"""Prints the versions pyproject.toml pins, the one place they are written: `python3 scripts/pins.py torch`
prints `2.13.0`. Used by scripts/setup.sh and scripts/image.sh (and through it docker/Dockerfile)."""

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pins() -> dict[str, str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return dict(r.split("==", 1) for r in requirements if "==" in r)


if __name__ == "__main__":
    found = pins()
    missing = [name for name in sys.argv[1:] if name not in found]
    if missing:
        sys.exit(f"pins.py: no == pin for {', '.join(missing)} in {PYPROJECT.name}")
    print(" ".join(found[name] for name in sys.argv[1:]))
