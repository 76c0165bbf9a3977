#!/usr/bin/env bash
# docker/Dockerfile's torch and DeepSpeed, with the ops the presets need compiled in (the root filesystem is
# read-only at run time, so nothing may be JIT-built there):
#   cpu   the CPU build of torch; shm_comm (CPU ranks' collectives).
#   cuda  PyPI's default torch (a CUDA build: runtime, cuBLAS, cuDNN, NCCL come as nvidia-* wheels) and, for this
#         build only, the CUDA compiler of the toolkit version torch itself pins, so fused_adam (the presets' AdamW
#         on GPUs) and cpu_adam (zero3-offload's optimizer, on the CPU) compile for CUDA_ARCHS with no GPU and no
#         vendor base image.
#   rocm  torch from TORCH_PIP_ARGS (PyTorch's ROCm index) on a ROCm BASE that has hipcc; the same two ops for
#         GPU_ARCHS. Not built by this project's CI (no ROCm wheels on its registries).
# GPU variants build with DS_ACCELERATOR=cuda (DeepSpeed's accelerator for CUDA and ROCm): DeepSpeed records the
# accelerator it built for and uses prebuilt ops only on that one; a GPU-less build machine would record cpu.
# Usage: install-deepspeed.sh VARIANT TORCH_VERSION DEEPSPEED_VERSION [TORCH_PIP_ARGS...]
set -euo pipefail
variant=$1 torch_version=$2 deepspeed_version=$3
shift 3
: "${CUDA_ARCHS:=8.0;9.0;10.0}" "${GPU_ARCHS:=gfx90a;gfx942}" "${CPU_ARCH:=x86-64-v3}"
python3 -m venv /opt/venv
pip install --find-links /wheels "$@" "torch==$torch_version"
build=(env DS_BUILD_OPS=0)
compiler_wheels=()

# cpu_adam compiles with -march=native and the build machine's SIMD width: a portable target instead, so the image
# runs on every GPU node's CPU (CPU_ARCH; x86-64-v3 is AVX2, which x86 GPU servers have had since 2013).
portable_gxx() {
  local wrapper=/usr/local/bin/ds-portable-g++
  cat > "$wrapper" << SH
#!/bin/sh
# docker/install-deepspeed.sh: g++ with DeepSpeed's -march=native and AVX-512 width made portable (-march=$CPU_ARCH).
for a in "\$@"; do
  case "\$a" in -march=native) a="-march=$CPU_ARCH" ;; -D__AVX512__) a="-D__AVX256__" ;; esac
  set -- "\$@" "\$a"; shift
done
exec g++ "\$@"
SH
  chmod 755 "$wrapper"
  build+=(CC="$wrapper" CXX="$wrapper" DS_ACCELERATOR=cuda DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1)
}

case "$variant" in
  cpu)
    build+=(DS_BUILD_SHM_COMM=1)
    ;;
  cuda)
    # torch's own pin of the toolkit (its Requires-Dist `cuda-toolkit[...]==X`): the compiler matches its runtime.
    toolkit=$(python3 -c 'import importlib.metadata as m, re
pins = [p[1] for r in m.requires("torch") or [] if (p := re.match(r"cuda-toolkit\[[^]]*\]==([\w.]+)", r))]
print(pins[0] if pins else "")')
    [[ -n "$toolkit" ]] || { echo "torch $torch_version pins no cuda-toolkit: not PyPI's CUDA build" >&2; exit 1; }
    pip install "cuda-toolkit[nvcc,cccl]==$toolkit"
    compiler_wheels=(nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-cccl)
    cuda_home=$(python3 -c 'import os, nvidia, torch
print(os.path.join(list(nvidia.__path__)[0], "cu" + torch.version.cuda.split(".")[0]))')
    # The wheels' tree as a CUDA_HOME: torch links -lcudart from lib64 (wheels hold no symlinks).
    ln -sfn lib "$cuda_home/lib64"
    ln -sf "$(basename "$(ls "$cuda_home"/lib/libcudart.so.[0-9]*)")" "$cuda_home/lib/libcudart.so"
    build+=(CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$PATH" TORCH_CUDA_ARCH_LIST="$CUDA_ARCHS")
    portable_gxx
    ;;
  rocm)
    build+=(ROCM_HOME="${ROCM_HOME:-/opt/rocm}" PYTORCH_ROCM_ARCH="$GPU_ARCHS")
    portable_gxx
    ;;
  *)
    echo "VARIANT $variant: expected cpu, cuda or rocm" >&2
    exit 2
    ;;
esac
"${build[@]}" pip install --no-build-isolation "deepspeed==$deepspeed_version"
if ((${#compiler_wheels[@]})); then
  pip uninstall -y "${compiler_wheels[@]}"  # the compiler was for the build only
fi
rm -f /usr/local/bin/ds-portable-g++
