#!/usr/bin/env bash
# `make test-cluster`: the cluster tier (tests/cluster) on a real Kubernetes. `--run COMMAND...` runs COMMAND
# there instead of the tier, with the same cluster and images (`make soak`). CI brings the local cluster up beside
# `make test` at the lowest CPU weight (`--prepare`: up, the images loaded, left running), gives it its weight back
# once the tests are done (`--full-weight`), then runs the tier on it, which tears it down; `--down` tears down one
# that a failed run left up (docs/testing.md, "Testing on a cluster").
#   - KUBECONFIG set: run against that cluster (kind, a real one); DS_IMAGE names an image its nodes can pull, and
#     DS_SIDECAR_IMAGE the progress sidecar's (optional: without it the sidecar runs DS_IMAGE).
#   - otherwise: bring up the one-node Kubernetes of ../shared/k8s (root only) in .build/k8s, load the CPU and sidecar
#     images that `make test-image` built, run the tier, and always tear the cluster down again (also on failure or
#     Ctrl-C). Where that is not possible, say why and skip.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { echo "test-cluster: $*"; }
version=$(python3 scripts/pins.py version)
image="${DS_TEST_IMAGE:-localhost/deepspeed-train:$version-cpu}"
sidecar_image="${DS_TEST_SIDECAR_IMAGE:-localhost/deepspeed-sidecar:$version}"
# Two tests at a time (CLUSTER_TEST_WORKERS), one handed out at a time in the file's order: each
# waits mostly on its pods, and its pods request about 0.6 of the node's 2 CPUs. -rP: what passing tests print.
pytest_args=(tests/cluster -n "${CLUSTER_TEST_WORKERS:-2}" --dist load --maxschedchunk 1 -v -rP -p no:cacheprovider
  --durations=0)
