"""A real S3-compatible store for the tests: ../shared/s3/local-s3.sh, Ceph's RADOS Gateway on a one-OSD Ceph (root),
started by the first test process that needs it (the others reuse it, under a lock) and stopped when the session
ends (conftest.py). Each test makes a bucket of its own."""

import fcntl
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT.parent / "shared" / "s3" / "local-s3.sh"
STATE = ROOT / ".build" / "s3"
LOCK = ROOT / ".build" / "s3.lock"


def unavailable() -> str | None:
    """Why no store can run here, or None."""
    if not SCRIPT.is_file():
        return f"no {SCRIPT} (the shared S3 gateway)"
    if os.geteuid() != 0:
        return "the local S3 gateway needs root"
    return None


SESSION_ENV = "DS_TEST_S3_SESSION"  # the pytest session (or bench) that started the gateway
STARTED_BY = STATE / "started-by"


def claim_session() -> None:
    os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def up() -> dict[str, str]:
    """The running gateway's env file as a dict (AWS_ENDPOINT_URL, the keys, LOCAL_S3_ENDPOINT_FOR_PODS, ...)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = (STATE / "env").is_file()
        proc = subprocess.run(["bash", str(SCRIPT), "up", str(STATE)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 and STATE.exists():
            # The state of a gateway that did not stop cleanly (a killed run): clear it and start afresh once.
            down()
            proc = subprocess.run(["bash", str(SCRIPT), "up", str(STATE)], capture_output=True, text=True,
                                  timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"local-s3.sh up failed: {proc.stderr[-2000:]}")
        if not running or not STARTED_BY.is_file():
            STARTED_BY.write_text(os.environ.get(SESSION_ENV, ""))
    env = {}
    for line in (STATE / "env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def down(only_if_started_by_this_session: bool = False) -> None:
    if not STATE.exists():
        return
    if only_if_started_by_this_session:
        try:
            if STARTED_BY.read_text() != os.environ.get(SESSION_ENV):
                return
        except OSError:
            return
    subprocess.run(["bash", str(SCRIPT), "down", str(STATE)], capture_output=True, timeout=120)
    if STATE.exists():
        # local-s3.sh's down stops at a pid file whose daemon is already gone (set -e on the failed kill): stop what
        # is left by its pid files and remove the state, as its down would have.
        for pidfile in (STATE / "run").glob("*.pid"):
            try:
                pid = int(pidfile.read_text().strip())
                if str(STATE) in Path(f"/proc/{pid}/cmdline").read_text():  # never a reused pid's process
                    os.kill(pid, signal.SIGKILL)
            except (ValueError, OSError):
                pass
        shutil.rmtree(STATE, ignore_errors=True)


def client(env: dict[str, str]):
    from minio import Minio

    return Minio(env["AWS_ENDPOINT_URL"].split("://")[1], access_key=env["AWS_ACCESS_KEY_ID"],
                 secret_key=env["AWS_SECRET_ACCESS_KEY"], secure=False, region=env["AWS_DEFAULT_REGION"])


def new_bucket(env: dict[str, str], prefix: str = "t") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client(env).make_bucket(name)
    return name


def store_env(env: dict[str, str], bucket: str, *, endpoint: str | None = None, release: str = "ml/job",
              **extra: str) -> dict[str, str]:
    """The environment the chart gives files/objectstore.py (its restore container and the sidecar)."""
    return {"DS_OBJECT_STORE_BUCKET": bucket, "DS_OBJECT_STORE_ENDPOINT": endpoint or env["AWS_ENDPOINT_URL"],
            "DS_OBJECT_STORE_REGION": env["AWS_DEFAULT_REGION"], "DS_OBJECT_STORE_PATH_STYLE": "true",
            "DS_OBJECT_STORE_KEEP": "3", "DS_OBJECT_STORE_CREDENTIALS_SECRET": "ml-checkpoints-s3",
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            "DS_RELEASE": release, **extra}
