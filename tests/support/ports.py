"""Ports for the servers that tests and benches start on 127.0.0.1: torch's TCPStore (MASTER_PORT), the progress
sidecar, Prometheus.

A port from bind(("127.0.0.1", 0)) is an ephemeral port: between closing it and the server binding it, any
connect() on the machine (a gloo pair, a TCPStore client retrying, a kubectl) may be handed it as its source
port, and another test's bind(0) may be handed it too. So these come from below the kernel's ephemeral range,
which it never hands out by itself, in a block per pytest-xdist worker (two workers never pick the same port),
each checked free when picked. Clusters use a fixed port the same way (deepspeed.masterPort, 29500)."""

import itertools
import os
import socket
from pathlib import Path

FIRST = 15_000  # blocks of BLOCK ports from here; the last ends below DeepSpeed's default master port (29500)
BLOCK = 1_000
BLOCKS = 14  # 0-7: pytest-xdist workers gw0-gw7; 8-13: any other process (a bench, a plain pytest), by pid


def _block() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) < 8:
        return int(worker[2:])
    return 8 + os.getpid() % (BLOCKS - 8)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


_FIRST_OF_BLOCK = FIRST + _block() * BLOCK
_candidates = itertools.cycle(range(_FIRST_OF_BLOCK, _FIRST_OF_BLOCK + BLOCK))
_EPHEMERAL_ONLY = FIRST + BLOCKS * BLOCK > _ephemeral_start()  # a machine whose ephemeral range starts that low


def _bindable(port: int) -> bool:
    with socket.socket() as probe:  # no SO_REUSEADDR: a port with a listener or a connection on it is refused
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Every port this process has handed out: what names its ranks' /dev/shm buffers (tests/conftest.py).
handed_out: set[int] = set()


def free_port() -> int:
    """A port no other process holds now and none will be handed by the kernel (see the module's doc)."""
    if _EPHEMERAL_ONLY:  # no range is safe there: the old way
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = next((port for port in itertools.islice(_candidates, BLOCK) if _bindable(port)), None)
        if port is None:
            raise RuntimeError(f"no free port in this process's block ({FIRST}-{FIRST + BLOCKS * BLOCK - 1})")
    handed_out.add(port)
    return port
