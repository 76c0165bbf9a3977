#!/usr/bin/env bash
# The worker/launcher image (docker/Dockerfile), and the progress sidecar's (docker/Dockerfile.sidecar).
# Usage: scripts/image.sh build|build_hf|build_sidecar|push|base
#   build     docker or podman build of IMAGE_NAME:IMAGE_TAG (<version>-<variant>: pyproject.toml's; VARIANT=cpu|cuda|rocm, default cpu; BASE, TORCH_PIP_ARGS,
#             CUDA_ARCHS, GPU_ARCHS, CPU_ARCH pass through to docker/Dockerfile)
#   build_hf  the Hugging Face layer on it (docker/Dockerfile.hf): IMAGE_NAME:IMAGE_TAG-hf
#   build_sidecar  the progress sidecar's image (docker/Dockerfile.sidecar): SIDECAR_IMAGE (deepspeed-sidecar:<version>)
#   push   tag and push it to REGISTRY
#   base   (podman, offline machines) make the Dockerfile's FROM image with debootstrap instead of pulling it
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
read -r VERSION TORCH_VERSION DEEPSPEED_VERSION < <(python3 scripts/pins.py version torch deepspeed)
VARIANT="${VARIANT:-cpu}"
IMAGE_NAME="${IMAGE_NAME:-deepspeed-train}"
IMAGE_TAG="${IMAGE_TAG:-$VERSION-$VARIANT}"
SIDECAR_IMAGE="${SIDECAR_IMAGE:-deepspeed-sidecar:$VERSION}"
log() { echo "image: $*"; }

engine() {
  if command -v docker > /dev/null && docker info > /dev/null 2>&1; then
    echo docker
  elif command -v podman > /dev/null; then
    echo podman
  else
    log "neither docker (with a running engine) nor podman found; install one, e.g. apt-get install podman" >&2
    exit 1
  fi
}

# podman here: runc (crun fails to set rlimits on hybrid cgroups) and finite ulimits, in a config of our own.
export CONTAINERS_CONF="$root/.build/containers.conf"
mkdir -p .build
cat > "$CONTAINERS_CONF" << 'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF

base() {
  local image=debian:bookworm-slim mirror
  if podman image exists "$image"; then
    log "$image is present"
    return
  fi
  mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/*.sources 2> /dev/null || true)
  mirror=${mirror:-$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list 2> /dev/null || true)}
  [[ -n "$mirror" ]] || { log "no Debian mirror in the apt sources" >&2; exit 1; }
  log "debootstrap --variant=minbase bookworm from $mirror (a few minutes)"
  rm -rf .build/rootfs
  debootstrap --variant=minbase bookworm .build/rootfs "$mirror" > .build/debootstrap.log
  tar -C .build/rootfs -c . | podman import - "$image" > /dev/null
  rm -rf .build/rootfs
  log "imported $image"
}

build() {
  local tool args=()
  tool=$(engine)
  rm -f docker/wheels/*.whl
  if [[ "$VARIANT" == cpu ]]; then
    # A local CPU torch wheel (this machine's pip find-links) saves fetching it; else PyTorch's CPU index.
    wheel=$(find "${PIP_FIND_LINKS:-/opt/wheels}" -maxdepth 1 -name "torch-$TORCH_VERSION+cpu-cp311-*.whl" 2> /dev/null | head -1)
    if [[ -n "$wheel" ]]; then
      cp "$wheel" docker/wheels/
    else
      TORCH_PIP_ARGS=${TORCH_PIP_ARGS:---index-url https://download.pytorch.org/whl/cpu}
    fi
  fi
  # VARIANT=rocm: TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/rocm<version>" and BASE (below).
  for arg in TORCH_PIP_ARGS CUDA_ARCHS GPU_ARCHS CPU_ARCH; do
    if [[ -n "${!arg:-}" ]]; then args+=(--build-arg "$arg=${!arg}"); fi
  done
  # The same debootstrapped Debian for both variants; BASE=<image> (e.g. a vendor CUDA image) to build on another.
  if [[ -n "${BASE:-}" ]]; then args+=(--build-arg "BASE=$BASE"); fi
  # The host's CA bundle, when it sets one, is trusted by pip inside the build but never stored in it.
  if [[ -s "${SSL_CERT_FILE:-}" ]]; then args+=(--secret "id=ca,src=$SSL_CERT_FILE"); fi
  # podman: the docker image format (OCI drops HEALTHCHECK, SHELL...); --pull=never for a local base.
  if [[ "$tool" == podman ]]; then args+=(--format docker); fi
  if [[ "$tool" == podman && -z "${BASE:-}" ]] && podman image exists debian:bookworm-slim; then args+=(--pull=never); fi
  log "$tool build $IMAGE_NAME:$IMAGE_TAG (VARIANT=$VARIANT)"
  "$tool" build -f docker/Dockerfile --build-arg "VARIANT=$VARIANT" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
    --build-arg "DEEPSPEED_VERSION=$DEEPSPEED_VERSION" "${args[@]}" -t "$IMAGE_NAME:$IMAGE_TAG" .
  rm -f docker/wheels/*.whl
}

build_hf() {
  local tool args=()
  tool=$(engine)
  if [[ -s "${SSL_CERT_FILE:-}" ]]; then args+=(--secret "id=ca,src=$SSL_CERT_FILE"); fi
  if [[ "$tool" == podman ]]; then args+=(--format docker --pull=never); fi
  log "$tool build $IMAGE_NAME:$IMAGE_TAG-hf on $IMAGE_NAME:$IMAGE_TAG"
  "$tool" build -f docker/Dockerfile.hf --build-arg "BASE=$IMAGE_NAME:$IMAGE_TAG" "${args[@]}" \
    -t "$IMAGE_NAME:$IMAGE_TAG-hf" .
}

build_sidecar() {
  local tool args=() kubernetes prometheus_client minio
  tool=$(engine)
  read -r kubernetes prometheus_client minio < <(python3 scripts/pins.py kubernetes prometheus-client minio)
  if [[ -s "${SSL_CERT_FILE:-}" ]]; then args+=(--secret "id=ca,src=$SSL_CERT_FILE"); fi
  if [[ -n "${BASE:-}" ]]; then args+=(--build-arg "BASE=$BASE"); fi
  if [[ "$tool" == podman ]]; then args+=(--format docker); fi
  if [[ "$tool" == podman && -z "${BASE:-}" ]] && podman image exists debian:bookworm-slim; then args+=(--pull=never); fi
  log "$tool build $SIDECAR_IMAGE (the progress sidecar)"
  "$tool" build -f docker/Dockerfile.sidecar --build-arg "KUBERNETES_VERSION=$kubernetes" \
    --build-arg "PROMETHEUS_CLIENT_VERSION=$prometheus_client" --build-arg "MINIO_VERSION=$minio" "${args[@]}" \
    -t "$SIDECAR_IMAGE" .
}

push() {
  local tool
  : "${REGISTRY:?REGISTRY is required: make image-push REGISTRY=registry.example.com/ml}"
  tool=$(engine)
  "$tool" tag "$IMAGE_NAME:$IMAGE_TAG" "$REGISTRY/$IMAGE_NAME:$IMAGE_TAG"
  "$tool" push "$REGISTRY/$IMAGE_NAME:$IMAGE_TAG"
}

case "${1:-}" in
  build | build_hf | build_sidecar | push | base) "$1" ;;
  *)
    echo "usage: $0 build|build_hf|build_sidecar|push|base" >&2
    exit 2
    ;;
esac
