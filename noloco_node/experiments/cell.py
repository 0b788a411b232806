"""One cell of an experiment grid: a local swarm (bootstrap + D x P node processes) whose every
node sits behind a WAN relay with the cell's profile (the node announces the relay's address,
for gRPC and, for the all-reduce baselines, for hivemind), trained for `steps` inner steps; then
its events, stats and theta snapshots are reduced to one results row and a few curves."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from noloco_node.config import load_config
from noloco_node.experiments.evaluate import evaluate_snapshots, pearson
from noloco_node.experiments.launcher import LocalSwarm, NodeProcess
from noloco_node.experiments.ports import RelayProcess, free_ports
from noloco_node.experiments.scenario import Cell, Scenario
from noloco_node.runtime.events import read_events


def cell_overrides(scenario: Scenario, cell: Cell) -> list[str]:
    values = {f"{k}": v for k, v in scenario.overrides.items()}
    values.update(dict(cell.variant.overrides) if cell.variant else {})
    values.update(
        {
            "run.run_id": cell.name,
            "run.seed": cell.seed,
            "outer.method": cell.method,
            "pipeline.num_stages": cell.stages,
            "log.progress": "off",
        }
    )
    if cell.method in ("diloco", "dp"):
        values["outer.allreduce_group_size"] = cell.replicas
    return [f"{k}={v}" for k, v in values.items()]


def run_cell(scenario: Scenario, cell: Cell, out_dir: Path) -> dict:
    """Run the cell; returns {'row': results row, 'curves': per-step series}. Raises on failure.
    A folder left by an earlier run of the same cell is replaced (event streams append)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    overrides = cell_overrides(scenario, cell)
    config = load_config(overrides=overrides)
    events_dir, snapshots = out_dir / "events", out_dir / "snapshots"
    slots = [(s, d) for s in range(cell.stages) for d in range(cell.replicas)]
    slot_ports, routes = _slot_ports(cell, len(slots))
    relay = RelayProcess(cell.profile, routes, out_dir)
    swarm = LocalSwarm(out_dir / "swarm", overrides=overrides, threads=scenario.threads, startup_timeout_s=120)
    started = time.time()
    try:
        swarm.start_bootstrap()

        def start(slot_index: int, *extra: str) -> NodeProcess:
            s, d = slots[slot_index]
            args = _node_args(scenario, cell, out_dir, (s, d), slot_ports[slot_index], extra)
            return swarm.start_node(s, d, *args)

        _train(scenario, cell, swarm, slots, start, out_dir)
        _wait_for_last_snapshots(scenario, swarm, events_dir, snapshots)
    finally:
        swarm.stop()
        relay.stop()
    wall_s = time.time() - started
    return summarize(scenario, cell, config, swarm, events_dir, snapshots, wall_s)


def _slot_ports(cell: Cell, num_slots: int) -> tuple[list[tuple[int, int, int, int]], dict[int, int]]:
    """Per slot (gRPC, its relay port, all-reduce, its relay port), and the relay's routes to the
    nodes: the all-reduce ports only go through the relay for the methods that all-reduce."""
    ports = free_ports(4 * num_slots)
    grpc, grpc_relay, ar, ar_relay = (ports[i * num_slots : (i + 1) * num_slots] for i in range(4))
    routes = dict(zip(grpc_relay, grpc)) | (dict(zip(ar_relay, ar)) if cell.method in ("diloco", "dp") else {})
    return list(zip(grpc, grpc_relay, ar, ar_relay)), routes


