"""A real S3-compatible store for the tests: ../shared/s3/local-s3.sh, Ceph's RADOS Gateway on a one-OSD Ceph (root),
started by the first test process that needs it (the others reuse it, under a lock) and stopped when the last
session using it ends (conftest.py): CI runs the cluster tier beside `make test`, and both use it. Each test makes a
bucket of its own."""

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.chart import pod_program

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


SESSION_ENV = "DS_TEST_S3_SESSION"  # a pytest session (or bench) using it: "<pid>.<start time>" of its controller
STARTED_BY = STATE / "started-by"  # present: a session started it (or found it unclaimed), and the last one stops it
USERS = STATE / "sessions"  # one file per session that used it


def claim_session() -> None:
    os.environ.setdefault(SESSION_ENV, _process_id(os.getpid()) or "")


def _process_id(pid: int) -> str | None:
    """pid and its start time: names one process, never a later one that reuses its pid."""
    try:
        return f"{pid}.{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _alive(session: str) -> bool:
    pid, _, _ = session.partition(".")
    return pid.isdigit() and _process_id(int(pid)) == session


def up() -> dict[str, str]:
    """The running gateway's env file as a dict (AWS_ENDPOINT_URL, the keys, LOCAL_S3_ENDPOINT_FOR_PODS, ...)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = (STATE / "env").is_file()
        for _ in range(3):
            proc = subprocess.run(["bash", str(SCRIPT), "up", str(STATE)], capture_output=True, text=True,
                                  timeout=600)
            if proc.returncode == 0 or not STATE.exists():
                break
            # The state of a gateway that did not stop cleanly (a killed run), or a start that failed (its OSD
            # exits at once, now and then, when the daemons of one just stopped are still going): clear it, once
            # those daemons are gone, and start afresh.
            down()
        if proc.returncode != 0:
            raise RuntimeError(f"local-s3.sh up failed: {proc.stderr[-2000:]}")
        if not running or not STARTED_BY.is_file():
            STARTED_BY.write_text(os.environ.get(SESSION_ENV, ""))
        if session := os.environ.get(SESSION_ENV):
            USERS.mkdir(exist_ok=True)
            (USERS / session).touch()
    env = {}
    for line in (STATE / "env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def leave() -> None:
    """This session is done with the gateway: stopped if this session used it, a session started it, and no other
    live one uses it. A session that never called up() leaves it alone (a `make soak`, a bench, another checkout's
    tests may be using it)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not STATE.exists():
            return
        session = os.environ.get(SESSION_ENV)
        if not session or not (USERS / session).is_file():
            return
        (USERS / session).unlink()
        others = [user.name for user in USERS.glob("*") if _alive(user.name)] if USERS.is_dir() else []
        if STARTED_BY.is_file() and not others:
            down()


