#!/bin/sh
# The image's entrypoint. `docker run IMAGE` joins with the image's defaults below; flags alone
# (`docker run IMAGE --initial-peers MADDR`) are added to that default join, as docker-library
# images do. `join ...` and `bootstrap ...` get the image's defaults too (its config, ports, key and
# checkpoints in the volume), your flags after them and so winning; anything else is a noloco-node
# command as given (`status`, `export`, ...). `health` alone is the image's healthcheck.
set -e
JOIN_DEFAULTS="--config /etc/noloco-node/node.toml --stage auto --host 0.0.0.0 --port 31337 --set network.dht_port=31338 --set checkpoint.dir=/var/lib/noloco-node/ckpt --set security.identity_file=/var/lib/noloco-node/node.key"
BOOTSTRAP_DEFAULTS="--config /etc/noloco-node/node.toml --host 0.0.0.0 --port 31330 --identity /var/lib/noloco-node/bootstrap.key --maddr-file /tmp/noloco-bootstrap.maddr"
case "${1:-}" in
  "" | -*) set -- join $JOIN_DEFAULTS "$@" ;;
  join) shift; set -- join $JOIN_DEFAULTS "$@" ;;
  bootstrap) shift; set -- bootstrap $BOOTSTRAP_DEFAULTS "$@" ;;
  health)
    if [ "$#" -eq 1 ]; then
      # A bootstrap writes its multiaddrs while it is up (and removes them at exit); a node answers
      # its gRPC health service on the image's port.
      if [ -s /tmp/noloco-bootstrap.maddr ]; then exit 0; fi
      set -- health --address 127.0.0.1:31337
    fi ;;
esac
exec noloco-node "$@"
