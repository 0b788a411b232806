"""The NoLoCo step from (phi, Delta) snapshots: the reference vectors, an independent NumPy
oracle for random gamma != beta, and bit-identity with the theta form on a lossless wire."""

import numpy as np
import pytest
import torch

from noloco_node.optim.outer import noloco_step, noloco_step_sent

f64 = torch.float64
A = dict(phi=[1.0, -2.0, 0.5, 3.0], theta=[1.5, -2.5, 0.25, 3.0], m=[0.1, -0.2, 0.0, 0.4])
B = dict(phi=[0.0, -1.0, 1.0, 2.0], theta=[-0.5, -0.5, 1.5, 2.25], m=[0.3, 0.0, -0.1, 0.2])


def t(values):
    return torch.tensor(values, dtype=f64)


def sent(state):
    """(phi, Delta) as a lossless wire carries them."""
    phi = t(state["phi"])
    return phi, t(state["theta"]) - phi


def oracle(phis, thetas, moms, a, b, g):
    """The reference vectors of docs/research.md, verbatim in substance."""
    P, T, M = (np.asarray(x, float) for x in (phis, thetas, moms))
    phibar, dbar = P.mean(0), (T - P).mean(0)
    Mn = a * M + b * dbar + g * (phibar - P)
    return P + Mn, Mn


def test_v1_both_sides():
    phi_a, m_a = noloco_step_sent(t(A["phi"]), t(A["m"]), sent(A), [sent(B)], alpha=0.5, beta=0.7, gamma=0.7)
    phi_b, m_b = noloco_step_sent(t(B["phi"]), t(B["m"]), sent(B), [sent(A)], alpha=0.5, beta=0.7, gamma=0.7)
    torch.testing.assert_close(m_a, t([-0.3, 0.25, 0.2625, -0.0625]), atol=1e-9, rtol=0)
    torch.testing.assert_close(phi_a, t([0.7, -1.75, 0.7625, 2.9375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(m_b, t([0.5, -0.35, -0.1375, 0.5375]), atol=1e-9, rtol=0)
    torch.testing.assert_close(phi_b, t([0.5, -1.35, 0.8625, 2.5375]), atol=1e-9, rtol=0)


def test_v4_solo():
    phi, m = noloco_step_sent(t(A["phi"]), t(A["m"]), sent(A), [], alpha=0.5, beta=0.7, gamma=0.3)
    torch.testing.assert_close(m, t([0.4, -0.45, -0.175, 0.2]), atol=1e-9, rtol=0)
    torch.testing.assert_close(phi, t([1.4, -2.45, 0.325, 3.2]), atol=1e-9, rtol=0)


@pytest.mark.parametrize("seed", range(5))
def test_random_gamma_against_the_oracle_and_the_theta_form(seed):
    g = torch.Generator().manual_seed(seed)
    alpha, beta, gamma = (float(x) for x in torch.rand(3, generator=g, dtype=f64))
    phis, thetas, moms = (torch.randn(2, 64, generator=g, dtype=f64) for _ in range(3))
    want_phi, want_m = oracle(phis, thetas, moms, alpha, beta, gamma)
    for me, other in ((0, 1), (1, 0)):
        mine = (phis[me], thetas[me] - phis[me])
        peer = (phis[other], thetas[other] - phis[other])
        phi, m = noloco_step_sent(phis[me], moms[me], mine, [peer], alpha=alpha, beta=beta, gamma=gamma)
        np.testing.assert_allclose(phi.numpy(), want_phi[me], atol=1e-12, rtol=0)
        np.testing.assert_allclose(m.numpy(), want_m[me], atol=1e-12, rtol=0)
        ref_phi, ref_m = noloco_step(
            phis[me], thetas[me], moms[me], [(phis[other], thetas[other])], alpha=alpha, beta=beta, gamma=gamma
        )
        assert torch.equal(phi, ref_phi) and torch.equal(m, ref_m)


def test_shape_mismatch_named():
    with pytest.raises(ValueError, match="peers\\[0\\] delta"):
        noloco_step_sent(
            t(A["phi"]), t(A["m"]), sent(A), [(t(B["phi"]), torch.zeros(3, dtype=f64))], alpha=0.5, beta=0.7, gamma=0.3
        )
