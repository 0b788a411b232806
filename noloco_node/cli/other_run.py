"""Which run a swarm's initial peers serve, for a command that found none of its own run's nodes:
the DHT keeps runs apart, so a config without the swarm's `run.run_id` sees an empty swarm (a
newcomer ran `status` without the swarm's config and was told to join run 'local')."""

from __future__ import annotations

OTHER_RUN_TIMEOUT_S = 5.0


async def run_of_initial_peers(config, directory) -> str | None:
    """The run the initial peers serve when it is not this config's, else None. Asks each (over
    libp2p, as a bootstrap is reached) for a probe of no address: a peer of another run refuses
    it for the run first (FAILED_PRECONDITION names it); one of this run for the address, at once."""
    from noloco_node.node.joining import contact_lookup, peer_ids_of
    from noloco_node.rpc.diagnostics import other_run, probe_from_peers
    from noloco_node.rpc.security import read_swarm_key
    from noloco_node.transport.links import Links

    probers = peer_ids_of(config.network.initial_peers)
    if not probers:
        return None
    links = Links(
        directory.key,
        swarm_key=read_swarm_key(config.security),
        max_skew_s=config.security.max_clock_skew_s,
        lookup=contact_lookup(directory),
    )
    try:
        await links.dial_over(directory.p2p)
        _, errors = await probe_from_peers(
            "", probers[:4], run_id=config.run.run_id, timeout_s=OTHER_RUN_TIMEOUT_S, dialer=links.dialer, wanted=1
        )
    finally:
        await links.close()
    return other_run(errors)
