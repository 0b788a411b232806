"""`noloco-node join`: serve one pipeline stage of a run (stage 0 also drives training)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from noloco_node.cli.common import (
    add_config_flags,
    check_listen,
    require_initial_peers,
    resolve_config,
    stop_on_signals,
)
from noloco_node.runtime.files import atomic_write_text
from noloco_node.runtime.node_status import Status

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("join", help="serve a pipeline stage of a run", description=__doc__)
    add_config_flags(p)
    # In this order: --help lists the flags as they are added.
    _add_swarm_flags(p)
    _add_observer_flags(p)
    _add_training_flags(p)
    _add_output_flags(p)
    p.set_defaults(run=run)


def _add_swarm_flags(p: argparse.ArgumentParser) -> None:
    """Where the node joins (peers, stage) and the address it is reached at."""
    p.add_argument("--initial-peers", nargs="*", metavar="MADDR", help="DHT multiaddrs to bootstrap from")
    p.add_argument(
        "--stage",
        type=_stage,
        help="the stage to serve, or 'auto': an empty stage, else the one whose replicas "
        "sustain the least (measured capacity; fewest replicas until measured), whose state is then "
        "fetched from a replica (pipeline.stage)",
    )
    p.add_argument(
        "--host", help="address to bind (network.host; 0.0.0.0 = every interface, announcing the address peers observe)"
    )
    p.add_argument("--port", type=int, help="gRPC port (network.port, 0 = any)")
    p.add_argument(
        "--announce-addr",
        metavar="HOST:PORT",
        help="the address peers dial (network.announce_addr); "
        "checked at join by asking live peers to call our health endpoint; behind NAT, leave it out: "
        "the node is then reached over libp2p (hole punching or a relay)",
    )


def _add_observer_flags(p: argparse.ArgumentParser) -> None:
    """How people and tools watch the node: its web page and its event stream."""
    p.add_argument(
        "--dashboard",
        metavar="[HOST:]PORT",
        help="serve this node's web page (and the swarm as it sees "
        "it, at /swarm) here (network.dashboard); a bare PORT binds 127.0.0.1: this machine only",
    )
    p.add_argument("--events", metavar="FILE", help="append a JSONL event stream here (log.events_file)")


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    """How long stage 0 trains, what it waits for, and the threads it computes with."""
    p.add_argument(
        "--steps",
        type=_whole,
        metavar="N",
        help="stage 0: train until inner step N, then leave (a node "
        "that resumed from its checkpoint or fetched a replica's state runs only what is left); 0 = train "
        "nothing, only serve; without it, stage 0 trains until the run's inner.total_steps and then keeps "
        "serving until stopped",
    )
    p.add_argument(
        "--serve-after",
        action="store_true",
        help="stage 0 with --steps: keep serving after the last "
        "step (phi for joiners and `export --initial-peers`) until stopped",
    )
    p.add_argument(
        "--wait-replicas",
        type=_positive,
        default=1,
        metavar="N",
        help="stage 0: wait (as long as it takes) until every stage has this many replicas",
    )
    p.add_argument("--threads", type=int, help="torch threads for this process (default: all cores)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What the node writes for launchers, tests and experiments."""
    p.add_argument("--out", help="write this node's stats (and weights with --save-weights) here on exit")
    p.add_argument("--save-weights", action="store_true")
    p.add_argument(
        "--ready-file",
        help="write {peer_id, address, stage, inner_step, in_flight} here once serving, "
        "refreshed every 0.1 s (for launchers and tests)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        metavar="K",
        help="experiments: save theta every K inner steps (and at start) under --snapshot-dir",
    )
    p.add_argument("--snapshot-dir", help="where --snapshot-every writes stage{s}-{peer}-step{k}.safetensors")


def _whole(value: str, least: int = 0) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= {least}")
    return number


def _dashboard_listen(value: str) -> tuple[str, dict[str, int]]:
    from noloco_node.config.listen import parse_listen

    host, port = parse_listen(value)
    return host, {"network.dashboard": port}


def _positive(value: str) -> int:
    return _whole(value, least=1)


