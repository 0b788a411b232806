"""Read-only web pages of a running swarm and node (docs/dashboard.md): `http.py` serves them on the
process's asyncio loop; `swarm.py` builds the swarm's JSON from DHT records (also `status --json`);
`node_view.py` builds a node's own; `history.py` keeps the time series the charts draw."""
