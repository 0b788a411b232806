"""A node: the composition root (assembly), its life (start, serve, train, move, stop) and what
it reports about itself."""

from noloco_node.node.lifecycle import Node

__all__ = ["Node"]
