#!/bin/sh
# The image's entrypoint. `docker run IMAGE` joins with the defaults below; flags alone
# (`docker run IMAGE --initial-peers MADDR`) are added to that default join, as docker-library
# images do; anything else is a noloco-node command (`docker run IMAGE bootstrap ...`, `status`, ...).
set -e
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
  set -- join --config /etc/noloco-node/node.toml --stage auto --host 0.0.0.0 --port 31337 --set network.dht_port=31338 --set checkpoint.dir=/var/lib/noloco-node/ckpt --set security.identity_file=/var/lib/noloco-node/node.key "$@"
fi
exec noloco-node "$@"
