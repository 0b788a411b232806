"""Build and run exactly one pipeline stage of a `transformers` Llama.

Stage 0 = token embedding + its decoder layers; middle stages = decoder layers; the last stage =
decoder layers + final norm + LM head (+ loss). Parameter names equal the full
`LlamaForCausalLM` names (`model.layers.3.mlp.up_proj.weight`), so checkpoints and state transfer
line up with the whole model.

A node builds only its own stage: the modules are made on the meta device and then only this
stage's parameters get storage, each filled from the run seed and its own name (model/init.py) or
read from a checkpoint. So every replica of a stage, under every split, starts from the same phi_0,
and the whole model built in one process (`build_full_model`) equals its stages put together.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from noloco_node.model.init import CheckpointReads, materialise_from_checkpoint, materialise_from_seed
from noloco_node.model.losses import head_cross_entropy
from noloco_node.model.split import stage_layer_ranges
from noloco_node.model.subspace import ResidualSubspace, constrain


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive [1, 1, T, T] mask: 0 on and below the diagonal, dtype-min above.

    Passed explicitly to every layer (eager attention with no mask is silently bidirectional),
    except to SDPA on a GPU, which is causal by itself without one (LlamaStage._mask).
    """
    blocked = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(blocked, torch.finfo(dtype).min)[None, None]