def down() -> None:
    """Stops the gateway and removes its state (objects included), whoever uses it."""
    if not STATE.exists():
        return
    daemons = _daemons()
    subprocess.run(["bash", str(SCRIPT), "down", str(STATE)], capture_output=True, timeout=120)
    if STATE.exists():
        # local-s3.sh's down stops at a pid file whose daemon is already gone (set -e on the failed kill): stop what
        # is left and remove the state, as its down would have.
        for pid in daemons:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(STATE, ignore_errors=True)
    # Its down signals the daemons and returns: the next up must not meet them still going.
    deadline = time.monotonic() + 60
    while (alive := [pid for pid in daemons if _is_daemon(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _daemons() -> list[int]:
    """The gateway's daemons, by their pid files."""
    pids = []
    for pidfile in (STATE / "run").glob("*.pid"):
        try:
            pids.append(int(pidfile.read_text().strip()))
        except (ValueError, OSError):
            continue
    return [pid for pid in pids if _is_daemon(pid)]


def _is_daemon(pid: int) -> bool:
    """pid is still one of the gateway's daemons (never a reused pid's process)."""
    try:
        return str(STATE) in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def client(env: dict[str, str]):
    from minio import Minio

    return Minio(env["AWS_ENDPOINT_URL"].split("://")[1], access_key=env["AWS_ACCESS_KEY_ID"],
                 secret_key=env["AWS_SECRET_ACCESS_KEY"], secure=False, region=env["AWS_DEFAULT_REGION"])


def tenant_user(env: dict[str, str], tenant: str, quota_bytes: int | None = None) -> dict[str, str]:
    """A user of its own RGW tenant (`radosgw-admin user create --tenant`: its buckets are its own namespace, the
    same bucket name as another tenant's is another bucket), with a user quota when given: docs/checkpoints.md's
    isolation of namespaces on one gateway. `env` with that user's keys."""
    conf = ["-c", str(STATE / "ceph.conf")]
    tenant = tenant.replace("-", "_")  # RGW's tenant names: letters, digits and _ (a namespace's - becomes _)
    access, secret = uuid.uuid4().hex[:20].upper(), uuid.uuid4().hex
    subprocess.run(["radosgw-admin", *conf, "user", "create", f"--tenant={tenant}", f"--uid={tenant}",
                    f"--display-name={tenant}", f"--access-key={access}", f"--secret-key={secret}"],
                   check=True, capture_output=True, timeout=60)
    if quota_bytes is not None:
        for args in (["quota", "set", "--quota-scope=user", f"--max-size={quota_bytes}"], ["quota", "enable",
                                                                                          "--quota-scope=user"]):
            subprocess.run(["radosgw-admin", *conf, *args, f"--uid={tenant}${tenant}"], check=True, capture_output=True,
                           timeout=60)
    return {**env, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}


def new_bucket(env: dict[str, str], prefix: str = "t") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client(env).make_bucket(name)
    return name


def store_env(env: dict[str, str], bucket: str, *, endpoint: str | None = None, release: str = "ml/job",
              **extra: str) -> dict[str, str]:
    """The environment the chart gives podruntime/objectstore.py (its restore container and the sidecar)."""
    return {"DS_OBJECT_STORE_BUCKET": bucket, "DS_OBJECT_STORE_ENDPOINT": endpoint or env["AWS_ENDPOINT_URL"],
            "DS_OBJECT_STORE_REGION": env["AWS_DEFAULT_REGION"], "DS_OBJECT_STORE_PATH_STYLE": "true",
            "DS_OBJECT_STORE_KEEP": "3", "DS_OBJECT_STORE_CREDENTIALS_SECRET": "ml-checkpoints-s3",
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            "DS_RELEASE": release, **extra}


def worker_env(env: dict[str, str], bucket: str, directory: Path, node: int, nodes: int = 2, **extra: str
               ) -> dict[str, str]:
    """store_env for worker `node` of `nodes` on per-worker volumes (its own `directory`)."""
    return store_env(env, bucket, DS_CHECKPOINT_DIR=str(directory), DS_CHECKPOINT_STORAGE="per-worker",
                     DS_NODE_RANK=str(node), DS_WORKERS=str(nodes), DS_OBJECT_STORE_ROLE="worker", **extra)


def objectstore_argv(command: str) -> list[str]:
    """`objectstore COMMAND` as the restore container runs it (python3 -I <scripts>)."""
    return pod_program("objectstore", command)


def run_objectstore(command: str, env: dict[str, str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """`objectstore COMMAND` with only the chart's env (and PATH); kwargs go to subprocess.run (user=...)."""
    return subprocess.run(objectstore_argv(command), env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def upload_round(env: dict[str, str], rounds: int = 1, **kwargs) -> subprocess.Popen:
    """`rounds` rounds of the sidecar's uploads (objectstore.Uploader.step) in a process of their own, one that a
    test can kill; kwargs go to Popen (stdout=...). Its log lines go to stderr."""
    code = ("from podruntime import objectstore; "
            f"u = objectstore.Uploader(objectstore.Settings()); [u.step() for _ in range({rounds})]")
    return subprocess.Popen([sys.executable, "-I", "-c", code], env={"PATH": os.environ["PATH"], **env}, **kwargs)


def write_data(path: Path, size: int, head: bytes = b"") -> None:
    """A file of `size` bytes of data starting with `head`, none of it a hole (the uploader sends only a file's
    data regions: a file made by truncate() would send nothing)."""
    block = bytes(range(256)) * (64 << 12)  # 16 MiB
    with open(path, "wb") as f:
        f.write(head[:size])
        for offset in range(len(head[:size]), size, len(block)):
            f.write(block[:min(len(block), size - offset)])


def read_so_far(pid: int, path: Path) -> int:
    """Bytes process pid has read of the file at `path`, or of the files it has open under the directory `path`
    (each descriptor's offset); 0 if it has none open."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
            if target == str(path) or target.startswith(f"{path}/"):
                total += int(Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total
