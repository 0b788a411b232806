"""A node: the composition root (assembly), its life (start, serve, train, move, stop) and what
it reports about itself. `Node` lives in `noloco_node.node.lifecycle`; this package imports
nothing eagerly, so a process that needs one small part (the DHT adapters, the stats read model)
does not pay for the model stack (torch + transformers: ~2 s of CPU per process start)."""