def _stage(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither a stage index nor 'auto'")
    return value


def run(args: argparse.Namespace) -> int:
    config = resolve_config(
        args,
        flags={
            "network": {
                "initial_peers": args.initial_peers,
                "host": args.host,
                "port": args.port,
                "announce_addr": args.announce_addr,
                "dashboard": args.dashboard,
            },
            "pipeline": {"stage": args.stage},
            "log": {"events_file": args.events},
        },
    )
    net = config.network

    def named(flag: str, field: str, given) -> str:  # what the user typed: a flag, else the config's field
        return flag if given is not None else field

    check_listen(
        net.host,
        {
            named("--port", "network.port", args.port): net.port,
            "network.dht_port": net.dht_port,
            "network.metrics_port": net.metrics_port,
        },
        named("--host", "network.host", args.host),
    )
    if net.dashboard is not None:
        check_listen(*_dashboard_listen(net.dashboard), named("--dashboard", "network.dashboard", args.dashboard))
    require_initial_peers(config)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config, slot = _with_checkpoint_home(config)
    try:
        return asyncio.run(_serve(config, args, slot))
    finally:
        if slot is not None:
            slot.release()


def _with_checkpoint_home(config):
    """(config, held slot): a node with no checkpoint.dir keeps its checkpoints in a slot of its
    own under the state home (node/checkpoint_home.py), unless checkpoint.auto is false."""
    from noloco_node.node.checkpoint_home import CheckpointSlot, config_fingerprint

    if config.checkpoint.dir is not None:
        return config, CheckpointSlot.hold(Path(config.checkpoint.dir).expanduser())
    if not config.checkpoint.auto:
        return config, None
    import dataclasses

    fingerprint = config_fingerprint(config)
    if config.pipeline.stage is None:
        prefer, avoid = _unserved_checkpoints(config, fingerprint), []
    else:
        prefer, avoid = _checkpoints_of_stage(config, fingerprint, config.pipeline.stage)
    slot = CheckpointSlot.claim(config.run.run_id, fingerprint, prefer=prefer, avoid=avoid)
    checkpoint = dataclasses.replace(config.checkpoint, dir=str(slot.directory))
    return dataclasses.replace(config, checkpoint=checkpoint), slot


def _free_slot_stages(config, fingerprint: str) -> tuple[dict[Path, list[int]], str]:
    """The free checkpoint folders of this run and config, lowest first, each with the stages it
    holds a checkpoint of; and the manifest hash (read only when there is a free folder)."""
    from noloco_node.node.checkpoint import stages_in
    from noloco_node.node.checkpoint_home import CheckpointSlot
    from noloco_node.node.manifest import load_run_inputs

    free = CheckpointSlot.free_slots(config.run.run_id, fingerprint)
    if not free:
        return {}, ""
    _, _, manifest_hash = load_run_inputs(config)
    return {slot: stages_in(slot, config.run.run_id, manifest_hash) for slot in free}, manifest_hash


def _checkpoints_of_stage(config, fingerprint: str, stage: int) -> tuple[list[Path], list[Path]]:
    """`--stage S`: the free folders holding S's checkpoint, furthest first, and those holding only
    other stages', to pass over (checkpoint_home.stage_slots_first). A newcomer's pinned stage-1
    node took the lowest free folder, a stage-0 checkpoint's, started at step 0 beside it without
    a word, and a later `--stage auto` resumed that stage 0 next to an untrained stage 1."""
    from noloco_node.node.checkpoint import saved_meta
    from noloco_node.node.checkpoint_home import stage_slots_first

    stages_by_slot, _ = _free_slot_stages(config, fingerprint)
    if not stages_by_slot:
        return [], []
    return stage_slots_first(stages_by_slot, stage, lambda slot: int(saved_meta(slot, stage).get("inner_step", 0)))


def _unserved_checkpoints(config, fingerprint: str) -> list[Path]:
    """`--stage auto` where this machine's stopped nodes left checkpoints the lowest free folder does
    not hold all of (several stages, or an empty folder below one): the free folders whose stage the
    swarm has no live replica of, asked of the swarm first. Without it the lowest free folder was
    taken: a node stopped second and started first took the other's stage-0 folder (or an empty
    one, left by a node that never trained) while its own stage-1 weights, the stage's only copy,
    sat unused beside it."""
    from noloco_node.node.checkpoint_home import unserved_first
    from noloco_node.node.discovery import stages_served
    from noloco_node.rpc.security import read_swarm_key

    stages_by_slot, manifest_hash = _free_slot_stages(config, fingerprint)
    if not stages_by_slot:
        return []
    on_disk = {stage for stages in stages_by_slot.values() for stage in stages}
    if not on_disk or (len(on_disk) == 1 and next(iter(stages_by_slot.values()))):
        return []  # nothing on disk, or the lowest free folder holds the one stage there is
    try:
        served = asyncio.run(stages_served(config, manifest_hash, read_swarm_key(config.security)))
    except Exception as exc:  # noqa: BLE001 - the node's own start says what is wrong with the swarm
        log.debug("could not ask the swarm which stages are served: %r", exc)
        return []
    return unserved_first(stages_by_slot, served)


async def _serve(config, args: argparse.Namespace, slot=None) -> int:
    from noloco_node.node.lifecycle import Node, NodeOutputs
    from noloco_node.node.serving import ServePlan, serve

    stop = stop_on_signals()
    outputs = NodeOutputs(
        out_dir=Path(args.out) if args.out else None,
        save_weights=args.save_weights,
        snapshot_every=args.snapshot_every,
        snapshot_dir=Path(args.snapshot_dir or "snapshots"),
    )
    node = await Node.create(config, outputs=outputs)  # a start that fails closes what it opened
    if slot is not None:  # said once the node is up: a start that fails says only why
        log.info(
            "checkpoints every %d inner steps and on stop in %s%s",
            config.checkpoint.every_steps,
            slot.directory,
            "" if slot.named else " (--set checkpoint.dir=DIR for another folder, checkpoint.auto=false for none)",
        )
    plan = ServePlan(steps=args.steps, serve_after=args.serve_after, wait_replicas=args.wait_replicas)
    return await serve(node, plan, stop, _JoinReporter(config, args))


class _JoinReporter:
    """Step lines (or a progress line on a terminal), the closing summary and --ready-file."""

    def __init__(self, config, args: argparse.Namespace) -> None:
        self.config, self.args = config, args
        self.progress = _progress(config.log.progress)
        self.node = None
        self.training = None  # a TrainingLog from the first attach on
        self.ticks = 0
        self.waiting_said: str | None = None

    async def attach(self, node) -> None:
        from noloco_node.node.reporting import TrainingLog
        from noloco_node.runtime.logging import setup_logging

        self.node = node
        setup_logging(
            logging.getLevelName(logging.getLogger().level), prefix=f"{node.peer_id[-6:]} s{node.stage_index}"
        )
        self.maddrs = await node.directory.visible_maddrs()
        # The progress line shows the same on a terminal; without one, step lines go to the log instead.
        steps = self.args.steps or self.config.inner.total_steps
        if self.training is not None:  # a move: one summary for the whole session
            self.training.moved(total=steps if node.stage_index == 0 else None)
        else:
            self.training = TrainingLog(
                self.config.log.every_steps if self.progress is None else 0,
                total=steps if node.stage_index == 0 else None,
            )
        self.warned: set[str] = set()
        await self()

    async def __call__(self, _step: int = 0) -> None:
        from noloco_node.node.stats import ready_fields, training_snapshot

        node = self.node
        self.training.observe(node.worker.tokens_total, node.worker.inner_steps)
        if self.training.due(node.worker.inner_steps):
            self.training.step(training_snapshot(node.read_stats()))
        if self.args.ready_file:
            atomic_write_text(self.args.ready_file, json.dumps({**ready_fields(node), "maddrs": self.maddrs}))
        self.ticks += 1
        self._say_waiting(node.progress.waiting_for)
        if self.ticks % 10 == 0:
            self._warn(node.attention())
        if self.progress is not None and self.ticks % 5 == 0:
            self.progress.update(_progress_text(node))

    def _say_waiting(self, what: str | None) -> None:
        """One line when the node starts waiting for a stage's replica and one when it stops: off a
        terminal (systemd, Docker, a log file) a first node otherwise said nothing for minutes."""
        said = self.waiting_said
        if what == said:
            return
        if what is not None:
            if self.node is None or self.node.done_at_step is None:  # a stage 0 that trained all waits for nothing
                log.info("waiting for %s: nothing trains until one joins the swarm", what)
        elif said is not None:
            log.info("no longer waiting for %s", said)
        self.waiting_said = what

    def _warn(self, notes: list[str]) -> None:
        """Each new warning once in the log (the progress line shows it while it lasts)."""
        causes = {note.split(": ", 1)[-1]: note for note in notes}
        for cause, note in causes.items():
            if cause not in self.warned:
                log.warning("%s", note)
        self.warned = set(causes)

    def stopping(self, node) -> None:
        if self.progress is not None:
            self.progress.close()

    def stopped(self, node) -> None:
        from noloco_node.node.stats import training_snapshot

        self.training.summary(training_snapshot(node.read_stats()))


def _progress(mode: str):
    from noloco_node.runtime.logging import ProgressLine

    line = ProgressLine()
    line.enabled = mode == "on" or (mode == "auto" and line.enabled)
    return line if line.enabled else None


def _progress_text(node) -> str:
    stats = node.runtime.stats
    doing = node.progress.waiting_text() or node.status
    if node.done_at_step is not None:
        doing = f"trained all {node.done_at_step} steps; serving until stopped"
    elif doing == Status.SERVING and node.stage_index > 0 and node.progress.since_progress_s() > 5:
        doing = f"waiting for microbatches from stage {node.stage_index - 1}; {node.progress.since_progress_s():.0f} s"
    text = (
        f"stage {node.stage_index} | {doing} | inner step {node.worker.inner_steps} | outer round "
        f"{node.outer_round} | {node.tokens_per_s:.0f} tok/s | "
        f"in flight {len(node.runtime.in_flight)} | sent {stats.forwards_sent} fwd {stats.backwards_sent} bwd"
    )
    if node.driver is not None and node.driver.log.step_losses:
        text += f" | loss {node.driver.log.step_losses[-1]:.3f}"
    notes = node.attention()
    if notes:
        text += f" | ! {notes[0]}"
    return text
