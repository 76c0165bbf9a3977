"""Data the chart needs from the code that owns it, generated, never typed twice:
- from train/deepspeed_mirror.py (deepspeed.json): the ds_config top-level keys DeepSpeed reads (TOP_LEVEL_KEYS),
  which the chart's render-time check refuses others than, the most hosts DeepSpeed's pdsh runner starts
  (PDSH_MAX_FAN_OUT), launchMode ssh's limit on workers, and the env DeepSpeed's launcher sets for every rank
  (LAUNCHER_ENV), which no user env entry may set;
- from train/conventions.py (conventions.json): the options each train.argsConvention passes, and every spelling
  the program's parser takes for what the chart owns, which train.args may not repeat;
- from podruntime/protocol.py, the pods' run-time protocol (protocol.json): the constants the templates need (the
  Job's failure policy, the version the chart's pod programs speak, the paths the probes read), and from
  podruntime/sidecar.py the most metric samples a pod serves (the PodMonitor's sampleLimit). The pod runtime
  itself is no copy: the chart ships its source, files/podruntime/, which train/ and the glue import;
- from pyproject.toml (scripts/pins.py): Chart.yaml's `version` and `appVersion`, the project's version.

    python scripts/chart_data.py           # rewrite charts/deepspeed-training/files/generated/
    python scripts/chart_data.py --check   # exit 1 if it is stale
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podruntime import protocol  # noqa: E402
from podruntime.rankstart import LAUNCHER_ENV  # noqa: E402
from podruntime.sidecar import sample_bound  # noqa: E402
from scripts.pins import pins  # noqa: E402
from train import conventions  # noqa: E402
from train.deepspeed_mirror import PDSH_MAX_FAN_OUT, TOP_LEVEL_KEYS  # noqa: E402

CHART = ROOT / "charts" / "deepspeed-training"
GENERATED = CHART / "files" / "generated"


def deepspeed_json() -> str:
    return json.dumps({"generated": "by scripts/chart_data.py from train/deepspeed_mirror.py and "
                                    "podruntime/rankstart.py; do not edit",
                       "topLevelKeys": sorted(TOP_LEVEL_KEYS), "pdshMaxFanOut": PDSH_MAX_FAN_OUT,
                       "launcherEnv": sorted(LAUNCHER_ENV)}, indent=1) + "\n"


def conventions_json() -> str:
    return json.dumps({"generated": "by scripts/chart_data.py from train/conventions.py; do not edit",
                       "conventions": conventions.generated()}, indent=1) + "\n"


def chart_yaml() -> str:
    """Chart.yaml with the project's version in `version` and `appVersion` (Helm reads only the file)."""
    version = pins()["version"]
    lines = (CHART / "Chart.yaml").read_text().splitlines(keepends=True)
    return "".join(f"version: {version}\n" if line.startswith("version:")
                   else f'appVersion: "{version}"\n' if line.startswith("appVersion:") else line for line in lines)


TARGETS = {CHART / "Chart.yaml": chart_yaml,
           GENERATED / "deepspeed.json": deepspeed_json, GENERATED / "conventions.json": conventions_json,
           GENERATED / "protocol.json": lambda: json.dumps({
               "generated": "by scripts/chart_data.py from podruntime/protocol.py and podruntime/sidecar.py; do "
                            "not edit",
               **protocol.chart_constants(), "metricSamples": sample_bound()}, indent=1) + "\n"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    check = parser.parse_args().check
    stale = []
    for target, render in TARGETS.items():
        text = render()
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(str(target.relative_to(ROOT)))
        else:
            target.write_text(text)
    if stale:
        print(f"{', '.join(stale)} stale: run python scripts/chart_data.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
