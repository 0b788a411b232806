"""The outer-step math against the reference vectors of docs/research.md (The outer step, Reference vectors),
and against a reference written here from the equations on random tensors."""

import pytest
import torch

from noloco_node.optim.outer import diloco_step, noloco_step, solo_step

f64 = torch.float64
PHI_A, THETA_A, M_A = [1.0, -2.0, 0.5, 3.0], [1.5, -2.5, 0.25, 3.0], [0.1, -0.2, 0.0, 0.4]
PHI_B, THETA_B, M_B = [0.0, -1.0, 1.0, 2.0], [-0.5, -0.5, 1.5, 2.25], [0.3, 0.0, -0.1, 0.2]
NOLOCO = dict(alpha=0.5, beta=0.7)


def t(values):
    return torch.tensor(values, dtype=f64)


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=1e-9, rtol=0)


@pytest.mark.parametrize("gamma", [None, 0.7])
def test_v1_noloco_pair(gamma):
    phi_a, m_a = noloco_step(t(PHI_A), t(THETA_A), t(M_A), [(t(PHI_B), t(THETA_B))], **NOLOCO, gamma=gamma)
    phi_b, m_b = noloco_step(t(PHI_B), t(THETA_B), t(M_B), [(t(PHI_A), t(THETA_A))], **NOLOCO, gamma=gamma)
    close(m_a, [-0.3, 0.25, 0.2625, -0.0625])
    close(phi_a, [0.7, -1.75, 0.7625, 2.9375])
    close(m_b, [0.5, -0.35, -0.1375, 0.5375])
    close(phi_b, [0.5, -1.35, 0.8625, 2.5375])


def test_v1_theta_only_form_needs_no_peer_phi():
    phi_a, m_a = noloco_step(t(PHI_A), t(THETA_A), t(M_A), [(None, t(THETA_B))], **NOLOCO)
    close(phi_a, [0.7, -1.75, 0.7625, 2.9375])
    close(m_a, [-0.3, 0.25, 0.2625, -0.0625])


def test_v2_second_consecutive_step():
    phi_a, m_a = noloco_step(t(PHI_A), t(THETA_A), t(M_A), [(t(PHI_B), t(THETA_B))], **NOLOCO)
    phi_b, m_b = noloco_step(t(PHI_B), t(THETA_B), t(M_B), [(t(PHI_A), t(THETA_A))], **NOLOCO)
    theta_a = phi_a + t([0.25, 0.0, -0.125, 0.5])
    theta_b = phi_b + t([-0.25, 0.125, 0.0, 0.0])
    close(theta_a, [0.95, -1.75, 0.6375, 3.4375])
    close(theta_b, [0.25, -1.225, 0.8625, 2.5375])
    phi_a2, m_a2 = noloco_step(phi_a, theta_a, m_a, [(phi_b, theta_b)], **NOLOCO)
    phi_b2, m_b2 = noloco_step(phi_b, theta_b, m_b, [(phi_a, theta_a)], **NOLOCO)
    close(m_a2, [-0.22, 0.30875, 0.1225, 0.00375])
    close(phi_a2, [0.48, -1.44125, 0.885, 2.94125])
    close(m_b2, [0.32, -0.27125, -0.1475, 0.58375])
    close(phi_b2, [0.82, -1.62125, 0.715, 3.12125])


def test_v3a_diloco_canonical():
    theta_mean = (t(THETA_A) + t([0.5, -1.5, 1.0, 3.25])) / 2
    phi, m = diloco_step(t(PHI_A), t(M_A), theta_mean, alpha=0.3, beta=0.7)
    close(m, [0.03, -0.06, 0.0875, 0.2075])
    close(phi, [1.03, -2.06, 0.5875, 3.2075])