class LlamaStage(nn.Module):
    """One contiguous slice of a Llama. `forward` maps token ids (stage 0) or hidden states
    [batch, seq, hidden] to hidden states, or to logits [batch, seq, vocab] on the last stage.
    With a residual `subspace` (model/subspace.py) what crosses a boundary is the stream's
    coordinates [batch, seq, k] instead, and stages after 0 also take the token ids.

    The constructor makes the parameters on the meta device (no storage); `build_stage` gives
    them their values."""

    def __init__(
        self,
        config: LlamaConfig,
        stage_index: int,
        num_stages: int,
        layer_range: range | None = None,
        subspace: ResidualSubspace | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.layer_range = (
            layer_range
            if layer_range is not None
            else stage_layer_ranges(config.num_hidden_layers, num_stages)[stage_index]
        )
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.model = nn.Module()
        with torch.device("meta"):  # the same modules LlamaForCausalLM makes, under the same names
            if self.is_first:
                self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            self.model.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config, i) for i in self.layer_range})
            if self.is_last:
                self.model.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)  # computed from the config: real storage
        self.subspace = subspace
        if subspace is not None:
            constrain(self, subspace, config.num_hidden_layers)
        self.checkpoint_reads: CheckpointReads | None = None  # what build_stage read from a checkpoint
        self.activation_checkpointing = False
        self._mask_cache: tuple[tuple, Tensor] | None = None

    def _mask(self, hidden: Tensor) -> Tensor | None:
        if hidden.is_cuda and self.config._attn_implementation == "sdpa":
            # No mask: SDPA is then causal by itself (is_causal), and only then may it pick its
            # flash or cuDNN kernels; an explicit mask sends it to a slower masked kernel.
            return None
        key = (hidden.shape[1], hidden.dtype, hidden.device)
        if self._mask_cache is None or self._mask_cache[0] != key:
            self._mask_cache = (key, causal_mask(*key))
        return self._mask_cache[1]

    def compile_layers(self) -> None:
        """torch.compile each decoder layer in place (pipeline.compile). In place, so parameter names,
        checkpoints, exports and the weight stash's functional_call see the same module tree; the
        layers share one compiled graph, their parameters being its inputs."""
        for layer in self.model.layers.values():
            layer.compile()

    @property
    def boundary_width(self) -> int:
        """Values per token of what crosses a stage boundary: the hidden size, or the subspace rank."""
        return self.config.hidden_size if self.subspace is None else self.subspace.rank

    def forward(self, inputs: Tensor, token_ids: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """With `labels` (the last stage only) the token-mean loss instead of the logits, computed
        without them (model/losses.py: the head and the loss a chunk of tokens at a time)."""
        if self.is_first:
            token_ids = inputs
            hidden = self.model.embed_tokens(inputs)
        elif self.subspace is not None:
            if token_ids is None:
                raise ValueError("a stage of a residual-subspace model needs the token ids with its coordinates")
            hidden = self.subspace.from_coordinates(inputs, token_ids)
        else:
            hidden = inputs
        seq_len = hidden.shape[1]
        position_ids = torch.arange(seq_len, device=hidden.device)[None]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        mask = self._mask(hidden)
        for layer in self.model.layers.values():
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only each layer's input; recompute its inside during backward.
                hidden = torch.utils.checkpoint.checkpoint(
                    layer,
                    hidden,
                    attention_mask=mask,
                    position_ids=position_ids,
                    position_embeddings=position_embeddings,
                    use_reentrant=False,
                )
            else:
                hidden = layer(
                    hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings
                )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.is_last and labels is not None:
            return head_cross_entropy(self.model.norm(hidden), self.lm_head.weight, labels)
        if self.is_last:
            return self.lm_head(self.model.norm(hidden))
        return hidden if self.subspace is None else self.subspace.to_coordinates(hidden, token_ids)

    @staticmethod
    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Token-mean cross-entropy; labels are already the next tokens (no shift here)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _refuse_tied(config: LlamaConfig) -> None:
    if config.tie_word_embeddings:
        raise ValueError("tie_word_embeddings must be False: the embedding and the LM head live on different stages")


def residual_subspace(
    config: LlamaConfig, seed: int, rank: int, device: torch.device | str = "cpu"
) -> ResidualSubspace | None:
    """The run's residual subspace of `rank` (None when 0: the dense model)."""
    if not rank:
        return None
    return ResidualSubspace(
        seed=seed,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        rank=rank,
        initializer_range=config.initializer_range or 0.02,
        device=device,
    )


def build_full_model(
    config: LlamaConfig, seed: int, device: torch.device | str = "cpu", *, subspace_rank: int = 0
) -> LlamaForCausalLM:
    """The whole model in one process with the stages' phi_0 (model/init.py: each parameter from
    `seed` and its name), so it equals the stages of any split put together, bit for bit. The
    global RNG is not touched. With `subspace_rank` its residual stream lives in the subspace
    (model/subspace.py); `model.subspace` holds U and the fixed embedding."""
    _refuse_tied(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # a buffer computed, not drawn
    model.subspace = residual_subspace(config, seed, subspace_rank, device)
    if model.subspace is not None:
        constrain(model, model.subspace, config.num_hidden_layers)
    materialise_from_seed(model, seed=seed, initializer_range=config.initializer_range, device=device)
    return model.to(device)


def build_stage(
    config: LlamaConfig,
    *,
    seed: int,
    stage_index: int,
    num_stages: int,
    layer_range: range | None = None,
    init_from: str | Path | None = None,
    device: torch.device | str = "cpu",
    subspace_rank: int = 0,
) -> LlamaStage:
    """Exactly stage `stage_index` of `num_stages` (decoder layers `layer_range`; even split if
    None), its parameters materialised on `device` and nothing else: from `seed`, identical on
    every replica and for every split, or from the Hugging Face checkpoint directory `init_from`
    (only this stage's tensors are read; `stage.checkpoint_reads` counts them)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
    _refuse_tied(config)
    stage = LlamaStage(
        config, stage_index, num_stages, layer_range, residual_subspace(config, seed, subspace_rank, device)
    )
    if init_from:
        stage.checkpoint_reads = materialise_from_checkpoint(stage, init_from, device=device)
    else:
        materialise_from_seed(stage, seed=seed, initializer_range=config.initializer_range, device=device)
    return stage.to(device)


def llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    max_seq_len: int,
    attn_implementation: str = "sdpa",
) -> LlamaConfig:
    """A LlamaConfig with the reference's defaults (untied head, RMSNorm eps 1e-6, MHA)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        attn_implementation=attn_implementation,
    )
