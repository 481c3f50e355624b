#!/bin/sh
# fededge SuperNode entrypoint: optional kernel link shaping, then `fededge supernode` (a warm
# worker and flower-supernode, started and stopped together) with TLS and node
# authentication, as the unprivileged user.
#
#   FEDEDGE_SUPERLINK       host:port the node dials (default superlink:9092); the host
#                           must be a SAN of the server certificate (fededge certs --hosts)
#   FEDEDGE_CERTS           directory from `fededge certs` (default /certs)
#   FEDEDGE_NODE_KEY        this node's private key file in it, e.g. supernode-0.key
#   FEDEDGE_NODE_CONFIG     --node-config, e.g. 'partition-id=0 num-partitions=3'
#   FEDEDGE_SHAPING         none (default) | kernel | proxy. proxy: nothing happens here;
#                           a sidecar `fededge netem proxy` answers to the SuperLink's name
#   FEDEDGE_NETEM_PROFILE   link profile for kernel shaping (fededge netem profiles)
#   FEDEDGE_NETEM_DEV       interface to shape (default eth0)
#   FEDEDGE_NETEM_DIRECTION egress | ingress | both (default both; ingress needs the
#                           host's ifb module)
#   FEDEDGE_WARM            1 (default): `fededge supernode`, a warm worker beside the node
#                           (docs/deployment.md); 0: flower-supernode alone, every message
#                           in a fresh process
# Extra arguments are passed to flower-supernode.
set -eu

superlink="${FEDEDGE_SUPERLINK:-superlink:9092}"
certs="${FEDEDGE_CERTS:-/certs}"
key="${FEDEDGE_NODE_KEY:?set FEDEDGE_NODE_KEY to this node's key file in ${certs}, e.g. supernode-0.key}"
node_config="${FEDEDGE_NODE_CONFIG:?set FEDEDGE_NODE_CONFIG, e.g. partition-id=0 num-partitions=3}"
shaping="${FEDEDGE_SHAPING:-none}"
user="${FEDEDGE_USER:-fededge}"

case "${FEDEDGE_WARM:-1}" in
  1) node="fededge supernode" ;;
  0) node="flower-supernode" ;;
  *)
    echo "fededge-supernode: FEDEDGE_WARM must be 1 or 0, got '${FEDEDGE_WARM}'" >&2
    exit 2
    ;;
esac

case "$shaping" in
  none|proxy) ;;
  kernel)
    profile="${FEDEDGE_NETEM_PROFILE:?FEDEDGE_SHAPING=kernel needs FEDEDGE_NETEM_PROFILE (see fededge netem profiles)}"
    if [ "$(id -u)" != 0 ]; then
      echo "fededge-supernode: kernel shaping needs the container to start as root (compose: user: root) with cap_add NET_ADMIN; it drops to '$user' afterwards" >&2
      exit 2
    fi
    fededge netem apply --dev "${FEDEDGE_NETEM_DEV:-eth0}" --profile "$profile" --side client \
      --direction "${FEDEDGE_NETEM_DIRECTION:-both}"
    ;;
  *)
    echo "fededge-supernode: FEDEDGE_SHAPING must be none, kernel or proxy, got '$shaping'" >&2
    exit 2
    ;;
esac

# $node is one or two words on purpose (unquoted): `fededge supernode` or `flower-supernode`.
# shellcheck disable=SC2086
set -- $node --superlink "$superlink" --root-certificates "$certs/ca.crt" \
  --auth-supernode-private-key "$certs/$key" --node-config "$node_config" "$@"

if [ "$(id -u)" = 0 ]; then
  # Root only to shape the link: run Flower (its worker and the ClientApps it starts) as $user,
  # with no capabilities left (setuid from root to a non-root uid clears them).
  exec python - "$user" "$@" <<'PY'
import os, pwd, sys
pw = pwd.getpwnam(sys.argv[1])
os.setgroups([])
os.setgid(pw.pw_gid)
os.setuid(pw.pw_uid)
os.environ.update(HOME=pw.pw_dir, USER=pw.pw_name)
if os.path.isdir(pw.pw_dir):
    os.chdir(pw.pw_dir)
os.execvp(sys.argv[2], sys.argv[2:])
PY
fi
exec "$@"