def _node_args(
    scenario: Scenario,
    cell: Cell,
    out_dir: Path,
    slot: tuple[int, int],
    ports: tuple[int, int, int, int],
    extra: tuple[str, ...],
) -> list[str]:
    """The command-line arguments of the node in `slot`: it listens on its own ports and
    announces the relay's, so every link it has goes through the cell's profile."""
    s, d = slot
    grpc, grpc_relay, ar, ar_relay = ports
    args = [
        "--port",
        str(grpc),
        "--announce-addr",
        f"127.0.0.1:{grpc_relay}",
        "--events",
        str(out_dir / "events" / f"stage{s}-r{d}.jsonl"),
        "--snapshot-every",
        str(scenario.eval_every),
        "--snapshot-dir",
        str(out_dir / "snapshots"),
        *extra,
    ]
    if scenario.chaos_action == "kill":  # a killed node restarts from its own checkpoint
        args += [
            "--set",
            f"checkpoint.dir={out_dir / 'checkpoints' / f'{s}-{d}'}",
            "--set",
            "checkpoint.every_steps=1",
        ]
    if cell.method in ("diloco", "dp"):
        args += [
            "--set",
            f"network.allreduce_port={ar}",
            "--set",
            f"network.allreduce_announce=127.0.0.1:{ar_relay}",
        ]
    return args


def _train(
    scenario: Scenario,
    cell: Cell,
    swarm: LocalSwarm,
    slots: list[tuple[int, int]],
    start: Callable[..., NodeProcess],
    out_dir: Path,
) -> None:
    """Start the servers (stages > 0) before the stage-0 drivers that route to them, and wait for
    the drivers to finish training (under chaos, when the scenario has it); raises when one failed."""
    servers = [start(i) for i, (s, _) in enumerate(slots) if s > 0]
    swarm.wait_ready(servers)
    drivers = [
        start(i, "--steps", str(scenario.steps), "--wait-replicas", str(cell.replicas))
        for i, (s, _) in enumerate(slots)
        if s == 0
    ]
    swarm.wait_ready(drivers)
    if scenario.chaos_action is None:
        swarm.wait_exit(drivers, timeout_s=scenario.cell_timeout_s)
    else:
        drivers = _wait_under_chaos(scenario, cell, swarm, out_dir)
    failed = [n.label for n in drivers if n.proc.returncode != 0]
    if failed:
        raise RuntimeError(f"{', '.join(failed)} exited with an error; see {out_dir / 'swarm' / 'logs'}")


def _wait_for_last_snapshots(scenario: Scenario, swarm: LocalSwarm, events_dir: Path, snapshots: Path) -> None:
    # A stage > 0 replica that reached the last step takes its outer step and writes that
    # step's snapshot in the background after stage 0 exits: give it a bounded moment. One
    # that ended short of it (routing gave it fewer microbatches) has nothing more to do;
    # its final snapshot is written when it is stopped.
    deadline, settle = time.monotonic() + 30, time.monotonic() + 1.0
    while time.monotonic() < deadline and (
        time.monotonic() < settle or _last_snapshots_pending(scenario, swarm, events_dir, snapshots)
    ):
        time.sleep(0.2)


def _last_snapshots_pending(scenario: Scenario, swarm: LocalSwarm, events_dir: Path, snapshots: Path) -> bool:
    if scenario.steps % scenario.eval_every:
        return False
    for node in swarm.nodes:
        if node.stage == 0 or not node.info:
            continue
        events = events_dir / f"stage{node.stage}-r{node.replica}.jsonl"
        reached = events.exists() and any(
            e["event"] == "inner_step" and e["inner_step"] >= scenario.steps for e in read_events(events)
        )
        name = f"stage{node.stage}-{node.info['peer_id'][-8:]}-step{scenario.steps}.safetensors"
        if reached and not (snapshots / name).exists():
            return True
    return False


def _wait_under_chaos(scenario: Scenario, cell: Cell, swarm: LocalSwarm, out_dir: Path) -> list:
    """Wait for the drivers while a ChaosMonkey acts; restarted drivers replace killed ones.
    The monkey's actions are written to chaos.json next to the cell's events."""
    from noloco_node.experiments.chaos import ChaosMonkey

    def eligible(node) -> bool:
        return (
            scenario.chaos_action != "kill"
            or (out_dir / "checkpoints" / f"{node.stage}-{node.replica}" / f"stage{node.stage}.json").exists()
        )

    with ChaosMonkey(swarm, scenario.chaos_profile(), seed=cell.seed, eligible=eligible) as monkey:
        drivers = monkey.wait_for_drivers(cell.replicas, scenario.cell_timeout_s)
    (out_dir / "chaos.json").write_text(json.dumps(monkey.events, indent=1))
    return drivers


