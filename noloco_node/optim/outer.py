"""NoLoCo and DiLoCo outer steps on one parameter tensor: pure torch, no networking.

Notation (docs/research.md, The outer step): theta = fast weights (the live parameters), phi = slow weights,
m = outer momentum, Delta = theta - phi. Both updates are heavy-ball momentum with the
reference code's sign (+beta), whatever the paper calls them.

NoLoCo over a group G = self + peers:
    m     <- alpha*m + beta*mean_G(Delta) + gamma*(mean_G(phi) - phi_self)
    phi   <- phi + m
    theta <- phi
With gamma == beta this equals m <- alpha*m + beta*(mean_G(theta) - phi_self), so peers only need
to send theta (`noloco_step`); for any gamma they send phi and Delta (`noloco_step_sent`). With
no peers it is the solo step m <- alpha*m + beta*Delta_self.

For bit-identical group means on both sides of an exchange, pass the *wire-format* values:
the peer's decoded tensors and, as `theta`, this replica's own theta as it was sent. The group
sum is accumulated in a fixed order (own value first, then peers as given), so two members of a
pair compute identical means (a + b == b + a in IEEE arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

PeerSnapshot = tuple[Tensor | None, Tensor]
"""(peer_phi, peer_theta) of one other group member; peer_phi may be None when gamma == beta."""


def _check_same(reference: Tensor, other: Tensor, what: str) -> None:
    if other.shape != reference.shape:
        raise ValueError(f"{what} has shape {tuple(other.shape)}, expected {tuple(reference.shape)}")


def noloco_step(
    phi: Tensor,
    theta: Tensor,
    momentum: Tensor,
    peers: Sequence[PeerSnapshot],
    *,
    alpha: float,
    beta: float,
    gamma: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One NoLoCo outer step for one parameter of this replica.

    Args:
        phi, theta, momentum: this replica's slow weights, fast weights and outer momentum.
        peers: (peer_phi, peer_theta) for every *other* group member; empty for the solo step.
            peer_phi is only read when gamma != beta and may then not be None.
        alpha, beta: outer momentum and outer learning rate.
        gamma: local-averaging coefficient; None means gamma = beta.

    Returns:
        (new_phi, new_momentum) in phi's dtype. The new fast weights equal new_phi.
        The inputs are not modified.
    """
    gamma = beta if gamma is None else gamma
    dtype = phi.dtype
    theta = theta.to(dtype)
    momentum = momentum.to(dtype)
    _check_same(phi, theta, "theta")
    _check_same(phi, momentum, "momentum")
    group_size = 1 + len(peers)

    if gamma == beta:
        # beta*mean(Delta) + beta*(mean(phi) - phi) == beta*(mean(theta) - phi): theta alone suffices.
        theta_sum = theta.clone()
        for index, (_, peer_theta) in enumerate(peers):
            _check_same(phi, peer_theta, f"peers[{index}] theta")
            theta_sum += peer_theta.to(dtype)
        pull = beta * (theta_sum / group_size - phi)
    else:
        phi_sum, delta_sum = phi.clone(), theta - phi
        for index, (peer_phi, peer_theta) in enumerate(peers):
            if peer_phi is None:
                raise ValueError(f"peers[{index}] has no slow weights, which gamma != beta requires")
            _check_same(phi, peer_phi, f"peers[{index}] phi")
            _check_same(phi, peer_theta, f"peers[{index}] theta")
            peer_phi, peer_theta = peer_phi.to(dtype), peer_theta.to(dtype)
            phi_sum += peer_phi
            delta_sum += peer_theta - peer_phi
        pull = beta * (delta_sum / group_size) + gamma * (phi_sum / group_size - phi)

    new_momentum = alpha * momentum + pull
    return phi + new_momentum, new_momentum


def noloco_step_sent(
    phi: Tensor,
    momentum: Tensor,
    own: tuple[Tensor, Tensor],
    peers: Sequence[tuple[Tensor, Tensor]],
    *,
    alpha: float,
    beta: float,
    gamma: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The NoLoCo step from (slow weights, outer delta) snapshots as they travelled: any gamma.

        m <- alpha*m + beta*mean_G(Delta) + gamma*(mean_G(phi) - phi_self)

    Args:
        phi, momentum: this replica's exact slow weights and outer momentum.
        own: this replica's (phi, Delta) as the partner decodes them, so both sides of a pair
            average the same values; with a lossless codec they are (phi, theta - phi).
        peers: (phi, Delta) of every other group member, decoded from the wire.

    Returns:
        (new_phi, new_momentum) in phi's dtype, as `noloco_step`. With a lossless wire and
        own = (phi, theta - phi) the result is bit-identical to `noloco_step`'s.
    """
    gamma = beta if gamma is None else gamma
    dtype = phi.dtype
    _check_same(phi, momentum, "momentum")
    own_phi, own_delta = own
    _check_same(phi, own_phi, "own phi")
    _check_same(phi, own_delta, "own delta")
    phi_sum, delta_sum = own_phi.to(dtype, copy=True), own_delta.to(dtype, copy=True)
    for index, (peer_phi, peer_delta) in enumerate(peers):
        _check_same(phi, peer_phi, f"peers[{index}] phi")
        _check_same(phi, peer_delta, f"peers[{index}] delta")
        phi_sum += peer_phi.to(dtype)
        delta_sum += peer_delta.to(dtype)
    group_size = 1 + len(peers)
    pull = beta * (delta_sum / group_size) + gamma * (phi_sum / group_size - phi)
    new_momentum = alpha * momentum.to(dtype) + pull
    return phi + new_momentum, new_momentum


def diloco_step(
    phi: Tensor,
    momentum: Tensor,
    theta_mean: Tensor,
    *,
    alpha: float,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """One DiLoCo outer step (heavy-ball, as the reference runs it) for one parameter.

    Args:
        phi, momentum: the slow weights and outer momentum (identical on all replicas).
        theta_mean: the mean fast weights over all replicas of the stage.

    Returns:
        (new_phi, new_momentum) in phi's dtype; the new fast weights equal new_phi.
    """
    dtype = phi.dtype
    _check_same(phi, momentum, "momentum")
    _check_same(phi, theta_mean, "theta_mean")
    new_momentum = alpha * momentum.to(dtype) + beta * (theta_mean.to(dtype) - phi)
    return phi + new_momentum, new_momentum


def solo_step(phi: Tensor, theta: Tensor, momentum: Tensor, *, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    """The NoLoCo step with a group of one (no partner within the deadline)."""
    return noloco_step(phi, theta, momentum, [], alpha=alpha, beta=beta)
