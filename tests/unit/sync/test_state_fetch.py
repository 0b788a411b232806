"""A joiner's state from several donors: the split keeps parameters whole and balances bytes, a
donor that leaves mid-transfer costs only its unfinished parameters, the compact encoding keeps
phi exact and the moments within the codecs' bounds, and a donor refuses names it does not have,
in the in-memory twin and over gRPC."""

import asyncio
import contextlib
import json

import grpc
import pytest
import torch
from torch import nn

from noloco_node.errors import InvalidPayload
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterClient, OuterServicer
from noloco_node.runtime.link_estimates import LinkDeadlines
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.state_fetch import StateUnavailable, donor_order, fetch_from_donors, split_parameters
from noloco_node.codec.state_layout import parameter_bytes, tensors_by_parameter
from noloco_node.sync.transfer import counters_json, expected_tensors, export_state, import_state
from noloco_node.wire.v1 import outer_pb2, outer_pb2_grpc


def make_replica(seed: int, *, steps: int = 3):
    """A small stage (matrices of different sizes, vectors) with phi, m and Adam state after
    `steps` inner steps and one outer round."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])  # 12 parameters, 6 to each of two donors
    inner = InnerOptimizer(model.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=100))
    outer = OuterState(model.named_parameters(), alpha=0.5, beta=0.7)
    for _ in range(steps):
        model(torch.randn(16, 32)).pow(2).mean().backward()
        inner.step()
        inner.adam.zero_grad()
    outer.momentum = {n: torch.randn_like(m) * 1e-2 for n, m in outer.momentum.items()}
    outer.phi = {n: p.detach().clone() + 1e-3 * seed for n, p in model.named_parameters()}
    outer.round = seed
    inner.step_count = 10 * seed
    return model, outer, inner


class Donor:
    def __init__(self, seed: int) -> None:
        self.model, self.outer, self.inner = make_replica(seed)
        self.tensors, self.counters = export_state(self.outer, self.inner, inner_step=self.inner.step_count)

    async def export_state(self):
        return {n: t.clone() for n, t in self.tensors.items()}, counters_json(self.counters)


def fresh_joiner():
    return make_replica(99, steps=0)


def test_the_split_keeps_each_parameter_whole_and_balances_bytes():
    _, outer, _ = fresh_joiner()
    sizes = parameter_bytes(expected_tensors(outer), compact=True)
    for parts in (1, 2, 3, 4):
        split = split_parameters(sizes, parts)
        flat = [p for part in split for p in part]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))  # every parameter once, whole
        totals = [sum(sizes[p] for p in part) for part in split]
        assert max(totals) <= sum(sizes.values()) / parts + max(sizes.values())
        assert all(part == [p for p in sizes if p in part] for part in split)  # in the stage's order
    # Balanced by bytes, not by count: one large parameter against ten small ones.
    sizes = {"big": 100, **{f"s{i}": 10 for i in range(10)}}
    assert split_parameters(sizes, 2) == [["big"], [f"s{i}" for i in range(10)]]


def run_fetch(hub: MemoryPairingHub, donors: list[str], joiner, **kwargs):
    _, outer, inner = joiner
    fetched = asyncio.run(
        fetch_from_donors(
            hub.transport("joiner"),
            donors,
            stage=0,
            requester="joiner",
            timeout_s=5,
            expected=expected_tensors(outer),
            **kwargs,
        )
    )
    import_state(outer, inner, fetched.tensors, fetched.counters)
    return fetched


def test_a_donor_leaving_mid_transfer_costs_only_its_unfinished_parameters():
    hub = MemoryPairingHub()
    donors = {"a": Donor(1), "b": Donor(2)}
    for name, donor in donors.items():
        hub.register(name, None, donor)
    hub.state_cut["a"] = 2  # a sends two parameters whole, then leaves
    joiner = fresh_joiner()
    fetched = run_fetch(hub, ["a", "b"], joiner, compact=False)
    _, outer, inner = joiner
    parameters = list(outer.params)
    assert fetched.failed == ["a"] and fetched.parameters_from["a"] == 2
    assert fetched.parameters_from["b"] == len(parameters) - 2 and fetched.reasked > 0
    # Each parameter's phi, m, moments and Adam step all from one donor: the two kept from a, the rest from b.
    from_a = [p for p in parameters if torch.equal(outer.phi[p], donors["a"].outer.phi[p])]
    assert len(from_a) == 2
    by_param = {p: donors["a" if p in from_a else "b"] for p in parameters}
    for p, param in outer.params.items():
        donor = by_param[p]
        assert torch.equal(outer.phi[p], donor.outer.phi[p]) and torch.equal(param.data, donor.outer.phi[p])
        assert torch.equal(outer.momentum[p], donor.outer.momentum[p])
        state = inner.adam.state[param]
        assert torch.equal(state["exp_avg"], donor.tensors[f"adam_exp_avg/{p}"])
        assert float(state["step"]) == donor.counters["adam_steps"][p]
    # The counters of the donor furthest along (b: inner step 20, round 2).
    assert fetched.donor == "b" and (inner.step_count, outer.round) == (20, 2)


def test_every_donor_gone_raises_and_a_spare_donor_takes_over():
    hub = MemoryPairingHub()
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        hub.register(name, None, Donor(seed))
    hub.state_cut.update({"a": 1, "b": 0})
    fetched = run_fetch(hub, ["a", "b", "c"], fresh_joiner(), max_donors=2)
    assert sorted(fetched.failed) == ["a", "b"] and fetched.parameters_from == {"a": 1, "c": 11}
    hub = MemoryPairingHub()
    hub.register("a", None, Donor(1))
    hub.state_cut["a"] = 1
    with pytest.raises(StateUnavailable, match="could not be fetched"):
        run_fetch(hub, ["a"], fresh_joiner())


def test_the_compact_import_keeps_phi_exact_and_the_moments_within_the_codec_bounds():
    hub = MemoryPairingHub()
    donor = Donor(1)
    hub.register("a", None, donor)
    hub.register("b", None, donor)
    joiner = fresh_joiner()
    run_fetch(hub, ["a", "b"], joiner, compact=True)
    _, outer, inner = joiner
    for p, param in outer.params.items():
        assert torch.equal(outer.phi[p], donor.outer.phi[p]) and torch.equal(param.data, donor.outer.phi[p])
        m = donor.outer.momentum[p]
        assert torch.allclose(outer.momentum[p], m, rtol=2**-8, atol=0)  # bf16
        state = inner.adam.state[param]
        exp_avg, exp_avg_sq = donor.tensors[f"adam_exp_avg/{p}"], donor.tensors[f"adam_exp_avg_sq/{p}"]
        blocks = exp_avg.reshape(-1).split(64)
        bound = torch.cat([torch.full_like(b, b.abs().max() / 254 * (1 + 2**-20)) for b in blocks])
        assert ((state["exp_avg"] - exp_avg).reshape(-1).abs() <= bound + 1e-30).all()  # int8, per block
        assert torch.allclose(state["exp_avg_sq"], exp_avg_sq, rtol=2**-8, atol=0)  # bf16: no v turns 0
        assert ((state["exp_avg_sq"] > 0) == (exp_avg_sq > 0)).all()


def test_the_compact_state_is_about_nine_bytes_per_parameter():
    _, outer, _ = fresh_joiner()
    expected = expected_tensors(outer)
    numel = sum(p.numel() for p in outer.params.values())
    dense, compact = sum(parameter_bytes(expected, False).values()), sum(parameter_bytes(expected, True).values())
    assert dense == 16 * numel
    assert 9.0 * numel < compact < 9.2 * numel


def test_a_donor_refuses_names_it_does_not_have():
    hub = MemoryPairingHub()
    hub.register("a", None, Donor(1))
    _, outer, _ = fresh_joiner()
    with pytest.raises(InvalidPayload, match="unknown parameter 'nope'"):
        asyncio.run(
            hub.transport("j").fetch_state(
                "a", stage=0, requester="j", timeout_s=5, expected=expected_tensors(outer), names=["0.weight", "nope"]
            )
        )


class AbortContext:
    async def abort(self, code, details, trailing_metadata=()):
        raise grpc.RpcError(code, details)

    async def write(self, message):
        raise AssertionError("nothing may be sent")


@pytest.mark.parametrize(
    "names, message",
    [
        (["0.weight", "nope"], "unknown parameter 'nope'"),
        (["0.weight", "0.weight"], "asked for twice"),
        ([f"p{i}" for i in range(13)], "13 parameters asked for; this stage has 12"),
        ([f"p{i}" for i in range(70_000)], "at most 65536"),
    ],
)
def test_the_grpc_donor_answers_invalid_argument_for_bad_names(names, message):
    servicer = OuterServicer(
        None,
        peer_id="donor",
        run=ServedRun("r", "h", 0),
        max_bytes=1 << 24,
        deadlines=LinkDeadlines(),
        donor=Donor(1),
    )
    request = outer_pb2.FetchStateRequest(stage=0, peer_id="joiner", names=names)
    request.run.run_id, request.run.manifest_hash = "r", "h"
    with pytest.raises(grpc.RpcError) as raised:
        asyncio.run(servicer.FetchState(request, AbortContext()))
    code, details = raised.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details


class LoopbackDialer:
    def __init__(self, addresses: dict[str, str]) -> None:
        self.channels = {peer: grpc.aio.insecure_channel(address) for peer, address in addresses.items()}

    async def channel(self, peer_id):
        return self.channels[peer_id], "direct"


@contextlib.asynccontextmanager
async def grpc_donors(donors: dict, faults: dict | None = None):
    """Each donor behind its own OuterServicer on 127.0.0.1 (with its FaultInjector from `faults`):
    yields a client that reaches them by name, and the servers by name (a test may stop one)."""
    servers, addresses = {}, {}
    for name, donor in donors.items():
        server = grpc.aio.server()
        outer_pb2_grpc.add_OuterServicer_to_server(
            OuterServicer(
                None,
                peer_id=name,
                run=ServedRun("r", "h", 0),
                max_bytes=1 << 24,
                # A node's floor is timeouts.match_s; without one a loaded machine cuts 20 kB at 0.1 s.
                deadlines=LinkDeadlines(floor_s=10.0),
                donor=donor,
                faults=(faults or {}).get(name),
            ),
            server,
        )
        addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers[name] = server
    dialer = LoopbackDialer(addresses)
    try:
        yield OuterClient(run_id="r", manifest_hash="h", max_bytes=1 << 24, dialer=dialer), servers
    finally:
        for channel in dialer.channels.values():
            await channel.close()
        for server in servers.values():
            await server.stop(None)


def test_over_grpc_two_donors_one_cut_mid_stream_and_the_compact_codecs_checked():
    """Real streams on 127.0.0.1: donor a dies (its server stops) after two parameters; the joiner
    keeps them and takes the rest from b, each tensor in the codec the compact encoding names."""
    from noloco_node.runtime.faults import FaultInjector

    donors = {"a": Donor(1), "b": Donor(2)}

    async def scenario():
        stall = FaultInjector(["donate_parameter:stall=30@3"])
        async with grpc_donors(donors, {"a": stall}) as (client, servers):
            _, outer, inner = joiner = fresh_joiner()

            async def cut_a():
                while ("donate_parameter", "stall") not in stall.fired:  # a stalls before its third parameter
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # the two parameters it wrote reach the joiner
                await servers["a"].stop(None)

            cutter = asyncio.create_task(cut_a())
            fetched = await fetch_from_donors(
                client,
                ["a", "b"],
                stage=0,
                requester="joiner",
                timeout_s=20,
                expected=expected_tensors(outer),
                compact=True,
            )
            await cutter
            import_state(outer, inner, fetched.tensors, fetched.counters)
            return joiner, fetched

    (_, outer, _), fetched = asyncio.run(scenario())
    assert fetched.failed == ["a"] and fetched.parameters_from["a"] == 2 and fetched.reasked > 0
    from_a = [p for p in outer.params if torch.equal(outer.phi[p], donors["a"].outer.phi[p])]
    assert len(from_a) == 2
    for p in outer.params:
        assert torch.equal(outer.phi[p], donors["a" if p in from_a else "b"].outer.phi[p])


def test_grouping_sends_each_parameter_together():
    names = ["phi/x", "phi/y", "momentum/x", "momentum/y", "adam_exp_avg_sq/x", "adam_exp_avg/x", "odd"]
    assert tensors_by_parameter(names) == {
        "x": ["phi/x", "momentum/x", "adam_exp_avg/x", "adam_exp_avg_sq/x"],
        "y": ["phi/y", "momentum/y"],
        "odd": ["odd"],
    }
    assert json.loads(counters_json({"b": 1, "a": 2})) == {"a": 2, "b": 1}


def test_donors_reached_without_a_relay_are_asked_first_in_an_order_each_joiner_draws():
    relayed = [(f"home{i}", "relayed") for i in range(4)]
    reached = [("public0", "direct"), ("public1", "direct"), ("punched", "holepunched")]
    candidates = relayed[:2] + reached + relayed[2:]
    order = donor_order(candidates, seed="joiner")
    assert set(order[:3]) == {p for p, _ in reached} and set(order[3:]) == {p for p, _ in relayed}
    assert order == donor_order(candidates, seed="joiner")
    firsts = {donor_order(candidates, seed=f"joiner{i}")[0] for i in range(30)}
    assert firsts == {p for p, _ in reached}  # joiners spread over the direct donors
    assert sorted(donor_order(relayed, seed="x")) == [p for p, _ in relayed]  # only relayed: all still asked


def test_a_donor_whose_counters_claim_past_the_limit_gives_nothing_and_its_part_comes_from_another():
    """A hostile-peer audit's donor claimed 3,495 steps past three honest replicas: a replica that
    copied from it took that step, then the others copied that one. Donor c (inner step 30 here)
    streams counters past the limit: none of its parameters is kept, b sends them instead, and the
    joiner takes b's counters (20), not c's."""
    hub = MemoryPairingHub()
    for name, seed in (("b", 2), ("c", 3)):
        hub.register(name, None, Donor(seed))
    joiner = fresh_joiner()
    fetched = run_fetch(hub, ["c", "b"], joiner, compact=False, max_inner_step=25)
    _, outer, inner = joiner
    assert fetched.failed == ["c"] and fetched.parameters_from == {"b": len(outer.params)}
    assert fetched.donor == "b" and inner.step_count == 20
    assert run_fetch(hub, ["c", "b"], fresh_joiner(), compact=False, max_inner_step=30).donor == "c"  # at the limit


def test_the_agreed_step_is_the_lower_median_and_the_limit_a_few_rounds_past_it():
    from noloco_node.sync.state_fetch import agreed_step, claim_limit

    assert agreed_step([]) is None and claim_limit([], 10) is None
    assert agreed_step([5521]) == 5521  # a lone claim is all there is (a stage's only other replica)
    assert agreed_step([2030, 5521]) == 2030 and agreed_step([2026, 2030, 5521]) == 2030
    assert agreed_step([2026, 5521, 5521]) == 5521  # claims that are the majority carry it
    assert claim_limit([2030, 5521], 10) == 2130 and claim_limit([2030, 5521], 100) == 2430