def outer_lag_steps(history: list[dict]) -> float:
    """Mean inner steps between a paired NoLoCo round's boundary and the step its update landed at:
    0 when blocking; under outer.overlap, the staleness the rounds actually had. NaN: no such round."""
    lags = [
        r["applied_at_step"] - r["inner_step"]
        for r in history
        if r.get("outcome") == "paired" and "applied_at_step" in r and "inner_step" in r
    ]
    return statistics.fmean(lags) if lags else math.nan


def summarize(
    scenario: Scenario, cell: Cell, config, swarm: LocalSwarm, events_dir: Path, snapshots: Path, wall_s: float
) -> dict:
    """The cell's results row, its evaluations and its training curve, from what its nodes left."""
    stats = swarm.node_stats()
    by_slot = {(n.stage, n.replica): n.info["peer_id"] for n in swarm.nodes}
    columns = [[by_slot[(s, d)][-8:] for s in range(cell.stages)] for d in range(cell.replicas)]
    evals = evaluate_snapshots(
        config, snapshots, columns, eval_sequences=scenario.eval_sequences, final_step=scenario.steps
    )
    train = _train_curve(events_dir, cell.replicas)
    _place_evaluations(evals, train)
    idle = _idle_fractions(events_dir)
    node_bytes = [s.get("bytes_sent", 0) + s.get("bytes_sent_outer", 0) for s in stats.values()]
    driver_stats = [stats[by_slot[(0, d)]] for d in range(cell.replicas)]
    mb = {k: sum(s["microbatches"][k] for s in driver_stats) for k in ("issued", "completed", "reissued", "dropped")}
    row = {
        **cell.columns(),
        "status": "ok",
        "steps": scenario.steps,
        **_training_columns(evals, train, config.inner.warmup_steps, wall_s=wall_s, idle=idle, node_bytes=node_bytes),
        **_outer_columns(stats),
        "nodes_short": _nodes_short(stats, by_slot, scenario.steps),
        **{f"mb_{k}": v for k, v in mb.items()},
    }
    return {"row": row, "evals": evals, "train": train}


def _train_curve(events_dir: Path, replicas: int) -> list[dict]:
    """Per inner step, the stage-0 drivers' mean train loss, lr and seconds since the last of them started."""
    drivers = [read_events(events_dir / f"stage0-r{d}.jsonl") for d in range(replicas)]
    t0 = max(next(e["ts"] for e in ev if e["event"] == "started") for ev in drivers)
    steps: dict[int, dict] = {}
    for ev in drivers:
        for e in ev:
            if e["event"] == "inner_step":
                entry = steps.setdefault(e["inner_step"], {"loss": [], "lr": [], "t": []})
                entry["loss"].append(e.get("loss", math.nan))
                entry["lr"].append(e["lr"])
                entry["t"].append(e["ts"] - t0)
    return [
        {
            "step": k,
            "train_loss": statistics.fmean(v["loss"]),
            "lr": statistics.fmean(v["lr"]),
            "wall_s": statistics.fmean(v["t"]),
        }
        for k, v in sorted(steps.items())
    ]


def _place_evaluations(evals: list[dict], train: list[dict]) -> None:
    """Give each evaluation the wall time and lr of its step on the training curve."""
    by_step = {row["step"]: row for row in train}
    for row in evals:
        row["wall_s"] = by_step.get(row["step"], {}).get("wall_s", 0.0)
        row["lr"] = by_step.get(row["step"], {}).get("lr", math.nan)


