"""Session-wide clean-up: ranks that tests kill on purpose cannot release DeepSpeed's /dev/shm buffers."""

from pathlib import Path

import pytest

from tests.glue_tree import tree  # noqa: F401  (the fixture, for every test module)
from train.main import SHM_BUFFER_NAME

SHM = Path("/dev/shm")
PATTERN = f"{SHM_BUFFER_NAME}_*"


@pytest.fixture(scope="session", autouse=True)
def release_leftover_shm_buffers():
    before = set(SHM.glob(PATTERN))
    yield
    for path in set(SHM.glob(PATTERN)) - before:
        path.unlink(missing_ok=True)
