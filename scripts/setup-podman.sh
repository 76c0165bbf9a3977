#!/usr/bin/env bash
# For `make test-image`: Debian's podman (rootful, runc) and debootstrap, for a base image without a registry.
set -euo pipefail
missing=()
for cmd in podman debootstrap runc; do command -v "$cmd" > /dev/null || missing+=("$cmd"); done
if ((${#missing[@]})); then
  [[ $(id -u) -eq 0 ]] || { echo "setup-podman: install ${missing[*]} as root" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman buildah debootstrap runc \
    containernetworking-plugins uidmap slirp4netns fuse-overlayfs > /dev/null
fi
echo "setup-podman: $(podman --version)"
