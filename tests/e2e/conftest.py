"""Fixtures of the e2e tier."""

import pytest

from tests.e2e.chart_pods import UID
from tests.e2e.harness import ensure_user, prebuilt_ops_for_pods


@pytest.fixture(scope="module")
def shared_dir():
    """The pods' user, and the prebuilt DeepSpeed ops opened to it (TORCH_EXTENSIONS_DIR of the e2e values)."""
    ensure_user(UID, "/home/deepspeed")
    return prebuilt_ops_for_pods(UID)
