"""The config's sections: one frozen dataclass each, whose fields carry their defaults and docs
and whose __post_init__ checks name the field and the fix."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noloco_node.config.checks import ConfigError, _require
from noloco_node.config.links import NetworkConfig, SecurityConfig, TimeoutsConfig
from noloco_node.config.optimizers import InnerConfig, OuterConfig
from noloco_node.config.pipeline import PipelineConfig

DEFAULT_CACHE_DIR = "~/.cache/noloco-node"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    run_id: str = "local"
    """Namespaces every DHT key; peers of different runs never talk to each other."""
    seed: int = 0
    """Initial weights (phi_0) and data order derive from it; part of the manifest hash."""

    def __post_init__(self) -> None:
        _require(
            bool(self.run_id) and "/" not in self.run_id,
            "run_id",
            f"{self.run_id!r} is empty or contains '/'",
            "use letters, digits, '-' or '_'",
        )


# The paper's shapes as the authors' configs build them (docs/volunteer.md, Training a real model), and
# today's tiny default: hidden, intermediate, decoder layers, attention heads.
MODEL_PRESETS = {
    "tiny": (128, 352, 4, 4),
    "small": (768, 3072, 12, 12),
    "medium": (2048, 8192, 24, 32),
    "large": (4096, 16384, 32, 32),
}
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"
    """tiny | small | medium | large (the paper's three shapes); the shape fields override it."""
    config: str | None = None
    """A local Hugging Face LlamaConfig JSON (or a directory holding config.json) instead of a preset."""
    init_from: str | None = None
    """A local Hugging Face Llama checkpoint directory: phi_0 is its weights (continued pre-training)."""
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    seq_len: int = 128
    """Tokens per training sequence."""
    attn_implementation: str = "sdpa"
    """'sdpa' or 'eager'; the causal mask is always passed explicitly."""
    residual_subspace: int = 0
    """k > 0: everything written into the residual stream lives in a fixed k-dimensional subspace,
    and a pipeline hop carries k numbers per token instead of hidden_size (model/subspace.py,
    docs/architecture.md: Residual-subspace hops); 0: the dense model."""

    def __post_init__(self) -> None:
        _require(
            self.preset in MODEL_PRESETS,
            "preset",
            f"unknown preset {self.preset!r}",
            f"use one of {', '.join(MODEL_PRESETS)}, or model.config = PATH",
        )
        _require(
            not (self.config and self.init_from),
            "config",
            "model.config and model.init_from are both set",
            "keep only init_from: the checkpoint's config.json is the model's config",
        )
        for name in _SHAPE_FIELDS:
            value = getattr(self, name)
            _require(
                value is None or not (self.config or self.init_from),
                name,
                f"is set, but the model comes from {'model.config' if self.config else 'model.init_from'}",
                f"remove model.{name} (edit the config JSON instead)",
            )
            _require(value is None or value >= 1, name, f"must be >= 1, got {value}", "use a positive integer")
        _require(self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}", "use a positive integer")
        if not (self.config or self.init_from):
            shape = self.shape()
            _require(
                shape["hidden_size"] % shape["num_heads"] == 0,
                "num_heads",
                f"hidden_size {shape['hidden_size']} is not divisible by num_heads {shape['num_heads']}",
                "choose num_heads that divides hidden_size",
            )
        _require(
            self.residual_subspace >= 0,
            "residual_subspace",
            f"must be >= 0, got {self.residual_subspace}",
            "use 0 (dense) or a rank such as hidden_size / 32",
        )
        _require(
            not (self.residual_subspace and self.init_from),
            "residual_subspace",
            "is set with model.init_from: a dense checkpoint's layers write outside any subspace",
            "set model.residual_subspace = 0 to continue from a checkpoint",
        )
        if self.residual_subspace and not (self.config or self.init_from):
            hidden = self.shape()["hidden_size"]
            _require(
                self.residual_subspace <= hidden,
                "residual_subspace",
                f"{self.residual_subspace} is more than hidden_size {hidden}",
                f"use a rank below {hidden}, e.g. {max(1, hidden // 32)}",
            )
        _require(
            self.attn_implementation in ("sdpa", "eager"),
            "attn_implementation",
            f"unknown value {self.attn_implementation!r}",
            "use 'sdpa' or 'eager'",
        )

    def shape(self) -> dict[str, int]:
        """The preset's shape with the fields that are set applied over it."""
        base = dict(zip(_SHAPE_FIELDS, MODEL_PRESETS[self.preset]))
        return {name: getattr(self, name) or base[name] for name in _SHAPE_FIELDS}


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    path: str | None = None
    """File, directory or glob of .txt/.json(l)(.gz)/.parquet; None = the embedded KJV corpus."""
    text_field: str = "text"
    tokenizer: str | None = None
    """tokenizer.json path, local tokenizer dir or cached HF name; None = train a BPE on the corpus."""
    vocab_size: int = 4096
    """Vocabulary of the BPE trained when tokenizer is None."""
    holdout_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of the text)."""
    cache_dir: str = DEFAULT_CACHE_DIR
    """Where the corpus and a trained tokenizer are cached; the default follows $XDG_CACHE_HOME
    when it is set, as checkpoints follow $XDG_STATE_HOME."""

    def __post_init__(self) -> None:
        _require(
            self.vocab_size >= 258,
            "vocab_size",
            f"must be >= 258 (256 bytes + 2 specials), got {self.vocab_size}",
            "use e.g. 4096",
        )
        _require(
            0.0 <= self.holdout_fraction < 1.0,
            "holdout_fraction",
            f"must be in [0, 1), got {self.holdout_fraction}",
            "use e.g. 0.02",
        )

    @property
    def cache_path(self) -> Path:
        if self.cache_dir == DEFAULT_CACHE_DIR and os.environ.get("XDG_CACHE_HOME"):
            return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "noloco-node"
        return Path(self.cache_dir).expanduser()


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Where this node keeps its checkpoint. A node started with a checkpoint of the same run and
    stage here resumes from it (unless its stage's live replicas are further on: then it copies
    their state). Unset: see `auto`."""
    every_steps: int = 50
    """Checkpoint every this many inner steps (and on graceful shutdown)."""
    behind_rounds: int = 2
    """A node resumes its checkpoint unless its stage's live replicas are more than this many outer
    rounds (x outer.inner_steps_per_outer inner steps) past it; then it copies their state. A node
    down briefly keeps its own state without a state transfer (minutes over a home link); one
    away for long comes back at the swarm's."""
    auto: bool = True
    """With no `dir`, `join` keeps the checkpoints in a folder of its own,
    `$XDG_STATE_HOME/noloco-node/<run_id>/<config fingerprint>/node-<n>` (`~/.local/state/...`),
    n the first one no running node holds, so a node started again resumes; false = no checkpoints
    without `dir`.
    Launchers of local swarms (demo, experiment) set it false."""

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "every_steps", f"must be >= 1, got {self.every_steps}", "use e.g. 50")
        _require(self.behind_rounds >= 0, "behind_rounds", f"must be >= 0, got {self.behind_rounds}", "use e.g. 2")


