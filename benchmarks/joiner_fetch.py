"""How long a joining replica waits before its first inner step: its stage's state (phi, m, Adam's
moments, counters) fetched over Outer.FetchState from donors behind emulated uplinks, imported,
and one inner step taken. Today's way (one donor, every tensor fp32) against the new one (the
stage split between two donors, compact: phi exact, m bf16, exp_avg int8, exp_avg_sq bf16), and
the two halves of the change on their own, in one run on the same machine. Then the top-up a joiner
asks for when its copy took rounds (sync/top_up.py): the donors' phi moves on by a few rounds'
worth, and the joiner fetches the difference of the phi it holds (int8), timed over the same links.

Real gRPC servers (OuterServicer) on 127.0.0.1, each behind its own netem relay
(noloco_node/netem/relay.py: the rate and latency in each direction of each connection), so each
donor has its own uplink, as volunteers at home do; the joiner's downlink is not limited. The
stage is `--layers` decoder layers of the `small` preset's shape (hidden 768, intermediate 3072:
9.44 M parameters per layer). A whole `small` stage (6 layers, 57 M parameters, 906 MB dense)
would take 6 minutes per run at 20 Mbit/s here, so the default is one layer: the times scale with
the bytes, and the bytes per parameter are what the encoding sets. The donor's values are random
with the magnitudes training gives (phi ~ 0.02, m ~ 1e-3, exp_avg ~ 1e-4, exp_avg_sq ~ 1e-8).

    .venv/bin/python benchmarks/joiner_fetch.py [--layers 1] [--mbit 20] [--one-way-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import grpc
import torch
from torch import nn

from noloco_node.netem.relay import LinkProfile, Relay
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterClient, OuterServicer
from noloco_node.runtime.link_estimates import LinkDeadlines
from noloco_node.sync.state_fetch import fetch_from_donors
from noloco_node.codec.state_layout import parameter_bytes, state_spec
from noloco_node.sync.top_up import top_up_from_donors
from noloco_node.sync.transfer import apply_top_up, counters_json, expected_tensors, import_state
from noloco_node.wire.v1 import outer_pb2_grpc

HIDDEN, INTERMEDIATE = 768, 3072  # the `small` preset (config/sections.py MODEL_PRESETS)
SCENARIOS = (
    ("one donor, dense (before)", 1, False),
    ("one donor, compact", 1, True),
    ("two donors, dense", 2, False),
    ("two donors, compact (after)", 2, True),
)


def stage_parameters(layers: int) -> dict[str, nn.Parameter]:
    shapes = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "input_norm.weight": (HIDDEN,), p + "post_norm.weight": (HIDDEN,)})
        shapes.update({p + f"attn.{w}.weight": (HIDDEN, HIDDEN) for w in "qkvo"})
        shapes.update(
            {
                p + "mlp.gate.weight": (INTERMEDIATE, HIDDEN),
                p + "mlp.up.weight": (INTERMEDIATE, HIDDEN),
                p + "mlp.down.weight": (HIDDEN, INTERMEDIATE),
            }
        )
    return {n: nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}


class Donor:
    """sync.ports.StateDonor with training-like magnitudes."""

    def __init__(self, params: dict[str, nn.Parameter], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors = {}
        for n, p in params.items():
            self.tensors[f"phi/{n}"] = torch.randn(p.shape, generator=g) * 0.02
            self.tensors[f"momentum/{n}"] = torch.randn(p.shape, generator=g) * 1e-3
            self.tensors[f"adam_exp_avg/{n}"] = torch.randn(p.shape, generator=g) * 1e-4
            self.tensors[f"adam_exp_avg_sq/{n}"] = torch.rand(p.shape, generator=g) * 1e-8
        self.counters = counters_json({"inner_step": 500, "outer_round": 10, "adam_steps": {n: 500.0 for n in params}})

    async def export_state(self):
        return dict(self.tensors), self.counters

    def train_on(self, seed: int) -> None:
        """phi moves by what a few outer rounds move it (~1e-4 against phi's ~0.02)."""
        g = torch.Generator().manual_seed(seed)
        for name in [n for n in self.tensors if n.startswith("phi/")]:
            self.tensors[name] = self.tensors[name] + torch.randn(self.tensors[name].shape, generator=g) * 1e-4
        self.counters = counters_json({"inner_step": 540, "outer_round": 14, "adam_steps": {}})


class RelayDialer:
    def __init__(self, addresses: dict[str, str]) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        self.channels = {p: grpc.aio.insecure_channel(a, options=options) for p, a in addresses.items()}

    async def channel(self, peer_id: str):
        return self.channels[peer_id], "direct"

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


async def run(layers: int, donors: int, compact: bool, profile: LinkProfile) -> dict:
    params = stage_parameters(layers)
    servers, relays, addresses, donor_states = [], [], {}, []
    for i in range(donors):
        server = grpc.aio.server()
        # Each donor holds the same state, as a stage's replicas nearly do.
        outer_pb2_grpc.add_OuterServicer_to_server(
            OuterServicer(
                None,
                peer_id=f"donor{i}",
                run=ServedRun("bench", "h", 1),
                max_bytes=1 << 30,
                deadlines=LinkDeadlines(),
                donor=(donor_state := Donor(params, seed=1)),
            ),
            server,
        )
        donor_states.append(donor_state)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        relay = Relay(f"127.0.0.1:{port}", profile, seed=i)
        await relay.start()
        servers.append(server)
        relays.append(relay)
        addresses[f"donor{i}"] = relay.address
    dialer = RelayDialer(addresses)
    client = OuterClient(run_id="bench", manifest_hash="h", max_bytes=1 << 30, dialer=dialer)
    outer = OuterState(params.items(), alpha=0.5, beta=0.7)
    inner = InnerOptimizer(params.values(), InnerSchedule(lr_max=1e-4, warmup_steps=1, total_steps=1000))
    expected = expected_tensors(outer)
    try:
        began = time.monotonic()
        fetched = await fetch_from_donors(
            client,
            list(addresses),
            stage=1,
            requester="joiner",
            timeout_s=600,
            expected=expected,
            compact=compact,
            max_donors=donors,
        )
        fetched_s = time.monotonic() - began
        import_state(outer, inner, fetched.tensors, fetched.counters)
        imported_s = time.monotonic() - began
        for p in params.values():  # the first inner step, on the imported Adam state
            p.grad = torch.randn_like(p) * 1e-3
        inner.step()
        first_step_s = time.monotonic() - began
        top_up_s = top_up_bytes = None
        if compact:
            for i, donor_state in enumerate(donor_states):
                donor_state.train_on(seed=10 + i)
            topping = time.monotonic()
            differences, _ = await top_up_from_donors(
                client, fetched.owner, stage=1, requester="joiner", timeout_s=600, expected=expected
            )
            top_up_s = time.monotonic() - topping
            top_up_bytes = sum(
                state_spec(n, tuple(d.shape), d.dtype, False, True).payload_bytes for n, d in differences.items()
            )
            apply_top_up(outer, inner, differences, {"inner_step": 540, "outer_round": 14})
            owner = {n: donor_states[int(d.removeprefix("donor"))] for n, d in fetched.owner.items()}
            error = max(float((outer.phi[n] - owner[n].tensors[f"phi/{n}"]).abs().max()) for n in params)
    finally:
        await dialer.close()
        for relay in relays:
            await relay.close()
        for server in servers:
            await server.stop(None)
    numel = sum(p.numel() for p in params.values())
    payload = sum(parameter_bytes(expected, compact).values())
    return {
        "donors": donors,
        "compact": compact,
        "parameters": numel,
        "payload_bytes": payload,
        "bytes_per_parameter": payload / numel,
        "fetch_s": fetched_s,
        "imported_s": imported_s,
        "first_step_s": first_step_s,
        "parameters_from": fetched.parameters_from,
        "top_up_s": top_up_s,
        "top_up_bytes": top_up_bytes,
        "top_up_max_error": error if compact else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the small preset's shape in the stage")
    parser.add_argument("--mbit", type=float, default=20.0, help="each donor's uplink, Mbit/s")
    parser.add_argument("--one-way-ms", type=float, default=20.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    profile = LinkProfile("uplink", one_way_ms=args.one_way_ms, mbit=args.mbit)
    print(
        f"stage: {args.layers} layer(s) of the small preset's shape; each donor behind {args.mbit:g} Mbit/s, "
        f"{args.one_way_ms:g} ms one way (netem relay)"
    )
    results = []
    for label, donors, compact in SCENARIOS:
        result = asyncio.run(run(args.layers, donors, compact, profile))
        results.append(result)
        ideal = result["payload_bytes"] / donors / profile.bytes_per_s
        print(
            f"{label:30s} {result['parameters'] / 1e6:.2f} M params, {result['payload_bytes'] / 1e6:7.1f} MB "
            f"({result['bytes_per_parameter']:.2f} B/param): fetched {result['fetch_s']:6.1f} s "
            f"(link-bound {ideal:5.1f} s), imported {result['imported_s']:6.1f} s, "
            f"first step {result['first_step_s']:6.1f} s",
            flush=True,
        )
        if result["top_up_s"] is not None:
            print(
                f"{'  then its top-up':30s} {result['top_up_bytes'] / 1e6:7.1f} MB "
                f"({result['top_up_bytes'] / result['parameters']:.2f} B/param): {result['top_up_s']:6.1f} s "
                f"(link-bound {result['top_up_bytes'] / donors / profile.bytes_per_s:5.1f} s), "
                f"{result['top_up_s'] / result['fetch_s']:.3f} of the copy's time; phi within "
                f"{result['top_up_max_error']:.1e} of the donors' (moved ~1e-4)",
                flush=True,
            )
    before, after = results[0], results[-1]
    print(
        f"bytes per parameter: {before['bytes_per_parameter']:.2f} -> {after['bytes_per_parameter']:.2f} "
        f"({before['bytes_per_parameter'] / after['bytes_per_parameter']:.2f}x fewer)"
    )
    print(
        f"time to first step: {before['first_step_s']:.1f} s -> {after['first_step_s']:.1f} s "
        f"({before['first_step_s'] / after['first_step_s']:.2f}x faster)"
    )
    per_param_s = (after["first_step_s"] / after["parameters"], before["first_step_s"] / before["parameters"])
    for preset, numel in (("small stage of 2 (57 M params)", 57e6), ("medium stage (0.41 B params)", 0.41e9)):
        print(
            f"  scaled by parameters to a {preset}: {numel * per_param_s[1] / 60:.1f} min -> "
            f"{numel * per_param_s[0] / 60:.1f} min at {args.mbit:g} Mbit/s per donor"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