def _idle_fractions(events_dir: Path) -> list[float]:
    """Each node's share of its training time spent waiting."""
    idle = []
    for path in events_dir.glob("*.jsonl"):
        steps_seen = [e for e in read_events(path) if e["event"] == "inner_step"]
        if len(steps_seen) > 1:  # between the first and the last inner step: training only, not start-up
            first, last = steps_seen[0], steps_seen[-1]
            busy, wait = last["busy_s"] - first["busy_s"], last["idle_s"] - first["idle_s"]
            idle.append(wait / max(1e-9, busy + wait))
    return idle


def _training_columns(
    evals: list[dict],
    train: list[dict],
    warmup_steps: int,
    *,
    wall_s: float,
    idle: list[float],
    node_bytes: list[float],
) -> dict:
    """The results row's losses, times, bytes per node, idle share and replica spread."""
    after_warmup = [r for r in evals if r["step"] > warmup_steps]
    return {
        "final_val_loss": evals[-1]["val_loss"] if evals else math.nan,
        "final_eval_step": evals[-1]["step"] if evals else -1,
        "final_train_loss": train[-1]["train_loss"] if train else math.nan,
        "wall_s": round(wall_s, 2),
        "train_wall_s": round(train[-1]["wall_s"], 2) if train else math.nan,
        "bytes_per_node": statistics.fmean(node_bytes) if node_bytes else 0.0,
        "idle_fraction": statistics.fmean(idle) if idle else math.nan,
        "final_spread": evals[-1]["spread"] if evals else math.nan,
        "spread_lr_pearson": pearson([r["spread"] for r in after_warmup], [r["lr"] for r in after_warmup]),
    }


def _nodes_short(stats: dict, by_slot: dict, steps: int) -> str:
    """The nodes that ended short of the cell's inner steps, as `s1r1:19` (stage, replica, steps
    taken): a later stage steps once per batch it received, and one given fewer microbatches than
    its peers missed the last outer round (a researcher's audit: a DiLoCo cell read `ok` with one)."""
    short = [
        f"s{stage}r{replica}:{stats[peer]['inner_steps']}"
        for (stage, replica), peer in sorted(by_slot.items())
        if peer in stats and stats[peer].get("inner_steps", steps) < steps
    ]
    return " ".join(short)


def _outer_columns(stats: dict) -> dict:
    """The results row's outer-round counts and lag, and the bytes the pipeline and the exchanges sent."""
    outer = [s["outer"] for s in stats.values() if "outer" in s]
    exchanged = [
        r
        for s in stats.values()
        for r in s.get("outer_history", [])
        if r.get("outcome") == "paired" and isinstance(r.get("bytes"), dict)
    ]
    return {
        "outer_rounds": sum(o.get("rounds", 0) for o in outer),
        "outer_paired": sum(o.get("paired", 0) for o in outer),
        "outer_solo": sum(o.get("solo", 0) for o in outer),
        "outer_partial": sum(o.get("partial_rounds", 0) for o in outer),
        "outer_skipped": sum(o.get("skipped", 0) for o in outer),  # dp: rounds all replicas skipped together
        "outer_resynced": sum(o.get("resynced", 0) for o in outer),  # dp: apart replicas averaged back
        "outer_lag_steps": outer_lag_steps([r for s in stats.values() for r in s.get("outer_history", [])]),
        "pipeline_bytes_per_node": statistics.fmean(s.get("bytes_sent", 0) for s in stats.values()) if stats else 0.0,
        # What one node sends in one NoLoCo exchange (all kinds), and the relative error of its Delta
        # on the wire; the all-reduce baselines leave these empty.
        "outer_bytes_per_round": statistics.fmean(sum(r["bytes"].values()) for r in exchanged)
        if exchanged
        else math.nan,
        "delta_rel_error": statistics.fmean(r.get("delta_rel_error", math.nan) for r in exchanged)
        if exchanged
        else math.nan,
    }
