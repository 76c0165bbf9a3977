"""The CUDA image (`make test-image-cuda`), checked on a machine without a GPU: torch is a CUDA build, DeepSpeed's
GPU ops are prebuilt and recorded for the cuda accelerator (a GPU node loads them, never compiles), cpu_adam runs
on any x86-64-v3 CPU, the train package trains on the CPU inside it, and a rank that sees fewer GPUs than its
worker was given stops at start. Every container runs as the chart's pods do: the pods' uid, a read-only root, no
capabilities, the home and /tmp as empty volumes."""

import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest

IMAGE = os.environ.get("DS_TEST_CUDA_IMAGE", "")
pytestmark = pytest.mark.skipif(not IMAGE or not shutil.which("podman"),
                                reason="CUDA image test: run `make test-image-cuda` (builds the image with podman)")
OPS = ("fused_adam", "cpu_adam")  # the presets' AdamW on GPUs, and zero3-offload's optimizer on the CPU


def in_image(*argv: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as tmp:
        for empty_dir in (home, tmp):  # what the chart's emptyDirs give the pods' user
            os.chmod(empty_dir, 0o777)
        cmd = ["podman", "run", "--rm", "--pull=never", "--network=none", "--read-only", "--user=10001:10001",
               "--cap-drop=ALL", "--security-opt=no-new-privileges", f"--volume={home}:/home/deepspeed",
               f"--volume={tmp}:/tmp", "--shm-size=256m"]
        cmd += [f"--env={k}={v}" for k, v in (env or {}).items()]
        return subprocess.run([*cmd, IMAGE, *argv], capture_output=True, text=True, timeout=timeout)


PROBE = f"""
import json, torch, deepspeed.git_version_info as info
from deepspeed.accelerator import get_accelerator
loaded = {{}}
for name, builder in (("fused_adam", "FusedAdamBuilder"), ("cpu_adam", "CPUAdamBuilder")):
    loaded[name] = get_accelerator().create_op_builder(builder).load().__file__
print(json.dumps({{"torch_cuda": torch.version.cuda, "accelerator": info.accelerator_name,
                  "installed": {{op: info.installed_ops.get(op) for op in {OPS!r}}}, "loaded": loaded}}))
"""


def test_torch_is_a_cuda_build_and_the_gpu_ops_are_prebuilt_for_cuda_and_load_without_compiling():
    proc = in_image("python", "-c", PROBE, env={"DS_ACCELERATOR": "cuda"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{found}")
    assert found["torch_cuda"] and found["accelerator"] == "cuda", found
    assert all(found["installed"][op] for op in OPS), found
    # Loaded from the image's DeepSpeed, not JIT-built into a torch_extensions directory.
    assert all("/site-packages/deepspeed/ops/" in path for path in found["loaded"].values()), found
    assert in_image("sh", "-c", "command -v nvcc").returncode != 0  # the compiler was for the build only


def test_ds_report_says_the_ops_are_installed_for_cuda():
    proc = in_image("ds_report", env={"DS_ACCELERATOR": "cuda"})
    plain = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # its colours
    lines = [line for line in plain.splitlines() if line.split(" ", 1)[0] in OPS]
    print("\n" + "\n".join(lines))
    assert len(lines) == 2 and all(re.match(r"\w+ \.+ \[YES\] \.+ \[OKAY\]", line) for line in lines), plain


def test_cpu_adam_holds_no_avx512_so_it_runs_on_every_x86_64_gpu_node():
    find = "import importlib.util as u; print(u.find_spec('deepspeed.ops.adam.cpu_adam_op').origin)"
    proc = in_image("sh", "-c", f'objdump -d "$(python -c "{find}" | tail -n 1)"')  # after DeepSpeed's notes
    assert proc.returncode == 0 and "<" in proc.stdout, proc.stderr[-2000:]
    assert "zmm" not in proc.stdout  # AVX-512 registers: DeepSpeed's -march=native on an AVX-512 build machine


def test_the_train_package_trains_on_the_cpu_inside_the_cuda_image():
    ds_config = json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
                            "zero_optimization": {"stage": 2}})
    script = (f"printf '%s' '{ds_config}' > /tmp/ds.json && exec python -m train --ds-config /tmp/ds.json "
              "--steps 3 --log-every 1 --model.n-layer 1 --model.d-model 32 --model.n-head 2 --model.seq-len 16")
    proc = in_image("sh", "-c", script, env={
        "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511", "OMP_NUM_THREADS": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    steps = [line for line in output.splitlines() if "INFO step 3/3" in line]
    print(f"\n{steps[-1] if steps else output[-2000:]}")
    assert steps, output[-3000:]


def test_a_rank_that_sees_fewer_gpus_than_its_worker_was_given_stops_at_start():
    proc = in_image("python", "-m", "train", "--ds-config", "/nonexistent.json", env={
        "DS_ACCELERATOR": "cuda", "DS_GPUS_PER_WORKER": "8", "RANK": "0", "WORLD_SIZE": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "this worker's ranks see 0 GPUs (DeepSpeed's accelerator: cuda), but worker.gpusPerWorker is 8" in output
    assert "Traceback" not in output, output[-3000:]


def test_the_image_size():
    size = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", IMAGE], capture_output=True,
                          text=True, check=True).stdout.strip()
    print(f"\n{IMAGE}: {int(size) / 2 ** 30:.2f} GiB")
    assert int(size) > 0