read -ra extra <<< "${CLUSTER_PYTEST_ARGS:-}"  # e.g. CLUSTER_PYTEST_ARGS="-k bucket": some of the tier
pytest_args+=("${extra[@]}")
command=(pytest "${pytest_args[@]}")
mode=tier
case "${1:-}" in
  --run) shift; command=("$@") ;;
  --prepare | --full-weight | --down) mode=${1#--} ;;
esac
# The CPU cgroup of a cluster brought up beside the tests (cgroup v1's cpu.shares or v2's cpu.weight): every
# process the bring-up starts stays in it, daemons included, so one write gives them all their weight back.
cpu_group=/sys/fs/cgroup/cpu/ds-test-cluster weight=cpu.shares lowest=2 normal=1024
if [[ ! -f /sys/fs/cgroup/cpu/cpu.shares ]]; then
  cpu_group=/sys/fs/cgroup/ds-test-cluster weight=cpu.weight lowest=1 normal=100
fi
if [[ $mode == full-weight ]]; then
  [[ ! -d "$cpu_group" ]] || echo "$normal" > "$cpu_group/$weight"
  exit 0
fi

if [[ -n "${KUBECONFIG:-}" ]]; then
  [[ $mode == tier ]] || exit 0  # a cluster of its own: nothing to bring up or down
  : "${DS_IMAGE:?DS_IMAGE is required with KUBECONFIG: an image of docker/Dockerfile (VARIANT=cpu) the nodes can pull}"
  log "running against KUBECONFIG=$KUBECONFIG with $DS_IMAGE"
  exec "${command[@]}"
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
  [[ $mode != down ]] || break
  if ! CONTAINERS_CONF="$root/.build/containers.conf" podman image exists "$built" 2> /dev/null; then
    log "no image $built: run \`make test-image\` first (it builds it)"
    exit 1
  fi
done

state="$root/.build/k8s"
archives="$root/.build/k8s-images"  # the images as archives for the cluster's containerd (~2 GB; removed at the end)
prepared="$state/prepared"  # --prepare's record: the ids of the images it loaded, once they are
images_id() {
  CONTAINERS_CONF="$root/.build/containers.conf" podman image inspect --format '{{.Id}}' "$image" "$sidecar_image"
}
down() {
  "$k8s/local-k8s.sh" down "$state" --purge > "$root/.build/k8s-down.log" 2>&1 || log "tear-down failed: .build/k8s-down.log"
  rm -rf "$archives"
  rmdir "$cpu_group" 2> /dev/null || true
}
trap down EXIT
trap 'exit 130' INT TERM
if [[ $mode == down ]]; then
  exit 0  # the trap's
fi
if [[ $mode == prepare ]]; then
  rm -f "$prepared"
  # `up` itself runs at the normal weight: its steps wait with time limits that assume a CPU (kube-apiserver's
  # /readyz within 90 s: at the lowest weight beside the tests it missed it, after 5 minutes to unpack the
  # binaries); the images' import, without such limits, then runs at the lowest.
  if mkdir -p "$cpu_group" 2> /dev/null && echo "$normal" > "$cpu_group/$weight" && echo $$ > "$cpu_group/cgroup.procs"; then
    log "bringing the cluster up in $cpu_group, the images then loaded at the lowest CPU weight"
  else
    log "no CPU cgroup to bring the cluster up in ($cpu_group): at the normal weight"
  fi
elif [[ -f "$prepared" && "$(cat "$prepared")" == "$(images_id)" ]] \
  && KUBECONFIG="$state/kubeconfig" kubectl get --raw /readyz > /dev/null 2>&1; then
  [[ ! -d "$cpu_group" ]] || echo "$normal" > "$cpu_group/$weight"
  # A kubelet starved of CPU beside the tests may have missed its lease: the node comes back Ready once it has its
  # weight again.
  KUBECONFIG="$state/kubeconfig" kubectl wait node --all --for=condition=Ready --timeout=180s > /dev/null \
    || { log "the prepared cluster's node is not Ready"; exit 1; }
  log "using the cluster --prepare brought up, with the images it loaded"
  DS_IMAGE="$image" DS_SIDECAR_IMAGE="$sidecar_image" LOCAL_K8S="$k8s/local-k8s.sh" LOCAL_K8S_STATE="$state" \
    KUBECONFIG="$state/kubeconfig" "${command[@]}"
  exit
fi
started=$SECONDS
# podman writes each image's archive while the cluster starts (a third of the import's time, which the start spends
# waiting); containerd then imports the archives.
rm -rf "$archives" && mkdir -p "$archives"
saves=()
for built in "$image" "$sidecar_image"; do
  CONTAINERS_CONF="$root/.build/containers.conf" podman save --format docker-archive -o "$archives/${#saves[@]}.tar" \
    "$built" > "$archives/${#saves[@]}.log" 2>&1 &
  saves+=("$!")
done
KUBECONFIG="$("$k8s/local-k8s.sh" up "$state" 2> "$root/.build/k8s-up.log")" || { cat "$root/.build/k8s-up.log"; exit 1; }
export KUBECONFIG
log "cluster up in $((SECONDS - started))s"
if [[ $mode == prepare && -d "$cpu_group" ]]; then
  echo "$lowest" > "$cpu_group/$weight"
fi
for i in "${!saves[@]}"; do  # one after the other: two at once take as long (measured)
  wait "${saves[$i]}" || { cat "$archives/$i.log"; log "podman save failed"; exit 1; }
  "$k8s/local-k8s.sh" import "$state" "$archives/$i.tar" >> "$root/.build/k8s-import.log" 2>&1 \
    || { cat "$root/.build/k8s-import.log"; exit 1; }
  rm -f "$archives/$i.tar"
done
log "images $image and $sidecar_image loaded $((SECONDS - started))s after the start"
if [[ $mode == prepare ]]; then
  images_id > "$prepared"
  trap - EXIT  # left running for the tier
  exit 0
fi
DS_IMAGE="$image" DS_SIDECAR_IMAGE="$sidecar_image" LOCAL_K8S="$k8s/local-k8s.sh" LOCAL_K8S_STATE="$state" "${command[@]}"
