"""Fixtures of the drills: the e2e tier's (the pods' user, and the prebuilt ops opened to it)."""

from tests.e2e.conftest import shared_dir  # noqa: F401
