"""Outer rounds among a few one-tensor peers (experiments/outer_peer.py), two ways with one
interface: `ProcessPeers` runs each peer as its own process over gRPC and the DHT; `MemoryPeers`
runs the same peers (same arguments, same state, same round loop) in this process over the
in-memory pairing twin. The math and protocol cases run on the second; what only processes show
(gRPC streams, a partner that dies mid-stream) on the first.

    peers.start(name, state, *outer_peer_args) -> info; peers.run_round() -> {name: results}
"""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from noloco_node.experiments.process_group import ProcessGroup

ROOT = Path(__file__).resolve().parents[1]
MATCH_S = 15.0
"""How long a process peer looks for a partner unless a test says: a pair forms in well under a second
when idle, and a round that goes solo on purpose passes its own --match-s."""


def t(values):
    return torch.tensor(values, dtype=torch.float64)


class ProcessPeers:
    def __init__(self, tmp_path: Path) -> None:
        self.dir, self.procs, self.go = tmp_path, [], tmp_path / "go"

    def start(self, name: str, state: dict, *extra: str) -> dict:
        save_file({k: t(v) for k, v in state.items()}, str(self.dir / f"{name}.state"))
        ready = self.dir / f"{name}.ready"
        initial = ["--initial-peers", self.first_maddr] if self.procs else []
        if "--match-s" not in extra:  # the peer's own 5 s is short for a loaded machine to pair in
            extra = (*extra, "--match-s", str(MATCH_S))
        # A group of its own per peer (a test kills one alone), forked from the zygote when it can be.
        with open(self.dir / f"{name}.log", "w") as log:
            proc = ProcessGroup().spawn(
                [
                    sys.executable,
                    "-m",
                    "noloco_node.experiments.outer_peer",
                    "--state",
                    str(self.dir / f"{name}.state"),
                    "--out",
                    str(self.dir / f"{name}.out"),
                    "--ready-file",
                    str(ready),
                    "--go-file",
                    str(self.go),
                    *initial,
                    *extra,
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append((name, proc))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (self.dir / f"{name}.log").read_text()[-2000:]
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        if len(self.procs) == 1:
            self.first_maddr = info["maddrs"][0]
        return info

    def run_round(self, timeout_s: float = 60) -> dict:
        time.sleep(0.5)  # let every record propagate before the round (DHT store is asynchronous)
        self.go.touch()
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = (self.dir / f"{name}.out").exists()
                raise AssertionError(
                    f"{name} still running after {timeout_s:.0f} s (result written: {out}); its log:\n"
                    + (self.dir / f"{name}.log").read_text()[-4000:]
                ) from None
        results = {}
        for name, _ in self.procs:
            out = self.dir / f"{name}.out"
            if out.exists():
                results[name] = {**load_file(str(out)), **json.loads(Path(str(out) + ".json").read_text())}
        return results

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


class MemoryPeers:
    """The same peers as ProcessPeers, each a NoLoCoSync over the in-memory pairing hub."""

    def __init__(self, tmp_path: Path) -> None:
        from noloco_node.pipeline.memory import MemoryNetwork
        from noloco_node.sync.memory import MemoryPairingHub

        self.dir, self.network, self.hub = tmp_path, MemoryNetwork(), MemoryPairingHub()
        self.peers: dict[str, tuple] = {}

    def start(self, name: str, state: dict, *extra: str) -> dict:
        from noloco_node.experiments import outer_peer
        from noloco_node.pipeline.router import Bans
        from noloco_node.runtime.compute import ComputeThread
        from noloco_node.sync.noloco import NoLoCoSync
        from noloco_node.sync.pairing import NoLoCoSettings
        from noloco_node.sync.ports import SyncParts

        path = self.dir / f"{name}.state"
        save_file({k: t(v) for k, v in state.items()}, str(path))
        args = outer_peer.parse(["--state", str(path), "--out", "-", "--ready-file", "-", "--go-file", "-", *extra])
        assert args.method == "noloco" and not args.die_after_writes, "processes only (ProcessPeers)"
        model, outer_state, tensors = outer_peer.initial_state(args)
        self.network.register(name, 0, None)

        async def set_status(status: str, round_index: int) -> None:
            await self.network.set_status(name, status, round_index)

        compute, bans = ComputeThread(), Bans()
        parts = SyncParts(compute=compute, peer_id=name, stage=0, set_status=set_status)
        sync = NoLoCoSync(
            outer_state,
            outer_peer.outer_config(args),
            parts,
            transport=self.hub.transport(name),
            directory=self.network.directory(),
            settings=NoLoCoSettings(match_s=args.match_s, payload=args.payload),
            bans=bans,
        )
        self.hub.register(name, sync)
        self.peers[name] = (args, sync, model, outer_state, tensors, bans, compute)
        return {"peer_id": name}

    def run_round(self, timeout_s: float = 60) -> dict:
        from noloco_node.experiments.outer_peer import run_rounds

        async def all_rounds():
            return await asyncio.wait_for(
                asyncio.gather(
                    *(
                        run_rounds(args, sync, model, state, tensors)
                        for args, sync, model, state, tensors, _, _ in self.peers.values()
                    )
                ),
                timeout_s,
            )

        outcomes = asyncio.run(all_rounds())
        results = {}
        for (name, (args, sync, model, state, _, bans, _)), (outcome, per_round) in zip(self.peers.items(), outcomes):
            results[name] = {
                "phi": state.phi["w"],
                "momentum": state.momentum["w"],
                "theta": model.w.detach().clone(),
                **per_round,
                "outcome": outcome,
                "peer_id": name,
                "bytes_sent": sync.bytes_sent,
                "method": args.method,
                "history": sync.counters.history,
                "banned": bans.total,
                "counters": {k: v for k, v in vars(sync.counters).items() if k != "history"},
            }
        return results

    def stop(self) -> None:
        for *_, compute in self.peers.values():
            compute.shutdown()
