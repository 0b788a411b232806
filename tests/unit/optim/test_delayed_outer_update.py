"""The overlapped outer step (outer.overlap), checked in float64 against the reference vectors
(docs/research.md, The outer step): the pair update is computed from the snapshots frozen at
the boundary, exactly as the blocking step, and the inner progress made while the exchange ran
is kept on top of the new slow weights:

    m'     = alpha*m + beta*mean_G(Delta_frozen) + gamma*(mean_G(phi) - phi)
    phi'   = phi + m'
    theta' = phi' + (theta_now - theta_frozen)

With no step in between (theta_now == theta_frozen) it is the blocking step, bit for bit."""

import pytest
import torch
from torch import nn

from noloco_node.optim.state import OuterState

A = {"phi": [1, -2, 0.5, 3], "theta": [1.5, -2.5, 0.25, 3], "m": [0.1, -0.2, 0, 0.4]}
B = {"phi": [0, -1, 1, 2], "theta": [-0.5, -0.5, 1.5, 2.25], "m": [0.3, 0, -0.1, 0.2]}
AFTER = {
    "A": ([-0.3, 0.25, 0.2625, -0.0625], [0.7, -1.75, 0.7625, 2.9375]),
    "B": ([0.5, -0.35, -0.1375, 0.5375], [0.5, -1.35, 0.8625, 2.5375]),
}
PROGRESS = {"A": [0.25, -0.125, 0.5, -1.0], "B": [-0.5, 0.0625, 0.0, 0.75]}
DELAYED_THETA = {"A": [0.95, -1.875, 1.2625, 1.9375], "B": [0.0, -1.2875, 0.8625, 3.2875]}


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def replica(values: dict, gamma: float | None = None) -> tuple[nn.Module, OuterState]:
    model = nn.Module()
    model.w = nn.Parameter(t(values["phi"]))
    state = OuterState(model.named_parameters(), alpha=0.5, beta=0.7, gamma=gamma)
    state.momentum["w"] = t(values["m"])
    with torch.no_grad():
        model.w.copy_(t(values["theta"]))
    return model, state


@pytest.mark.parametrize("form", ["theta", "phi+delta"])
def test_the_delayed_step_keeps_the_progress_made_during_the_exchange(form):
    replicas = {"A": replica(A), "B": replica(B)}
    frozen = {name: {"w": model.w.detach().clone()} for name, (model, _) in replicas.items()}
    phis = {name: state.phi["w"].clone() for name, (_, state) in replicas.items()}
    for name, (model, _) in replicas.items():  # inner steps taken while the exchange runs
        with torch.no_grad():
            model.w.add_(t(PROGRESS[name]))
    for name, other in (("A", "B"), ("B", "A")):
        model, state = replicas[name]
        if form == "theta":
            state.apply_noloco([{"w": (None, frozen[other]["w"])}], own=frozen[name], frozen=frozen[name])
        else:
            delta = {n: frozen[n]["w"] - phis[n] for n in ("A", "B")}
            state.apply_noloco_sent(
                [{"w": (phis[other], delta[other])}], {"w": (phis[name], delta[name])}, frozen=frozen[name]
            )
    for name, (model, state) in replicas.items():
        m, phi = AFTER[name]
        torch.testing.assert_close(state.momentum["w"], t(m), atol=1e-9, rtol=0)
        torch.testing.assert_close(state.phi["w"], t(phi), atol=1e-9, rtol=0)
        torch.testing.assert_close(model.w.detach(), t(DELAYED_THETA[name]), atol=1e-9, rtol=0)


def test_without_progress_the_delayed_step_is_the_blocking_step_bit_for_bit():
    (blocking, s1), (delayed, s2) = replica(A), replica(A)
    peer = [{"w": (None, t(B["theta"]))}]
    s1.apply_noloco(peer, own={"w": t(A["theta"])})
    s2.apply_noloco(peer, own={"w": t(A["theta"])}, frozen={"w": delayed.w.detach().clone()})
    assert torch.equal(blocking.w, delayed.w) and torch.equal(s1.phi["w"], s2.phi["w"])
