#!/usr/bin/env bash
# `make setup`: installs everything the tests, the demo and the chart tooling need. Idempotent; a second
# run takes seconds. Debian packages need root (CI and our machines run as root).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { echo "setup: $*"; }

# 1. Debian packages: sshd/ssh/pdsh for the launcher path, iproute2/util-linux for the e2e hosts, prometheus for
# the dashboard's queries (tests/test_sidecar.py).
declare -A pkg_for=([sshd]=openssh-server [ssh]=openssh-client [pdsh]=pdsh [ip]=iproute2 [unshare]=util-linux
  [shellcheck]=shellcheck [unzip]=unzip [npm]=npm [g++]=g++ [prometheus]=prometheus)
missing=()
for cmd in "${!pkg_for[@]}"; do
  command -v "$cmd" > /dev/null || [[ -x "/usr/sbin/$cmd" ]] || missing+=("${pkg_for[$cmd]}")
done
# Debian's Python with venv and headers (DeepSpeed's JIT ops compile against them).
[[ -f /usr/include/python3.11/Python.h ]] || missing+=(python3-dev)
/usr/bin/python3 -c 'import ensurepip' 2> /dev/null || missing+=(python3-venv)
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    log "missing Debian packages ${missing[*]}: install them as root"
    exit 1
  fi
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
fi

# 2. helm 4 and helm 3 (pinned) under .tools/bin.
bash scripts/install-tools.sh

# 3. checkov in its own environment (its pinned dependencies do not resolve beside ours), installed in the
#    background while steps 4 and 5 download torch and compile: a fresh setup is that much shorter.
python=/usr/bin/python3
[[ -x "$python" ]] || python=python3
checkov_pid=
if [[ ! -x .tools/checkov/bin/checkov ]]; then
  mkdir -p .build
  ( rm -rf .tools/checkov && "$python" -m venv .tools/checkov \
      && .tools/checkov/bin/python -m pip install -q --disable-pip-version-check checkov==3.3.30 ) \
    > .build/checkov-install.log 2>&1 &
  checkov_pid=$!
fi

# DeepSpeed JIT-builds its CPU shared-memory comm op at every init_distributed (1-4 minutes). Build it once into
# .build/torch_extensions, which `make` points TORCH_EXTENSIONS_DIR at, in the background as soon as the environment
# is installed (not before: `.[dev]` pins packages DeepSpeed's install chose, numpy among them, which the build
# imports), beside the byte-compiling and checkov's install.
export TORCH_EXTENSIONS_DIR="$root/.build/torch_extensions" PATH="$root/.venv/bin:$PATH"
# A build killed half-way leaves a lock that makes every later load wait forever.
find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +30 -delete 2> /dev/null || true
op_pid=
build_shm_comm_op() {
  [[ -z "$op_pid" && -z "$(find "$TORCH_EXTENSIONS_DIR" -name deepspeed_shm_comm.so 2> /dev/null)" ]] || return 0
  log "building DeepSpeed's shm_comm op (once; 1-4 minutes) beside the rest"
  mkdir -p .build
  .venv/bin/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" \
    > .build/shm-comm-build.log 2>&1 &
  op_pid=$!
}

# 4. The Python environment: torch first, then deepspeed without build isolation, then the rest.
#    Debian's python3 (world-readable under /usr), not one under /root (pyenv): the pods' non-root user runs
#    this venv in the e2e tests, and cannot reach /root.
stamp=".venv/.installed-$(cat pyproject.toml <(readlink -f "$python") | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  if [[ -d .venv ]] && ! grep -q "^home = $(dirname "$(readlink -f "$python")")\$" .venv/pyvenv.cfg 2> /dev/null; then
    rm -rf .venv  # made from another Python
  fi
  [[ -x .venv/bin/python ]] || "$python" -m venv .venv
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  read -r torch_version deepspeed_version < <("$python" scripts/pins.py torch deepspeed)
  "${pip[@]}" "torch==$torch_version"
  DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "deepspeed==$deepspeed_version"
  "${pip[@]}" -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
  log "python environment ready in .venv"
fi
build_shm_comm_op

# DeepSpeed installs through its setup.py (no wheel without build isolation), which byte-compiles nothing when
# PYTHONDONTWRITEBYTECODE is set: compile it here, or every process that imports it (each rank, DeepSpeed's
# launcher and runner, the glue) compiles its ~750 modules again (~0.35 s of CPU each). Quick when up to date.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deepspeed"

if [[ -n "$op_pid" ]]; then
  wait "$op_pid" || { cat .build/shm-comm-build.log; log "the shm_comm op's build failed"; exit 1; }
  log "DeepSpeed's shm_comm op built in $TORCH_EXTENSIONS_DIR"
fi
if [[ -n "$checkov_pid" ]]; then
  wait "$checkov_pid" || { cat .build/checkov-install.log; log "checkov install failed"; exit 1; }
  log "checkov ready in .tools/checkov"
fi
log "done"
