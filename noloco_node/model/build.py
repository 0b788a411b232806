"""Which model a run trains, from its config: a preset shape, a Hugging Face LlamaConfig JSON, or a
Hugging Face Llama checkpoint whose weights are phi_0; and how its layers are split into stages.

Every peer resolves the same LlamaConfig and the same split from the same config and files, and
the manifest hash covers the files' contents (`files_fingerprint`), so peers whose model differs
are refused at the handshake.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from transformers import LlamaConfig

from noloco_node.config import ConfigError, ModelConfig
from noloco_node.model.init import checkpoint_weight_files
from noloco_node.model.split import balanced_layer_ranges, model_costs, ranges_from_counts
from noloco_node.model.stage import build_stage, llama_config

log = logging.getLogger(__name__)


def _config_json(path: str, field: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(
            field, f"{p} does not exist", "point it at a Hugging Face Llama config.json (or its directory)"
        )
    return p


def _read_json(p: Path, field: str) -> dict:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            field, f"{p} is not readable JSON ({exc})", "point it at a Hugging Face config.json"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{p} holds no JSON object", "point it at a Hugging Face config.json")
    if data.get("model_type", "llama") != "llama":
        raise ConfigError(
            field, f"{p} describes a {data['model_type']!r} model", "use a Llama config (model_type 'llama')"
        )
    return data


def resolve_llama_config(model: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The LlamaConfig of the run's model; the tokenizer in use has `vocab_size` tokens."""
    if model.config or model.init_from:
        field = "model.config" if model.config else "model.init_from"
        data = _read_json(_config_json(model.config or model.init_from, field), field)
        if data.get("vocab_size", 0) < vocab_size:
            raise ConfigError(
                field,
                f"the model's vocab_size {data.get('vocab_size')} is smaller than the tokenizer's {vocab_size} tokens",
                "use the tokenizer the model was made for (data.tokenizer = "
                "its directory), or raise vocab_size in the config",
            )
        if data.get("tie_word_embeddings"):
            # The embedding and the LM head live on different stages: each gets its own copy.
            log.info("%s ties its embedding and LM head; the pipeline unties them (the head starts as a copy)", field)
        data.update(tie_word_embeddings=False, attn_implementation=model.attn_implementation)
        config = LlamaConfig(
            **{
                k: v
                for k, v in data.items()
                if k not in ("architectures", "transformers_version", "torch_dtype", "model_type")
            }
        )
        if config.max_position_embeddings < model.seq_len:
            raise ConfigError(
                "model.seq_len",
                f"{model.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}",
                "lower model.seq_len",
            )
        return config
    shape = model.shape()
    return llama_config(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_layers"],
        num_heads=shape["num_heads"],
        max_seq_len=model.seq_len,
        attn_implementation=model.attn_implementation,
    )


def weight_files(path: str) -> list[Path]:
    files = checkpoint_weight_files(path)
    if not files:
        raise ConfigError(
            "model.init_from",
            f"{Path(path).expanduser()} holds no *.safetensors or pytorch_model*.bin weights",
            "point it at a Hugging Face checkpoint directory (save_pretrained output)",
        )
    return files


def files_fingerprint(model: ModelConfig) -> str:
    """A hash of the model files the config names (the config JSON; the checkpoint's config and
    weights), for the manifest: equal on every peer that has the same files, wherever they are."""
    if not (model.config or model.init_from):
        return "model-files:none"
    field = "model.config" if model.config else "model.init_from"
    digest = hashlib.sha256(_config_json(model.config or model.init_from, field).read_bytes())
    if model.init_from:
        for f in weight_files(model.init_from):
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
    return "model-files:" + digest.hexdigest()[:16]


def stage_ranges(
    config: LlamaConfig, num_stages: int, *, seq_len: int, layers_per_stage: tuple[int, ...] | list[int] = ()
) -> list[range]:
    """Decoder-layer ranges per stage: `layers_per_stage` if given, else split by per-token cost."""
    layers = config.num_hidden_layers
    if layers_per_stage:
        try:
            return ranges_from_counts(layers_per_stage, layers, num_stages)
        except ValueError as exc:
            raise ConfigError(
                "pipeline.layers_per_stage",
                str(exc),
                f"give {num_stages} counts >= 1 that sum to {layers}, or leave it empty to split by cost",
            ) from None
    if layers < num_stages:
        raise ConfigError(
            "pipeline.num_stages",
            f"{num_stages} stages for a model of {layers} decoder layers",
            f"use at most {layers} stages",
        )
    embed, layer, head = model_costs(config, seq_len=seq_len)
    return balanced_layer_ranges(layers, num_stages, embed_cost=embed, layer_cost=layer, head_cost=head)


def run_model(cfg, vocab_size: int) -> tuple[LlamaConfig, list[range]]:
    """(LlamaConfig, layer ranges per stage) of a run's NodeConfig."""
    config = resolve_llama_config(cfg.model, vocab_size)
    return config, stage_ranges(
        config, cfg.pipeline.num_stages, seq_len=cfg.model.seq_len, layers_per_stage=cfg.pipeline.layers_per_stage
    )


def build_run_stage(cfg, config: LlamaConfig, ranges: list[range], stage_index: int, *, device="cpu"):
    """Stage `stage_index` of the run's model, and only it, on `device`: phi_0 from the run seed
    and each parameter's name, or read from model.init_from (only this stage's tensors)."""
    if cfg.model.init_from:
        weight_files(cfg.model.init_from)  # the error names the config field
    stage = build_stage(
        config,
        seed=cfg.run.seed,
        stage_index=stage_index,
        num_stages=cfg.pipeline.num_stages,
        layer_range=ranges[stage_index],
        init_from=cfg.model.init_from,
        device=device,
        subspace_rank=cfg.model.residual_subspace,
    )
    stage.activation_checkpointing = cfg.pipeline.activation_checkpointing
    if cfg.pipeline.compile:
        stage.compile_layers()
    return stage
