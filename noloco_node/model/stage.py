"""Build and run exactly one pipeline stage of a `transformers` Llama.

Stage 0 = token embedding + its decoder layers; middle stages = decoder layers; the last stage =
decoder layers + final norm + LM head (+ loss). Parameter names equal the full
`LlamaForCausalLM` names (`model.layers.3.mlp.up_proj.weight`), so checkpoints and state transfer
line up with the whole model.

Every replica of a stage built from the same seed is identical: the full model is initialised
on CPU from the seed (Llama's own init, std=initializer_range) and then sliced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from noloco_node.model.split import stage_layer_ranges


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive [1, 1, T, T] mask: 0 on and below the diagonal, dtype-min above.

    Passed explicitly to every layer, so causality never depends on an attention kernel's
    default (eager attention with no mask is silently bidirectional).
    """
    blocked = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(blocked, torch.finfo(dtype).min)[None, None]


class LlamaStage(nn.Module):
    """One contiguous slice of a Llama. `forward` maps token ids (stage 0) or hidden states
    [batch, seq, hidden] to hidden states, or to logits [batch, seq, vocab] on the last stage."""

    def __init__(self, config: LlamaConfig, full: LlamaForCausalLM, stage_index: int, num_stages: int,
                 layer_range: range | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.layer_range = layer_range if layer_range is not None else \
            stage_layer_ranges(config.num_hidden_layers, num_stages)[stage_index]
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in self.layer_range})
        if self.is_last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.activation_checkpointing = False
        self._mask_cache: tuple[tuple, Tensor] | None = None

    def _mask(self, hidden: Tensor) -> Tensor:
        key = (hidden.shape[1], hidden.dtype, hidden.device)
        if self._mask_cache is None or self._mask_cache[0] != key:
            self._mask_cache = (key, causal_mask(*key))
        return self._mask_cache[1]

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = self.model.embed_tokens(inputs) if self.is_first else inputs
        seq_len = hidden.shape[1]
        position_ids = torch.arange(seq_len, device=hidden.device)[None]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        mask = self._mask(hidden)
        for layer in self.model.layers.values():
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only each layer's input; recompute its inside during backward.
                hidden = torch.utils.checkpoint.checkpoint(
                    layer, hidden, attention_mask=mask, position_ids=position_ids,
                    position_embeddings=position_embeddings, use_reentrant=False)
            else:
                hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                               position_embeddings=position_embeddings)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.is_last:
            return self.lm_head(self.model.norm(hidden))
        return hidden

    @staticmethod
    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Token-mean cross-entropy; labels are already the next tokens (no shift here)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def build_full_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """The whole model, initialised on CPU from `seed` without touching the global RNG."""
    if config.tie_word_embeddings:
        raise ValueError("tie_word_embeddings must be False: the embedding and the LM head live on different stages")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def load_full_model(config: LlamaConfig, path: str) -> LlamaForCausalLM:
    """A Hugging Face Llama checkpoint's weights in float32. A checkpoint that ties its LM head to
    the embedding gets an untied copy: the two live on different stages."""
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if model.config.vocab_size != config.vocab_size or model.config.num_hidden_layers != config.num_hidden_layers:
        raise ValueError(f"the checkpoint at {path} does not match its config.json")
    return model


def build_stage(config: LlamaConfig, *, seed: int, stage_index: int, num_stages: int,
                layer_range: range | None = None, init_from: str | None = None) -> LlamaStage:
    """Exactly stage `stage_index` of `num_stages` (decoder layers `layer_range`; even split if
    None), identical on every replica built from `seed`, or from the checkpoint at `init_from`."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
    full = load_full_model(config, init_from) if init_from else build_full_model(config, seed)
    return LlamaStage(config, full, stage_index, num_stages, layer_range)


def llama_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                 num_heads: int, max_seq_len: int, attn_implementation: str = "sdpa") -> LlamaConfig:
    """A LlamaConfig with the reference's defaults (untied head, RMSNorm eps 1e-6, MHA)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_seq_len, tie_word_embeddings=False, rms_norm_eps=1e-6,
        attn_implementation=attn_implementation,
    )
