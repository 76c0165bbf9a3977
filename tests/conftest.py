"""Session-wide clean-up: ranks that tests kill on purpose cannot release DeepSpeed's /dev/shm buffers."""

import pytest

from tests.support import ports
from tests.support.glue_tree import tree  # noqa: F401  (the fixture, for every test module)
from tests.support.shm import release_shm_buffers


@pytest.fixture(scope="session", autouse=True)
def release_leftover_shm_buffers():
    yield
    release_shm_buffers(ports.handed_out)


def pytest_sessionfinish(session):
    """The S3 gateway some tests started (tests/support/s3.py) goes with the session: its controller's end, after
    every pytest-xdist worker's."""
    if not hasattr(session.config, "workerinput"):
        from tests.support import s3

        s3.down()
