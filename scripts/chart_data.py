"""Data the chart needs from the code that owns it, generated, never typed twice, from train/deepspeed_mirror.py:
the ds_config top-level keys DeepSpeed reads (TOP_LEVEL_KEYS), which the chart's render-time check refuses others
than, the most hosts DeepSpeed's pdsh runner starts (PDSH_MAX_FAN_OUT), launchMode ssh's limit on workers, and the
env DeepSpeed's launcher sets for every rank (LAUNCHER_ENV), which no user env entry may set.

    python scripts/chart_data.py           # rewrite charts/deepspeed-training/files/generated/
    python scripts/chart_data.py --check   # exit 1 if it is stale
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.deepspeed_mirror import LAUNCHER_ENV, PDSH_MAX_FAN_OUT, TOP_LEVEL_KEYS  # noqa: E402

TARGET = ROOT / "charts" / "deepspeed-training" / "files" / "generated" / "deepspeed.json"


def render() -> str:
    return json.dumps({"generated": "by scripts/chart_data.py from train/deepspeed_mirror.py; do not edit",
                       "topLevelKeys": sorted(TOP_LEVEL_KEYS), "pdshMaxFanOut": PDSH_MAX_FAN_OUT,
                       "launcherEnv": sorted(LAUNCHER_ENV)}, indent=1) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    if parser.parse_args().check:
        if not TARGET.exists() or TARGET.read_text() != render():
            print(f"{TARGET.relative_to(ROOT)} is stale: run python scripts/chart_data.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
