"""noloco-node: a peer node for NoLoCo training over slow links.

Importing the package has no side effects and imports nothing heavy.
"""

__version__ = "0.2.0"
