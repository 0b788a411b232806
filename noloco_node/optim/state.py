"""Outer-optimizer state of one stage: slow weights phi and outer momentum m per parameter.

phi and m are kept in float32 (or float64 when the parameters are) even when theta is bf16 on a
GPU, so many small outer updates do not vanish in bf16 rounding. This module maps the per-tensor
math of `outer.py` over a stage's named parameters; it knows nothing of networking.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from noloco_node.optim.outer import diloco_step, noloco_step, noloco_step_sent

PeerGroupSnapshot = Mapping[str, tuple[Tensor | None, Tensor]]
"""One peer's snapshot: parameter name -> (phi or None, theta)."""


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class OuterState:
    """phi and m for every parameter of a stage, plus the outer round counter.

    The parameters passed in are the live fast weights theta; applying an outer step writes the
    new phi into them (theta <- phi) in place, leaving any inner optimizer's moments untouched.
    """

    def __init__(
        self, named_params: Iterable[tuple[str, nn.Parameter]], *, alpha: float, beta: float, gamma: float | None = None
    ) -> None:
        self.params: dict[str, nn.Parameter] = dict(named_params)
        if not self.params:
            raise ValueError("OuterState needs at least one parameter")
        self.alpha, self.beta = alpha, beta
        self.gamma = beta if gamma is None else gamma
        with torch.no_grad():
            self.phi = {n: p.detach().to(_master_dtype(p.dtype), copy=True) for n, p in self.params.items()}
        self.momentum = {n: torch.zeros_like(v) for n, v in self.phi.items()}
        self.round = 0

    @property
    def needs_slow_weights(self) -> bool:
        """True when gamma != beta, so peers must exchange phi as well as theta."""
        return self.gamma != self.beta

    def snapshot(self) -> dict[str, tuple[Tensor | None, Tensor]]:
        """This replica's frozen snapshot: name -> (phi if needed else None, theta in master dtype)."""
        with torch.no_grad():
            return {
                name: (
                    self.phi[name].clone() if self.needs_slow_weights else None,
                    p.detach().to(self.phi[name].dtype, copy=True),
                )
                for name, p in self.params.items()
            }

    def delta_norm(self) -> float:
        """||theta - phi|| over all parameters (used to bound received snapshots)."""
        with torch.no_grad():
            total = sum(
                float((p.detach().to(self.phi[n].dtype) - self.phi[n]).pow(2).sum()) for n, p in self.params.items()
            )
        return total**0.5

    def apply_noloco(
        self,
        peers: list[PeerGroupSnapshot],
        own: Mapping[str, Tensor] | None = None,
        frozen: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Apply the NoLoCo step with the given peer snapshots (empty list = solo step).

        Args:
            peers: one mapping per other group member, covering every parameter.
            own: this replica's theta as it went on the wire (for identical group means on both
                sides); defaults to the live theta.
            frozen: theta when the snapshot was frozen. If given, inner progress made since then
                (while the exchange ran) is kept: theta <- new phi + (theta now - frozen). With no
                progress in between this is exactly theta <- new phi.
        """

        def step(name: str, device: torch.device) -> tuple[Tensor, Tensor]:
            param = self.params[name]
            theta = own[name] if own is not None else (frozen[name] if frozen is not None else param.detach())
            received = [
                (None if phi is None else phi.to(device), theta_peer.to(device))
                for phi, theta_peer in (peer[name] for peer in peers)
            ]
            return noloco_step(
                self.phi[name],
                theta.to(device),
                self.momentum[name],
                received,
                alpha=self.alpha,
                beta=self.beta,
                gamma=self.gamma,
            )

        self._apply_pair(peers, step, frozen)

    def apply_noloco_sent(
        self,
        peers: list[Mapping[str, tuple[Tensor, Tensor]]],
        own: Mapping[str, tuple[Tensor, Tensor]],
        frozen: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Apply the NoLoCo step from (phi, Delta) snapshots (`noloco_step_sent`), for any gamma.

        Args:
            peers: per other group member, name -> (phi, Delta) as decoded from the wire.
            own: name -> this replica's (phi, Delta) as the partner decodes them.
            frozen: as in `apply_noloco`.
        """

        def step(name: str, device: torch.device) -> tuple[Tensor, Tensor]:
            mine = (own[name][0].to(device), own[name][1].to(device))
            received = [(peer[name][0].to(device), peer[name][1].to(device)) for peer in peers]
            return noloco_step_sent(
                self.phi[name], self.momentum[name], mine, received, alpha=self.alpha, beta=self.beta, gamma=self.gamma
            )

        self._apply_pair(peers, step, frozen)

    def _apply_pair(self, peers: list[Mapping], step, frozen: Mapping[str, Tensor] | None) -> None:
        for name in self.params:
            missing = [i for i, peer in enumerate(peers) if name not in peer]
            if missing:
                raise KeyError(f"peer snapshots {missing} lack parameter {name!r}")
        with torch.no_grad():
            for name, param in self.params.items():
                # received tensors arrive on the host; phi may live on a GPU
                new_phi, new_m = step(name, self.phi[name].device)
                progress = None if frozen is None else param.detach().to(new_phi.dtype) - frozen[name]
                self._commit(name, new_phi, new_m)
                if progress is not None:
                    param.data.add_(progress.to(param.dtype))
        self.round += 1

    def apply_diloco(self, theta_mean: Mapping[str, Tensor]) -> None:
        """Apply the DiLoCo step given the all-replica mean of theta for every parameter."""
        with torch.no_grad():
            for name in self.params:
                new_phi, new_m = diloco_step(
                    self.phi[name],
                    self.momentum[name],
                    theta_mean[name].to(self.phi[name].device),
                    alpha=self.alpha,
                    beta=self.beta,
                )
                self._commit(name, new_phi, new_m)
        self.round += 1

    def _commit(self, name: str, new_phi: Tensor, new_m: Tensor) -> None:
        self.phi[name] = new_phi
        self.momentum[name] = new_m
        self.params[name].data.copy_(new_phi)

    def state_dict(self) -> dict[str, Tensor]:
        """Flat tensors for checkpoints and state transfer: 'phi/<name>' and 'momentum/<name>'."""
        flat = {f"phi/{n}": t for n, t in self.phi.items()}
        flat.update({f"momentum/{n}": t for n, t in self.momentum.items()})
        return flat

    def load_state_dict(self, flat: Mapping[str, Tensor], *, round_index: int) -> None:
        """Load phi and m (as from `state_dict`) and set theta <- phi."""
        with torch.no_grad():
            for name in self.params:
                for kind, store in (("phi", self.phi), ("momentum", self.momentum)):
                    source = flat[f"{kind}/{name}"]
                    if source.shape != store[name].shape:
                        raise ValueError(
                            f"{kind}/{name}: shape {tuple(source.shape)}, expected {tuple(store[name].shape)}"
                        )
                    store[name] = source.to(store[name].device, store[name].dtype, copy=True)
                self.params[name].data.copy_(self.phi[name])
        self.round = round_index
