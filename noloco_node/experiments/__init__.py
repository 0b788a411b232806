"""Local swarms of real node processes on 127.0.0.1, and the experiments built on them."""
