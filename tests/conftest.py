"""Session-wide clean-up: ranks that tests kill on purpose cannot release DeepSpeed's /dev/shm buffers."""

import pytest

from tests.support import ports
from tests.support.glue_tree import tree  # noqa: F401  (the fixture, for every test module)
from tests.support.shm import release_shm_buffers


@pytest.fixture(scope="session", autouse=True)
def release_leftover_shm_buffers():
    yield
    release_shm_buffers(ports.handed_out)


def pytest_configure(config):
    """The session's id, which its pytest-xdist workers inherit: the S3 gateway is stopped by the session that
    started it, never by another one running beside it."""
    if not hasattr(config, "workerinput"):
        from tests.support import s3

        s3.claim_session()


def pytest_sessionfinish(session):
    """The S3 gateway this session started (tests/support/s3.py) goes with it: its controller's end, after every
    pytest-xdist worker's."""
    if not hasattr(session.config, "workerinput"):
        from tests.support import s3

        s3.down(only_if_started_by_this_session=True)
