"""Replica-to-replica synchronisation of a stage: NoLoCo pairing and exchange. Talks to the
network only through the rpc Outer client/handler and the replica directory."""
