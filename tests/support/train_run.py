"""Runs the train package for real on CPU ranks (gloo): N rank processes with the env DeepSpeed's launcher sets."""

import atexit
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support.ports import free_port
from train import checkpoint

ROOT = Path(__file__).resolve().parents[2]
# The ranks' env starts from this process's env as the session began. Tests call the glue and the config check in
# this process, and they set DS_ACCELERATOR for DeepSpeed's import (deployctl.quiet_deepspeed, preflight.check):
# read at each run instead, one such test made every later rank in the worker differ from the zygote in an
# import-time variable, so each became a fresh interpreter (test_train_layouts: 20 s -> 93 s).
SESSION_ENV = dict(os.environ)


def cpu_ds_config(stage: int = 2, micro: int = 4, accum: int | None = 1, **extra) -> dict:
    """fp32 (bf16 is 36x slower on these CPUs) with torch's AdamW (no fused_adam JIT build).
    accum=None leaves gradient_accumulation_steps for DeepSpeed to derive."""
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if accum is None:
        del config["gradient_accumulation_steps"]
    config.update(extra)
    return config


def train_env() -> dict:
    env = dict(SESSION_ENV)
    # PYTHONFAULTHANDLER: a rank killed by a signal (a crash, or stop_with_stacks) prints every thread's stack.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".build" / "torch_extensions")),
               PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    return env


