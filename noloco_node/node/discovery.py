"""Finding the swarm before a node is built: its DHT directory, and for `--stage auto` the stage to
serve (its own checkpoint's, else the one the swarm needs most, agreed with simultaneous joiners)."""

from __future__ import annotations

import logging
from pathlib import Path

from noloco_node import __version__
from noloco_node.config import NodeConfig
from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.pipeline.stage_choice import claim_stage_in
from noloco_node.sync.state_fetch import agreed_step
from noloco_node.transport.identity import NodeIdentity

log = logging.getLogger(__name__)


async def start_directory(
    cfg: NodeConfig, manifest_hash: str, identity: NodeIdentity | None, swarm_key: bytes | None
) -> PeerDirectory:
    """The node's DHT peer under `identity` on network.dht_port; with no identity a throwaway
    peer (a key of its own, any free port) that only looks."""
    return await PeerDirectory.start(
        DirectoryIdentity(cfg.run.run_id, manifest_hash, __version__, cfg.pipeline.num_stages),
        initial_peers=list(cfg.network.initial_peers),
        host=cfg.network.host,
        port=cfg.network.dht_port if identity is not None else 0,
        startup_timeout_s=cfg.timeouts.startup_s,
        swarm_key=swarm_key,
        max_skew_s=cfg.security.max_clock_skew_s,
        key=identity,
    )


async def stages_served(cfg: NodeConfig, manifest_hash: str, swarm_key: bytes | None) -> set[int]:
    """The stages some live replica serves, as a throwaway DHT peer sees them (a key of its own, any
    free port): what `join` asks before it picks its checkpoint folder (cli/join.py)."""
    directory = await start_directory(cfg, manifest_hash, None, swarm_key)
    try:
        return {stage for stage in range(cfg.pipeline.num_stages) if await directory.replicas(stage, fresh=True)}
    finally:
        await directory.shutdown()


async def choose_stage(
    cfg: NodeConfig, manifest_hash: str, identity: NodeIdentity, swarm_key: bytes | None
) -> tuple[PeerDirectory | None, int]:
    """`--stage auto`: the directory, and the stage of our own checkpoint where that is where we are
    needed (`_checkpoint_stage`), else the stage that sustains the least (runtime/throughput.py:
    weakest_stage), claimed in the DHT first (pipeline/stage_choice.py)."""
    directory = await start_directory(cfg, manifest_hash, identity, swarm_key)
    if cfg.checkpoint.dir is not None and (back := await _checkpoint_stage(cfg, manifest_hash, directory)) is not None:
        return directory, back

    def claim_record(stage: int, status: str, claimed_at: float) -> StageRecord:
        """A joiner's claim on a stage: no address yet, never routed to."""
        return StageRecord(
            peer_id=directory.peer_id,
            address="",
            stage=stage,
            inner_step=0,
            outer_round=0,
            status=status,
            tokens_per_s=0.0,
            version=__version__,
            manifest_hash=manifest_hash,
            run_id=cfg.run.run_id,
            updated_at=claimed_at,
        )

    stage = await claim_stage_in(directory, claim_record, ttl_s=cfg.timeouts.record_ttl_s)
    log.info(
        "stage auto: replicas' capacities per stage %s -> serving stage %d", await directory.replica_capacities(), stage
    )
    return directory, stage


async def live_step_ahead(
    directory: PeerDirectory, stage: int, inner_step: int, *, me: str, margin: int = 0
) -> int | None:
    """The inner step the live replicas of `stage` other than us agree on, when it is more than
    `margin` steps past `inner_step` (a checkpoint's): their state is the one to take. None
    otherwise."""
    fellows = [r for r in await directory.replicas(stage, fresh=True) if r.peer_id != me]
    return _past(fellows, inner_step, margin)


def _past(fellows: list[StageRecord], inner_step: int, margin: int) -> int | None:
    """The step the fellows' records agree on (sync/state_fetch.py agreed_step: not one record's
    claim, which says what its writer likes), when past `inner_step` by more than `margin`."""
    agreed = agreed_step([r.inner_step for r in fellows])
    return agreed if agreed is not None and agreed > inner_step + margin else None


def checkpoint_margin(cfg: NodeConfig) -> int:
    """How many inner steps a checkpoint may lag its stage's live replicas and still be resumed."""
    return cfg.checkpoint.behind_rounds * (cfg.outer.inner_steps_per_outer or 1)


async def _checkpoint_stage(cfg: NodeConfig, manifest_hash: str, directory: PeerDirectory) -> int | None:
    """The stage of this run's one checkpoint in checkpoint.dir, if the swarm needs it there: nobody
    serves that stage (its weights are ours alone), or its replicas are not past our checkpoint and
    no other stage is empty (an empty stage stops the whole pipeline; the served one keeps its state)."""
    from noloco_node.node.checkpoint import saved_meta, stages_in

    folder = Path(cfg.checkpoint.dir).expanduser()
    stages = stages_in(folder, cfg.run.run_id, manifest_hash)
    if len(stages) != 1:
        return None
    stage, me = stages[0], directory.peer_id
    saved = int((saved_meta(folder, stage) or {}).get("inner_step", 0))
    fellows = [r for r in await directory.replicas(stage, fresh=True) if r.peer_id != me]
    ahead = _past(fellows, saved, checkpoint_margin(cfg))
    empty = None
    if fellows and ahead is None:  # served, and not past us: return unless another stage is empty
        for other in range(cfg.pipeline.num_stages):
            if other != stage and not any(r.peer_id != me for r in await directory.replicas(other, fresh=True)):
                empty = other
                break
    if ahead is not None:
        why = f"is more than {checkpoint_margin(cfg)} inner steps behind its live replicas (inner step {ahead})"
    elif empty is not None:
        why = f"is served by others while stage {empty} has no replica"
    else:
        log.info("stage auto: resuming stage %d from the checkpoint in %s", stage, cfg.checkpoint.dir)
        return stage
    log.info(
        "stage auto: the checkpoint of stage %d in %s (inner step %d) %s: choosing the stage the swarm needs most",
        stage,
        cfg.checkpoint.dir,
        saved,
        why,
    )
    return None
