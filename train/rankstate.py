"""This rank's state, for the chart's kill-ranks.sh (charts/deepspeed-training/files/kill-ranks.sh), which stops
the ranks of a pod: `starting` until the first step of this run ends (nothing new to save: killed at once),
`training`, and `stopping` once SIGTERM reached the Python handler (it saves at the next step: it gets the
grace period). A rank stuck in a C++ collective never runs that handler, so it stays `training` and is killed
after a short wait instead of holding the pod for the whole grace period. One file per rank,
$DS_RANK_STATE_DIR/<pid>; nothing when the chart did not set DS_RANK_STATE_DIR (local runs, tests).
"""

import os
from pathlib import Path

STATES = ("starting", "training", "stopping")  # the words kill-ranks.sh reads


def _path() -> Path | None:
    directory = os.environ.get("DS_RANK_STATE_DIR")
    return Path(directory) / str(os.getpid()) if directory else None


def report(state: str) -> None:
    """Atomically replaces this rank's state; safe in a signal handler. Errors are ignored: the state only
    shortens a shutdown, and a rank without one gets the full grace period."""
    assert state in STATES, state
    path = _path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(state)
        os.replace(tmp, path)
    except OSError:
        pass


def clear() -> None:
    path = _path()
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass
