"""A residual stream confined to a fixed k-dimensional subspace, so that a pipeline hop carries k
numbers per token instead of the hidden size d (Subspace Networks, arXiv 2506.01260).

Everything a decoder layer adds into the residual stream, and the learned part of the token
embedding, lies in span(U), where U is a fixed d x k orthonormal basis drawn from the run seed:

  * the attention and MLP output projections are W = U Z: the parameter is Z (k x in), so its
    gradient, its Adam moments and its share of the outer exchange are k-wide as well;
  * the token embedding is fixed[ids] + E[ids] U^T: `fixed` is a frozen full-rank V x d table drawn
    from the run seed (every stage holds it: V x d floats per stage), E (V x k) is learned.

So at every stage boundary the residual stream is exactly fixed[ids] + c U^T. A hop sends the
coordinates c = (h - fixed[ids]) U and the token ids forward, and the receiver rebuilds h; the
gradient sent back is dL/dc = U^T dL/dh, k per token. The part of dL/dh outside span(U) reaches no
parameter (each one sees the stream only through U^T), so the split model's gradients equal the
whole model's.

Built by construction rather than projected after each step: Adam's per-coordinate update of a dense
W would leave the subspace between projections (after every inner step, outer step and state load,
each a place to forget one), and a dense W keeps d x in moments that the subspace never needs.

The model's last FREE_FINAL_LAYERS decoder layers (model/split.py) stay dense, as the anchors leave
their last layers unconstrained: what they add crosses no wire (they always sit on the last stage,
every stage holds at least one layer), and the final norm and the LM head are full rank. No learned
scale acts on a sublayer's output in a Llama (pre-norm), so nothing else can leave the subspace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from noloco_node.model.init import normal_, parameter_seed
from noloco_node.model.split import constrained_layers

# Enters the run manifest with the rank: peers that build U or the fixed table differently never mix.
SUBSPACE_SCHEME = "residual-subspace/v1"
BASIS_NAME = "model.residual_basis"
FIXED_EMBEDDING_NAME = "model.fixed_embedding"


def residual_basis(seed: int, hidden_size: int, rank: int) -> Tensor:
    """U (hidden_size x rank, float64, orthonormal columns) from the run seed: the Q factor of a
    Gaussian matrix drawn as model/init.py draws phi_0, its signs fixed so that R has a positive
    diagonal (a QR is unique only up to them). float64 keeps U^T U = I to 1e-15: a float32 U would
    leave a 1e-7 error at every boundary."""
    if not 1 <= rank <= hidden_size:
        raise ValueError(f"the residual subspace rank must be in 1..{hidden_size}, got {rank}")
    gaussian = torch.empty(hidden_size, rank, dtype=torch.float64)
    normal_(gaussian, 1.0, parameter_seed(seed, BASIS_NAME))
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r))


class ResidualSubspace(nn.Module):
    """U and the fixed embedding (non-persistent buffers: derived from the seed, never sent or
    saved), and the maps between a hidden state and its coordinates."""

    def __init__(
        self,
        *,
        seed: int,
        vocab_size: int,
        hidden_size: int,
        rank: int,
        initializer_range: float,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.rank = rank
        self.register_buffer("basis", residual_basis(seed, hidden_size, rank).to(device), persistent=False)
        fixed = torch.empty(vocab_size, hidden_size, dtype=torch.float32, device=device)
        normal_(fixed, initializer_range, parameter_seed(seed, FIXED_EMBEDDING_NAME))
        self.register_buffer("fixed", fixed, persistent=False)
        self._cast: dict[tuple, Tensor] = {}

    def basis_as(self, dtype: torch.dtype) -> Tensor:
        """U in `dtype`, cast once (not on every output projection of every microbatch)."""
        key = (dtype, self.basis.device, self.basis.data_ptr())
        cast = self._cast.get(key)
        if cast is None:
            self._cast.clear()  # moved or re-cast: the old copies are stale
            cast = self._cast[key] = self.basis.to(dtype)
        return cast

    def lift(self, coordinates: Tensor) -> Tensor:
        """c U^T: coordinates [..., k] as a vector of the residual stream [..., d]. Under bf16
        autocast U is rounded to bf16 here, so a sublayer's write leaves span(U) by bf16 rounding
        and the boundary's projection drops that part: exact to bf16, as a dense bf16 hop is."""
        return coordinates @ self.basis_as(coordinates.dtype).T

    def to_coordinates(self, hidden: Tensor, token_ids: Tensor) -> Tensor:
        """c = (h - fixed[ids]) U, in at least float32 (under autocast too): the hop's payload."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            anchored = hidden.to(dtype) - self.fixed[token_ids].to(dtype)
            return anchored @ self.basis_as(dtype)

    def from_coordinates(self, coordinates: Tensor, token_ids: Tensor) -> Tensor:
        """h = fixed[ids] + c U^T: the residual stream rebuilt from a hop's payload."""
        dtype = torch.promote_types(coordinates.dtype, torch.float32)
        with torch.autocast(coordinates.device.type, enabled=False):
            return self.fixed[token_ids].to(dtype) + coordinates.to(dtype) @ self.basis_as(dtype).T

    def dense(self, name: str, weight: Tensor) -> Tensor:
        """A constrained parameter as the dense Llama weight it stands for (Hugging Face export)."""
        basis = self.basis.to(device=weight.device)
        if name.endswith("embed_tokens.weight"):
            return (self.fixed.double().to(weight.device) + weight.double() @ basis.T).to(weight.dtype)
        return (basis @ weight.double()).to(weight.dtype)


class SubspaceLinear(nn.Linear):
    """An output projection W = U Z with no bias: `weight` is Z (k x in_features). A Linear, so
    phi_0 draws Z by its name as for any Linear (N(0, initializer_range): U Z is then the projection
    onto span(U) of a dense draw)."""

    def __init__(self, in_features: int, subspace: ResidualSubspace) -> None:
        super().__init__(in_features, subspace.rank, bias=False)
        self._subspace = (subspace,)  # a tuple: not a submodule, so U is neither a parameter nor saved twice

    def forward(self, inputs: Tensor) -> Tensor:
        return self._subspace[0].lift(F.linear(inputs, self.weight))


class SubspaceEmbedding(nn.Embedding):
    """fixed[ids] + E[ids] U^T: `weight` is E (vocab x k); the fixed full-rank table carries the
    tokens' identities at every stage."""

    def __init__(self, vocab_size: int, subspace: ResidualSubspace, padding_idx: int | None = None) -> None:
        super().__init__(vocab_size, subspace.rank, padding_idx)
        self._subspace = (subspace,)

    def forward(self, token_ids: Tensor) -> Tensor:
        subspace = self._subspace[0]
        return subspace.fixed[token_ids] + subspace.lift(super().forward(token_ids))


def constrain(model: nn.Module, subspace: ResidualSubspace, num_layers: int) -> None:
    """Swap, in place, the embedding (if `model.model` has one) and the output projections of the
    constrained decoder layers `model.model.layers` holds for their subspace forms; call while the
    parameters are still on the meta device (phi_0 draws them by name afterwards)."""
    body = model.model
    with torch.device("meta"):
        if hasattr(body, "embed_tokens"):
            old = body.embed_tokens
            body.embed_tokens = SubspaceEmbedding(old.num_embeddings, subspace, old.padding_idx)
        layers = body.layers.items() if isinstance(body.layers, nn.ModuleDict) else enumerate(body.layers)
        for index, layer in layers:
            if int(index) in constrained_layers(num_layers):
                layer.self_attn.o_proj = SubspaceLinear(layer.self_attn.o_proj.in_features, subspace)
                layer.mlp.down_proj = SubspaceLinear(layer.mlp.down_proj.in_features, subspace)


def is_constrained(name: str, num_layers: int) -> bool:
    """Whether the whole-model parameter `name` is held in subspace coordinates."""
    if name == "model.embed_tokens.weight":
        return True
    parts = name.split(".")
    return (
        len(parts) == 6
        and parts[:2] == ["model", "layers"]
        and int(parts[2]) in constrained_layers(num_layers)
        and ".".join(parts[3:]) in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    )


def subspace_shape(name: str, dense_shape: tuple[int, ...], rank: int, num_layers: int) -> tuple[int, ...]:
    """The shape `name` has in a model of residual subspace `rank` (the dense shape when 0)."""
    if not rank or not is_constrained(name, num_layers):
        return tuple(dense_shape)
    if name == "model.embed_tokens.weight":
        return (dense_shape[0], rank)
    return (rank, dense_shape[1])


def dense_weights(weights: dict[str, Tensor], subspace: ResidualSubspace, num_layers: int) -> dict[str, Tensor]:
    """The whole model's weights as a plain Llama's: each constrained tensor replaced by the dense
    weight it stands for (U Z; fixed + E U^T), the rest as they are."""
    return {
        name: subspace.dense(name, tensor) if is_constrained(name, num_layers) else tensor
        for name, tensor in weights.items()
    }
