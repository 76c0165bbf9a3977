"""The test session's clean-up of DeepSpeed's /dev/shm buffers (tests/conftest.py) touches only its own runs'."""

import mmap
import os

from tests.support.ports import free_port
from tests.support.shm import SHM, SHM_BUFFER_NAME, release_shm_buffers


def test_a_session_releases_only_the_unmapped_buffers_of_its_own_ports():
    own, mapped_port, others = free_port(), free_port(), 65_000 + os.getpid() % 500
    names = {what: SHM / f"{SHM_BUFFER_NAME}_{os.getuid()}_127.0.0.1_{port}_0"
             for what, port in (("own", own), ("mapped", mapped_port), ("another worker's", others))}
    for path in names.values():
        path.write_bytes(b"\0" * 4096)
    try:
        with open(names["mapped"], "r+b") as file, mmap.mmap(file.fileno(), 4096):
            released = release_shm_buffers({own, mapped_port})
        assert released == [names["own"]]
        assert not names["own"].exists()
        assert names["mapped"].exists() and names["another worker's"].exists()
    finally:
        for path in names.values():
            path.unlink(missing_ok=True)
