"""Fixtures of the e2e tier."""

import pytest

from tests.support.chart_pods import UID
from tests.support.harness import ensure_user, prebuilt_ops_for_pods


@pytest.fixture(scope="module")
def shared_dir():
    """The pods' user, and the prebuilt DeepSpeed ops opened to it (TORCH_EXTENSIONS_DIR of the e2e values)."""
    ensure_user(UID, "/home/deepspeed")
    return prebuilt_ops_for_pods(UID)
