#!/usr/bin/env bash
# `make test-cluster`: the cluster tier (tests/cluster) on a real Kubernetes.
#   - KUBECONFIG set: run against that cluster (kind, a real one); DS_IMAGE names an image its nodes can pull, and
#     DS_SIDECAR_IMAGE the progress sidecar's (optional: without it the sidecar runs DS_IMAGE).
#   - otherwise: bring up the one-node Kubernetes of ../shared/k8s (root only) in .build/k8s, load the CPU and sidecar
#     images that `make test-image` built, run the tier, and always tear the cluster down again (also on failure or
#     Ctrl-C). Where that is not possible, say why and skip.
# `test-cluster.sh prepare` brings the local cluster up and loads the images, and leaves it up for the next run
# (CI does it while `make test` runs: about 80 s of its time); `test-cluster.sh down` tears a prepared one down.
set -euo pipefail
mode="${1:-run}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { echo "test-cluster: $*"; }
version=$(python3 scripts/pins.py version)
image="${DS_TEST_IMAGE:-localhost/deepspeed-train:$version-cpu}"
sidecar_image="${DS_TEST_SIDECAR_IMAGE:-localhost/deepspeed-sidecar:$version}"
pytest_args=(tests/cluster -v -rP -p no:cacheprovider --durations=0)  # -rP: what passing tests print (timings, summaries)
read -ra extra <<< "${CLUSTER_PYTEST_ARGS:-}"  # e.g. CLUSTER_PYTEST_ARGS="-k bucket": some of the tier
pytest_args+=("${extra[@]}")

if [[ -n "${KUBECONFIG:-}" && "$mode" != run ]]; then
  exit 0  # a cluster of one's own: nothing to prepare or tear down
fi
if [[ "$mode" == down && ! -e "$root/.build/k8s-prepared" ]]; then
  exit 0  # nothing prepared (a run tears its own cluster down)
fi
if [[ -n "${KUBECONFIG:-}" ]]; then
  : "${DS_IMAGE:?DS_IMAGE is required with KUBECONFIG: an image of docker/Dockerfile (VARIANT=cpu) the nodes can pull}"
  log "running against KUBECONFIG=$KUBECONFIG with $DS_IMAGE"
  exec pytest "${pytest_args[@]}"
fi

k8s="${LOCAL_K8S_DIR:-$root/../shared/k8s}"
if [[ ! -x "$k8s/local-k8s.sh" ]]; then
  log "SKIPPED: no local Kubernetes at $k8s (set KUBECONFIG and DS_IMAGE to use a cluster)"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  log "SKIPPED: the local Kubernetes needs root (set KUBECONFIG and DS_IMAGE to use a cluster)"
  exit 0
fi
for built in "$image" "$sidecar_image"; do
  if ! CONTAINERS_CONF="$root/.build/containers.conf" podman image exists "$built" 2> /dev/null; then
    log "no image $built: run \`make test-image\` first (it builds it)"
    exit 1
  fi
done

state="$root/.build/k8s"
prepared="$root/.build/k8s-prepared"  # the kubeconfig of a cluster that `prepare` left up
down() {
  rm -f "$prepared"
  "$k8s/local-k8s.sh" down "$state" --purge > "$root/.build/k8s-down.log" 2>&1 || log "tear-down failed: .build/k8s-down.log"
}
up() {
  local started=$SECONDS
  KUBECONFIG="$("$k8s/local-k8s.sh" up "$state" 2> "$root/.build/k8s-up.log")" || { cat "$root/.build/k8s-up.log"; return 1; }
  export KUBECONFIG
  log "cluster up in $((SECONDS - started))s"
  started=$SECONDS
  for built in "$image" "$sidecar_image"; do
    CONTAINERS_CONF="$root/.build/containers.conf" "$k8s/local-k8s.sh" import "$state" "$built" \
      >> "$root/.build/k8s-import.log" 2>&1 || { cat "$root/.build/k8s-import.log"; return 1; }
  done
  log "images $image and $sidecar_image loaded in $((SECONDS - started))s"
}
case "$mode" in
  down) down; exit 0 ;;
  prepare)
    rm -f "$prepared"
    trap 'exit 130' INT TERM
    up || { down; exit 1; }
    echo "$KUBECONFIG" > "$prepared"
    log "cluster prepared: \`make test-cluster\` runs the tier on it"
    exit 0 ;;
  run) ;;
  *) log "usage: test-cluster.sh [prepare|down]"; exit 2 ;;
esac
trap down EXIT
trap 'exit 130' INT TERM
if [[ -s "$prepared" ]] && KUBECONFIG="$(cat "$prepared")" kubectl get --raw /readyz > /dev/null 2>&1; then
  KUBECONFIG="$(cat "$prepared")"
  export KUBECONFIG
  log "using the cluster prepared beforehand (images loaded)"
else
  up
fi
DS_IMAGE="$image" DS_SIDECAR_IMAGE="$sidecar_image" LOCAL_K8S="$k8s/local-k8s.sh" LOCAL_K8S_STATE="$state" pytest "${pytest_args[@]}"
