"""Session-wide clean-up: ranks that tests kill on purpose cannot release DeepSpeed's /dev/shm buffers."""

import threading

import pytest

from tests.support import ports
from tests.support.glue_tree import tree  # noqa: F401  (the fixture, for every test module)
from tests.support.shm import release_shm_buffers


@pytest.fixture(scope="session")
def trained_on_worker_volumes(tmp_path_factory):
    """One run of train_run.train_on_worker_volumes for every test of the session (pytest-xdist worker) that reads
    it: the per-worker storage tests and the object store's."""
    from tests.support.train_run import train_on_worker_volumes

    return train_on_worker_volumes(tmp_path_factory.mktemp("worker-volumes"))


@pytest.fixture(scope="session", autouse=True)
def release_leftover_shm_buffers():
    yield
    release_shm_buffers(ports.handed_out)


def pytest_configure(config):
    """The session's id, which its pytest-xdist workers inherit: the S3 gateway is stopped by the last session
    using it, never under another one running beside it (CI runs the cluster tier beside `make test`)."""
    if not hasattr(config, "workerinput"):
        from tests.support import s3

        s3.claim_session()
        if config.args_source == pytest.Config.ArgsSource.TESTPATHS and s3.unavailable() is None:
            # The whole suite: the gateway starts (15-25 s) while the first tests run, not when the first test that
            # needs it does (its up() then waits on the lock, or finds it running).
            threading.Thread(target=_start_early, args=(s3,), daemon=True, name="s3-up").start()


def _start_early(s3) -> None:
    try:
        s3.up()
    except Exception:  # noqa: BLE001 - the first test that needs it starts it again and reports why it cannot
        pass


def pytest_sessionfinish(session):
    """This session is done with the S3 gateway (tests/support/s3.py), at its controller's end, after every
    pytest-xdist worker's: the last session using it stops it."""
    if not hasattr(session.config, "workerinput"):
        from tests.support import s3

        s3.leave()
