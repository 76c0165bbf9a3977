#!/usr/bin/env bash
# Run by the ssh launcher and worker (podruntime/sshmode.py ssh_setup): builds ~/.ssh from the mounted Secret and
# ConfigMap.
# Keys are copied (not used in place) because ssh refuses keys and configs that others can read.
# authorized_keys and known_hosts are derived from the private keys, so the Secret holds only those.
set -euo pipefail

: "${HOME:?}" "${DS_CONFIG_DIR:?}" "${DS_SSH_KEYS_DIR:?}" "${DS_WORKER_DOMAIN:?}" "${DS_SSH_PORT:?}"
ssh_dir="$HOME/.ssh"
mkdir -p "$ssh_dir"
chmod 700 "$ssh_dir"
for key in id_ecdsa ssh_host_ecdsa_key; do
  if [[ ! -s "$DS_SSH_KEYS_DIR/$key" ]]; then
    echo "ssh-setup: $DS_SSH_KEYS_DIR/$key is missing or empty; the SSH Secret needs keys id_ecdsa and ssh_host_ecdsa_key" >&2
    exit 1
  fi
  install -m 600 "$DS_SSH_KEYS_DIR/$key" "$ssh_dir/$key"
done
install -m 600 "$DS_CONFIG_DIR/ssh_config" "$ssh_dir/config"
install -m 600 "$DS_CONFIG_DIR/sshd_config" "$ssh_dir/sshd_config"
ssh-keygen -y -f "$ssh_dir/id_ecdsa" > "$ssh_dir/authorized_keys"
# Every worker presents the same host key: one wildcard line covers them all.
echo "[*.$DS_WORKER_DOMAIN]:$DS_SSH_PORT $(ssh-keygen -y -f "$ssh_dir/ssh_host_ecdsa_key")" > "$ssh_dir/known_hosts"
chmod 600 "$ssh_dir/authorized_keys" "$ssh_dir/known_hosts"
