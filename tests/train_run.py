"""Runs the train package for real on CPU ranks (gloo): N rank processes with the env DeepSpeed's launcher sets."""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".build" / "torch_extensions")),
               PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    return env


def write_ds_config(tmp: Path, config: dict, name: str = "ds_config.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(config))
    return path


class Ranks:
    """`ranks` processes of `python -m train` in one process group, their output merged into one pipe, with the
    env DeepSpeed's launcher gives each rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*): the ranks a `deepspeed
    --num_gpus N` run starts, without its runner's and launch.py's two Python start-ups (~3 s each, importing
    torch and DeepSpeed). The e2e and cluster tiers run the real launcher. Popen-like: pid (the process group),
    stdout, communicate(), returncode (0, or the first failing rank's status)."""

    def __init__(self, args: list[str], ranks: int):
        read, write = os.pipe()
        env = {**train_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
               "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1"}
        self.processes: list[subprocess.Popen] = []
        for rank in range(ranks):
            group = self.processes[0].pid if self.processes else 0
            self.processes.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "train", f"--local_rank={rank}", *args], cwd=ROOT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=write, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, process_group=group))
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


def launch(args: list[str], ranks: int = 2) -> Ranks:
    return Ranks(args, ranks)


def run_train(args: list[str], ranks: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """The whole run; stdout holds every rank's output."""
    process = launch(args, ranks)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, _ = process.communicate()
        raise AssertionError(f"train run timed out after {timeout}s:\n{out[-5000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out)


def run_single(args: list[str], timeout: float = 120, **env_extra: str) -> subprocess.CompletedProcess:
    """One rank without the launcher (`python -m train` with a world of 1): fast, for error paths."""
    env = train_env()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               **env_extra)
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def metrics(ckpt_dir: Path) -> dict:
    return json.loads((ckpt_dir / "metrics.json").read_text())
