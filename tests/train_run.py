"""Runs the train package for real: `deepspeed --num_gpus N --module train ...` on CPU ranks (gloo)."""

import json
import os
import socket
import subprocess
import sys
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


def launch(args: list[str], ranks: int = 2, timeout: float = 240, **popen) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks),
           "--master_port", str(free_port()), "--module", "train", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **popen)


def run_train(args: list[str], ranks: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """The whole run; stdout holds every rank's output and DeepSpeed's."""
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
