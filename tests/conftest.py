"""Session-wide clean-up: ranks that tests kill on purpose cannot release DeepSpeed's /dev/shm buffers."""

from pathlib import Path

import pytest

from tests.glue_tree import tree  # noqa: F401  (the fixture, for every test module)
from train.main import SHM_BUFFER_NAME

SHM = Path("/dev/shm")
PATTERN = f"{SHM_BUFFER_NAME}_*"


def mapped_shm_files() -> set[str]:
    """/dev/shm files some live process maps: the buffers of ranks still running (another pytest -n worker's)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[5].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except (OSError, IndexError):  # the process ended, or a line without a path
            continue
    return mapped


@pytest.fixture(scope="session", autouse=True)
def release_leftover_shm_buffers():
    before = set(SHM.glob(PATTERN))
    yield
    in_use = mapped_shm_files()
    for path in set(SHM.glob(PATTERN)) - before:
        if str(path) not in in_use:
            path.unlink(missing_ok=True)