def test_v3b_diloco_on_diverged_replicas():
    # The reference all-reduces mean_j(phi_j - theta_j); with per-replica phi that is the mean
    # delta, so the equivalent theta_mean for replica B is phi_B + mean(Delta).
    mean_delta = ((t(THETA_A) - t(PHI_A)) + (t(THETA_B) - t(PHI_B))) / 2
    phi_b, m_b = diloco_step(t(PHI_B), t(M_B), t(PHI_B) + mean_delta, alpha=0.3, beta=0.7)
    close(m_b, [0.09, 0.0, 0.0575, 0.1475])
    close(phi_b, [0.09, -1.0, 1.0575, 2.1475])


def test_v4_solo_step():
    for phi, m in (
        solo_step(t(PHI_A), t(THETA_A), t(M_A), **NOLOCO),
        noloco_step(t(PHI_A), t(THETA_A), t(M_A), [], **NOLOCO, gamma=0.3),
    ):
        close(m, [0.4, -0.45, -0.175, 0.2])
        close(phi, [1.4, -2.45, 0.325, 3.2])


def test_inputs_not_mutated_and_dtype_kept():
    phi, theta, m = t(PHI_A), t(THETA_A), t(M_A)
    copies = [x.clone() for x in (phi, theta, m)]
    peer = (t(PHI_B), t(THETA_B))
    noloco_step(phi, theta, m, [peer], **NOLOCO, gamma=0.3)
    for original, copy in zip((phi, theta, m, *peer), copies + [t(PHI_B), t(THETA_B)]):
        assert torch.equal(original, copy)
    for dtype in (torch.float32, torch.float64):
        new_phi, new_m = noloco_step(phi.to(dtype), theta.to(dtype), m.to(dtype), [], **NOLOCO)
        assert new_phi.dtype == dtype and new_m.dtype == dtype


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="peers\\[0\\] theta"):
        noloco_step(t(PHI_A), t(THETA_A), t(M_A), [(None, torch.zeros(3, dtype=f64))], **NOLOCO)
    with pytest.raises(ValueError, match="slow weights"):
        noloco_step(t(PHI_A), t(THETA_A), t(M_A), [(None, t(THETA_B))], **NOLOCO, gamma=0.2)


def reference_noloco(phis, thetas, moms, alpha, beta, gamma):
    """Paper Eq. 1-3 with the reference code's +beta sign, for member 0 of the group."""
    n = len(phis)
    delta_bar = sum(th - ph for th, ph in zip(thetas, phis)) / n
    phi_bar = sum(phis) / n
    m_new = alpha * moms[0] + beta * delta_bar + gamma * (phi_bar - phis[0])
    return phis[0] + m_new, m_new


@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("gamma", [None, 0.3, 0.9])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_random_groups_match_equations(group_size, gamma, dtype, tol):
    gen = torch.Generator().manual_seed(1000 * group_size + int(10 * (gamma or 0)))
    shape = (5, 7)
    phis = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(group_size)]
    thetas = [p + 0.1 * torch.randn(shape, generator=gen, dtype=dtype) for p in phis]
    moms = [0.05 * torch.randn(shape, generator=gen, dtype=dtype) for _ in range(group_size)]
    alpha, beta = 0.5, 0.7
    expected_phi, expected_m = reference_noloco(phis, thetas, moms, alpha, beta, beta if gamma is None else gamma)
    peers = list(zip(phis[1:], thetas[1:]))
    new_phi, new_m = noloco_step(phis[0], thetas[0], moms[0], peers, alpha=alpha, beta=beta, gamma=gamma)
    torch.testing.assert_close(new_phi, expected_phi, atol=tol, rtol=0)
    torch.testing.assert_close(new_m, expected_m, atol=tol, rtol=0)


def test_pair_members_get_identical_group_mean_bitwise():
    gen = torch.Generator().manual_seed(7)
    theta_a, theta_b = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    phi = torch.randn(1000, generator=gen)
    zero = torch.zeros(1000)
    # Same phi and m on both sides: identical theta sums in either order give identical results.
    out_a, _ = noloco_step(phi, theta_a, zero, [(None, theta_b)], **NOLOCO)
    out_b, _ = noloco_step(phi, theta_b, zero, [(None, theta_a)], **NOLOCO)
    assert torch.equal(out_a, out_b)