def write_ds_config(tmp: Path, config: dict, name: str = "ds_config.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(config))
    return path


class ForkedRank:
    """A rank forked by the zygote (tests/support/rank_zygote.py): Popen's pid, poll() and wait()."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid, self.returncode = conn, pid, None
        self._buffer = b""

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                while b"\n" not in self._buffer:
                    data = self.conn.recv(4096)
                    if not data:
                        raise RuntimeError(f"the rank zygote went away before rank {self.pid} ended")
                    self._buffer += data
            except (TimeoutError, BlockingIOError):
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout) from None
            self.returncode = json.loads(self._buffer.split(b"\n")[0])["status"]
            self.conn.close()
        return self.returncode


class Zygote:
    """The zygote of this test session, started at its first use; None when it cannot start (then every rank is
    a fresh process)."""

    _instance: "Zygote | None" = None
    _failed = False

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ds-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.env = train_env()
        self.process = subprocess.Popen([sys.executable, "-u", str(Path(__file__).with_name("rank_zygote.py")),
                                         self.path], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the rank zygote did not start")
            time.sleep(0.05)
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "Zygote | None":
        if cls._instance is None and not cls._failed:
            try:
                cls._instance = cls()
            except (OSError, RuntimeError) as err:
                cls._failed = True
                print(f"train_run: no rank zygote ({err}); every rank is a fresh process", file=sys.stderr)
        return cls._instance

    def serves(self, env: dict) -> bool:
        from tests.support.rank_zygote import IMPORT_TIME_ENV

        return self.process.poll() is None and all(env.get(k) == self.env.get(k) for k in IMPORT_TIME_ENV)

    def fork(self, args: list[str], env: dict, out_fd: int, pgid: int) -> "ForkedRank | None":
        """The forked rank; None when the zygote no longer answers (nothing was sent: the caller starts the rank
        as a fresh process, and every later rank too)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
        except OSError as err:
            conn.close()
            print(f"train_run: the rank zygote no longer answers ({err}); every rank is a fresh process",
                  file=sys.stderr)
            Zygote._failed, Zygote._instance = True, None
            self.close()
            return None
        request = {"argv": list(args), "env": env, "cwd": str(ROOT), "pgid": pgid}
        socket.send_fds(conn, [json.dumps(request).encode()], [out_fd])
        answer = b""
        while b"\n" not in answer:
            data = conn.recv(4096)
            if not data:
                raise RuntimeError("the rank zygote closed the connection")
            answer += data
        first, _, rest = answer.partition(b"\n")
        rank = ForkedRank(conn, json.loads(first)["pid"])
        rank._buffer = rest
        return rank

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_rank(args: list[str], env: dict, out_fd: int, group: int):
    """One rank process running `python -m train ARGS`: forked by the zygote when it can serve this env, else a
    fresh interpreter. Its output goes to out_fd; it joins process group `group` (0: its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft != 0:  # stop_with_stacks aborts ranks: no multi-GB core files in the repository
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    zygote = Zygote.get()
    if zygote is not None and zygote.serves(env) and (forked := zygote.fork(args, env, out_fd, group)) is not None:
        return forked
    return subprocess.Popen([sys.executable, "-u", "-m", "train", *args], cwd=ROOT, env=env, stdout=out_fd,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=group)


class Ranks:
    """Rank processes of `python -m train` in one process group, their output merged into one pipe (launch()
    gives them the env DeepSpeed's launcher gives each rank: the ranks a `deepspeed --num_gpus N` run starts,
    without its runner's and launch.py's two Python start-ups, ~3 s each). The e2e and cluster tiers run the
    real launcher. Popen-like: pid (the process group), stdout, communicate(), returncode (0, or the first
    failing rank's status)."""

    def __init__(self, args: list[str], ranks: list[tuple[list[str], dict]]):
        """`ranks`: each rank's (arguments, env)."""
        read, write = os.pipe()
        self.processes = []
        for rank_args, env in ranks:
            group = self.processes[0].pid if self.processes else 0
            self.processes.append(start_rank(rank_args, env, write, group))
        os.close(write)
        self.pid = self.processes[0].pid
        self.args = args
        self.stdout = os.fdopen(read, "r", errors="replace")
        self.returncode = None
        self._reader, self._rest = None, []

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The rest of the merged output once every rank has closed it; then the ranks' exit status. After a
        TimeoutExpired, kill the group and call it again for the output."""
        if self._reader is None:
            self._reader = threading.Thread(target=lambda: self._rest.append(self.stdout.read()), daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = next((code for code in (p.wait() for p in self.processes) if code != 0), 0)
        return self._rest[0], None


def launch_argv_env(args: list[str], ranks: int = 2, env_extra: dict | None = None) -> list[tuple[list[str], dict]]:
    """Each rank's (arguments, env), as DeepSpeed's launcher gives them on one node (and `env_extra`: what the
    chart's pod scripts add, e.g. DS_RANK_STATE_DIR and DS_RUN_ID)."""
    env = {**train_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
           "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1", **(env_extra or {})}
    return [([f"--local_rank={rank}", *args], {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(ranks)]


def launch(args: list[str], ranks: int = 2, env_extra: dict | None = None) -> Ranks:
    return Ranks(args, launch_argv_env(args, ranks, env_extra))


def stop_with_stacks(process: Ranks) -> str:
    """Ends ranks that ran past their time and returns their output, which then ends with each rank's Python
    stacks: SIGABRT runs faulthandler (PYTHONFAULTHANDLER, train_env), which prints every thread's stack even
    while the rank is blocked in C++ (a collective, a rendezvous); SIGKILL for any rank still there after 10 s."""
    os.killpg(process.pid, signal.SIGABRT)
    try:
        out, _ = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
    return out


def run_train(args: list[str], ranks: int = 2, timeout: float = 240, env_extra: dict | None = None
              ) -> subprocess.CompletedProcess:
    """The whole run; stdout holds every rank's output."""
    process = launch(args, ranks, env_extra)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = stop_with_stacks(process)
        raise AssertionError(f"train run timed out after {timeout}s; its output, each rank's stacks last:\n"
                             f"{out[-12000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out)


def run_single(args: list[str], timeout: float = 120, **env_extra: str) -> subprocess.CompletedProcess:
    """One rank without the launcher (`python -m train` with a world of 1): fast, for error paths."""
    env = train_env()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               **env_extra)
    process = Ranks(args, [(list(args), env)])  # one rank, this env exactly
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, "")


def metrics(ckpt_dir: Path) -> dict:
    return json.loads((ckpt_dir / "metrics.json").read_text())


def run_per_worker(args: list[str], dirs: list, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m train ARGS` as one rank on each of len(dirs) workers with per-worker checkpoint volumes: rank r
    is local rank 0 of node r, as DeepSpeed's launcher starts it on host r, and saves into dirs[r], which no other
    rank sees (DS_CHECKPOINT_STORAGE per-worker)."""
    env = {**train_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(len(dirs)),
           "LOCAL_SIZE": "1", "CROSS_SIZE": str(len(dirs)), checkpoint.STORAGE_ENV: checkpoint.PER_WORKER}
    ranks = [(["--local_rank=0", *args, "--checkpoint-dir", str(d)],
              {**env, "RANK": str(r), "LOCAL_RANK": "0", "CROSS_RANK": str(r)}) for r, d in enumerate(dirs)]
    process = Ranks(args, ranks)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
    return subprocess.CompletedProcess(args, process.returncode, out, "")


# The small GPT most train-package tests run (about 0.12M parameters: a step in milliseconds on a CPU rank).
TINY = ["--model.n-layer", "2", "--model.d-model", "64", "--model.seq-len", "32"]


def train_on_worker_volumes(tmp: Path) -> tuple[Path, list[Path]]:
    """16 steps on two workers' own volumes (ZeRO-2, checkpoints every 4: 8, 12 and 16 kept): (its ds_config, each
    worker's directory). Callers read it or copy it, never change it."""
    ds_config = write_ds_config(tmp, cpu_ds_config(stage=2, micro=2, accum=2,
                                                   checkpoint={"use_node_local_storage": True}))
    dirs = [tmp / "worker-0", tmp / "worker-1"]
    result = run_per_worker(["--ds-config", str(ds_config), "--steps", "16", "--checkpoint-every", "4", *TINY], dirs)
    assert result.returncode == 0, result.stdout[-4000:]
    return ds_config, dirs