@dataclass(frozen=True, kw_only=True, slots=True)
class LogConfig:
    """What a node reports about itself; not part of the run manifest."""

    events_file: str | None = None
    """Append a JSONL event stream here (started, inner_step, outer_round, checkpoint, stopping, ...)."""
    progress: str = "auto"
    """A live progress line on stderr: auto (only on a terminal), on or off."""
    every_steps: int = 10
    """Without the progress line (no terminal: systemd, Docker), `join` logs a step line every N
    inner steps (step, loss, lr, tokens/s, in flight, outer outcome, bytes); 0 = none. The closing
    summary is logged either way."""

    def __post_init__(self) -> None:
        _require(
            self.progress in ("auto", "on", "off"),
            "progress",
            f"unknown value {self.progress!r}",
            "use auto, on or off",
        )
        _require(
            isinstance(self.every_steps, int) and self.every_steps >= 0,
            "every_steps",
            f"must be an integer >= 0, got {self.every_steps!r}",
            "use e.g. 10, or 0 for no step lines",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultsConfig:
    """Fault injection for tests and chaos experiments; all off by default."""

    delay_before_forward_s: float = 0.0
    """Sleep this long before computing each received forward (makes work sit in flight)."""
    compute_delay_s: float = 0.0
    """Hold the compute thread this long per forward and per backward pass (a slower device: it
    lowers the node's measured capacity, unlike delay_before_forward_s)."""
    inject: tuple[str, ...] = ()
    """Faults at named points, each "POINT:ACTION[=SECONDS][@N|%P]": points before_forward,
    mid_backward, during_exchange, during_state_transfer, donate_parameter (a state donor, before
    each parameter it sends); actions crash (exit 17), stall/delay
    (sleep SECONDS), error (fail that operation); and send_snapshot:poison[=X] (send NaN, or our
    fast weights times X, as a lying peer would), inner_step:poison (the step's gradients are NaN),
    weights:poison[=X] (theta times X, or NaN, after the step); @N = only the Nth time the point is reached,
    %P = with probability P each time. E.g. "mid_backward:crash@3"."""

    def __post_init__(self) -> None:
        for name in ("delay_before_forward_s", "compute_delay_s"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}", "use 0 to disable")
        from noloco_node.runtime.faults import FaultSpecError, parse_fault

        for spec in self.inject:
            try:
                parse_fault(spec)
            except FaultSpecError as exc:
                raise ConfigError(
                    "inject", str(exc), 'use e.g. "mid_backward:crash@3" or "during_exchange:delay=0.5"'
                ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _require(
            not (self.pipeline.schedule == "overlap" and self.outer.method == "dp"),
            "pipeline.schedule",
            "overlap lets a batch's forwards run before the previous step, which dp's lockstep forbids",
            "use pipeline.schedule = exact with outer.method = dp",
        )
        if self.model.config or self.model.init_from:
            return  # the layer count is in the model's config.json (checked when the model is built)
        layers = self.model.shape()["num_layers"]
        _require(
            layers >= self.pipeline.num_stages,
            "pipeline.num_stages",
            f"{self.pipeline.num_stages} stages but only {layers} decoder layers (model.num_layers)",
            "use at most model.num_layers stages, or more layers",
        )
        _require(
            not self.pipeline.layers_per_stage or sum(self.pipeline.layers_per_stage) == layers,
            "pipeline.layers_per_stage",
            f"{list(self.pipeline.layers_per_stage)} sums to "
            f"{sum(self.pipeline.layers_per_stage)} but the model has {layers} decoder layers",
            f"give {self.pipeline.num_stages} counts that sum to {layers}, or leave it empty to split by cost",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def manifest_hash(self, *extra: str) -> str:
        """Hash of what every peer of a run must agree on (model, layout, seed, optimizer, data
        tokenization); `extra` adds runtime facts such as the tokenizer's hash."""
        d = self.to_dict()
        # Paths differ between machines: the files' contents enter through `extra` (manifest.py).
        model = {k: v for k, v in d["model"].items() if k not in ("config", "init_from")}
        if not model.get("residual_subspace"):  # the dense model's hash is the one it had before the option
            model.pop("residual_subspace", None)
        manifest = {
            "run": d["run"],
            "model": model,
            "num_stages": d["pipeline"]["num_stages"],
            "layers_per_stage": d["pipeline"]["layers_per_stage"],
            "inner": d["inner"],
            "outer": d["outer"],
            "vocab_size": d["data"]["vocab_size"],
            "extra": list(extra),
        }
        return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS: dict[str, type] = typing.get_type_hints(NodeConfig)
