"""The config's sections: one frozen dataclass each, whose fields carry their defaults and docs
and whose __post_init__ checks name the field and the fix."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noloco_node.codec.names import DENSE, PIPELINE_CODECS, check_delta_codec, check_phi_codec
from noloco_node.config.checks import ConfigError, _require
from noloco_node.config.links import NetworkConfig, SecurityConfig, TimeoutsConfig

METHODS = ("noloco", "diloco", "dp", "none")
# Reference hyperparameters per method (the authors' code, as docs/research.md gives them): H, alpha, beta.
METHOD_DEFAULTS = {"noloco": (50, 0.5, 0.7), "diloco": (100, 0.3, 0.7), "dp": (1, 0.0, 0.0), "none": (1, 0.0, 0.0)}


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
    cache_dir: str = "~/.cache/noloco-node"

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
        return Path(self.cache_dir).expanduser()


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    num_stages: int = 2
    """Pipeline stages the model is cut into; 1 = every node holds the whole model (no routing)."""
    stage: int | None = 0
    """The stage this node serves; None (or "auto") = the stage of a checkpoint found in
    checkpoint.dir, else the stage that sustains the least (a stage without replicas first), agreed
    with other joiners of the same moment through claims in the DHT (pipeline/stage_choice.py)."""
    batch_size: int = 8
    """B: sequences whose gradients one inner step accumulates, per replica."""
    microbatch_size: int = 1
    """Sequences per routed microbatch (the reference uses 1)."""
    routing: str = "capacity"
    """capacity: a random replica, drawn in proportion to its measured capacity (from its record;
    uniform until measured); random: each sender's own shuffled cycle over the live replicas, equal
    shares whatever their speed; fixed: always the next stage's replica at this sender's own index
    (D fixed pipelines, the paper's ablation of random routing); balanced: the reference's
    per-microbatch permutation (equal
    shares per replica while the stages' memberships match, else random). The all-reduce
    baselines (dp, diloco) always route balanced: every round's group is all D replicas at that
    round, so every replica must get exactly one batch per step."""
    max_in_flight: int = 8
    """Microbatches a node holds saved inputs for at once; beyond it, senders get BUSY."""
    activation_codec: str = "int8"
    """Wire codec of the forward activations: none (exact fp32, 4 bytes/value), bf16 (2), int8 (1.06),
    fp8 (e4m3, 1.06) or int4 (0.56); the blockwise ones carry one float32 scale per 64 values.
    int8 by default: inside the noise of bf16 in the loss-price reproduction at half the bytes
    (docs/experiments/loss_price/steps40); int4 halves them again at a small, seed-consistent price."""
    gradient_codec: str | None = None
    """Wire codec of the backward gradients, same choices; None = activation_codec. int4 rounds
    gradients stochastically (unbiased), activations to nearest."""
    deterministic: bool = False
    """Debug/oracle mode: microbatches issued one at a time in data order, no shuffling."""
    device: str = "auto"
    """Where this stage computes: auto (cuda if torch sees a GPU, else cpu), cpu, cuda or cuda:N."""
    bf16_autocast: bool = True
    """On a GPU, run the stage's compute under bf16 autocast (fp32 master weights, phi and m)."""
    layers_per_stage: tuple[int, ...] = ()
    """Decoder layers per stage, e.g. [7, 5]; empty = split by per-token compute cost (model/split.py)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory)."""
    schedule: str = "exact"
    """Stage 0's schedule. exact: a batch's microbatches all complete and the stage steps before
    the next batch starts (the oracle-equal mode). overlap: the next batch's forwards start while
    the current batch's gradients drain, so the pipeline never empties at a step boundary; those
    forwards see weights one inner step old (staleness bounded by 1): each stage keeps a copy of
    those weights for their backward, which waits for the step and gives the gradient at them
    (weight stashing). Not with outer.method = dp (lockstep)."""
    rebalance: bool | None = None
    """May this node move to another stage when that stage limits the swarm (pipeline/rebalance.py)?
    None = only if it chose its stage with 'auto'; true = also from a pinned stage; false = never."""
    rebalance_margin: float = 0.75
    """Move when the swarm sustains less than this share of what it would after the best single move
    (Petals: 0.75). Closer to 1 moves sooner; lower tolerates more imbalance."""
    rebalance_period_s: float = 120.0
    """How often a movable node checks the plan; a node that moved does not move again for 10
    periods, and nobody moves within 2 periods of any move."""

    def __post_init__(self) -> None:
        _require(self.num_stages >= 1, "num_stages", f"must be >= 1, got {self.num_stages}", "use a positive integer")
        _require(
            self.stage is None or 0 <= self.stage < self.num_stages,
            "stage",
            f"{self.stage} is outside 0..{self.num_stages - 1}",
            "pick a stage index below num_stages, or 'auto'",
        )
        _require(
            self.routing in ("capacity", "balanced", "random", "fixed"),
            "routing",
            f"unknown routing {self.routing!r}",
            "use capacity, balanced, random or fixed",
        )
        _require(
            self.batch_size >= 1 and self.microbatch_size >= 1,
            "batch_size",
            "batch_size and microbatch_size must be >= 1",
            "use positive integers",
        )
        _require(
            self.batch_size % self.microbatch_size == 0,
            "microbatch_size",
            f"batch_size {self.batch_size} is not a multiple of microbatch_size {self.microbatch_size}",
            "make batch_size a multiple of microbatch_size",
        )
        _require(
            self.schedule in ("exact", "overlap"),
            "schedule",
            f"unknown schedule {self.schedule!r}",
            "use exact or overlap",
        )
        _require(
            0.0 < self.rebalance_margin < 1.0,
            "rebalance_margin",
            f"must be in (0, 1), got {self.rebalance_margin}",
            "use e.g. 0.75",
        )
        _require(
            self.rebalance_period_s > 0,
            "rebalance_period_s",
            f"must be > 0, got {self.rebalance_period_s}",
            "use e.g. 120 (set pipeline.rebalance = false to pin the node)",
        )
        _require(self.max_in_flight >= 1, "max_in_flight", f"must be >= 1, got {self.max_in_flight}", "use e.g. 8")
        _require(
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
            "device",
            f"unknown device {self.device!r}",
            "use auto, cpu, cuda or cuda:N",
        )
        _require(
            self.activation_codec in PIPELINE_CODECS,
            "activation_codec",
            f"unknown codec {self.activation_codec!r}",
            f"use one of {', '.join(PIPELINE_CODECS)}",
        )
        if self.gradient_codec is None:
            object.__setattr__(self, "gradient_codec", self.activation_codec)
        _require(
            self.gradient_codec in PIPELINE_CODECS,
            "gradient_codec",
            f"unknown codec {self.gradient_codec!r}",
            f"use one of {', '.join(PIPELINE_CODECS)}, or leave it unset to follow activation_codec",
        )
        _require(
            not self.layers_per_stage or len(self.layers_per_stage) == self.num_stages,
            "layers_per_stage",
            f"has {len(self.layers_per_stage)} entries but num_stages is {self.num_stages}",
            f"give one layer count per stage ({self.num_stages}), or leave it empty to split by cost",
        )
        _require(
            all(n >= 1 for n in self.layers_per_stage),
            "layers_per_stage",
            f"{list(self.layers_per_stage)} gives a stage no decoder layer",
            "give every stage >= 1 layer, or leave it empty to split by cost",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    lr: float = 6e-4
    """Peak Adam learning rate."""
    warmup_steps: int = 1000
    total_steps: int = 25000
    """Cosine decays to lr * min_lr_ratio at this inner step."""
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    """Gradient clipping over this stage's own parameters."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}", "use e.g. 6e-4")
        _require(self.warmup_steps >= 1, "warmup_steps", f"must be >= 1, got {self.warmup_steps}", "use e.g. 1000")
        _require(
            self.total_steps >= self.warmup_steps,
            "total_steps",
            f"{self.total_steps} is below warmup_steps {self.warmup_steps}",
            "raise total_steps or lower warmup_steps",
        )
        _require(
            0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}", "use 0.1"
        )
        _require(self.clip_norm > 0, "clip_norm", f"must be > 0, got {self.clip_norm}", "use 1.0")
        for name in ("beta1", "beta2"):
            _require(
                0.0 <= getattr(self, name) < 1.0,
                name,
                f"must be in [0, 1), got {getattr(self, name)}",
                "use 0.9 / 0.999",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    method: str = "noloco"
    """noloco (pairwise), diloco (all-reduce), dp (gradient all-reduce every step) or none."""
    inner_steps_per_outer: int | None = None
    """H; None = the method's reference default (noloco 50, diloco 100)."""
    alpha: float | None = None
    """Outer momentum; None = reference default (noloco 0.5, diloco 0.3)."""
    beta: float | None = None
    """Outer learning rate; None = 0.7."""
    gamma: float | None = None
    """NoLoCo local-averaging coefficient; None = beta. Any value runs over the network: peers
    then exchange slow weights phi and outer delta Delta (codec_phi, codec_delta)."""
    codec: str = "bf16"
    """Wire codec of outer snapshots (none, bf16 or int8): the default of codec_phi and codec_delta."""
    codec_phi: str | None = None
    """Wire codec of the slow weights phi, and of the fast weights when only they travel (gamma ==
    beta and codec_phi == codec_delta): none, bf16, int8, or slice:F (exact values on a slice of
    the coordinates both sides derive from the run's seed and the round, one of round(1 / F)
    parts, a different one each round); None = codec."""
    codec_delta: str | None = None
    """Wire codec of the outer delta theta - phi: none, bf16, int8, topk:F (the largest-|x|
    fraction F, e.g. topk:0.05, with the rest kept on the node and sent in later rounds), or
    topk:F+int2 / topk:F+int4 (per 4096-element chunk, 12-bit indices, 2- or 4-bit values, the
    rounding error kept like the rest); None = codec."""
    max_distance_ratio: float = 10.0
    """Reject a partner's snapshot farther from our slow weights than this many times our own drift."""
    overlap: bool = True
    """noloco: run the outer exchange in the background while inner steps go on, and apply the pair
    update when it completes (at the next boundary at the latest), keeping the local progress made
    meanwhile: theta <- phi_new + (theta_now - theta_frozen). False = training waits for the round
    (the form the oracle test checks bit for bit; both are equal when no step falls in between).
    On by default: its loss was inside the noise of the blocking form in the loss-price reproduction."""
    allreduce_group_size: int = 0
    """diloco/dp: replicas of a stage in each all-reduce. Every round's group is all of them, at that
    round: a round that misses one fails for its members within its deadline and each steps solo
    (counted). 0 = unknown: any 2 to 64 replicas of the round that meet within timeouts.match_s."""

    def __post_init__(self) -> None:
        _require(
            self.method in METHODS, "method", f"unknown method {self.method!r}", f"use one of {', '.join(METHODS)}"
        )
        h, alpha, beta = METHOD_DEFAULTS[self.method]
        for name, default in (("inner_steps_per_outer", h), ("alpha", alpha), ("beta", beta)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.gamma is None:
            object.__setattr__(self, "gamma", self.beta)
        _require(
            self.inner_steps_per_outer >= 1,
            "inner_steps_per_outer",
            f"must be >= 1, got {self.inner_steps_per_outer}",
            "use e.g. 50",
        )
        _require(
            0.0 <= self.alpha < 1.0, "alpha", f"must be in [0, 1), got {self.alpha}", "use 0.5 (noloco) or 0.3 (diloco)"
        )
        _require(self.beta >= 0.0, "beta", f"must be >= 0, got {self.beta}", "use 0.7")
        _require(self.codec in DENSE, "codec", f"unknown codec {self.codec!r}", f"use one of {', '.join(DENSE)}")
        for name in ("codec_phi", "codec_delta"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.codec)
        for name, check, example in (
            ("codec_phi", check_phi_codec, "slice:0.03125"),
            ("codec_delta", check_delta_codec, "topk:0.02+int2"),
        ):
            try:
                check(getattr(self, name))
            except ValueError as exc:
                _require(False, name, str(exc), f'e.g. {name} = "{example}"')
        _require(
            self.max_distance_ratio > 0, "max_distance_ratio", f"must be > 0, got {self.max_distance_ratio}", "use 10"
        )
        _require(
            self.allreduce_group_size >= 0,
            "allreduce_group_size",
            f"must be >= 0, got {self.allreduce_group_size}",
            "use the number of replicas per stage, or 0",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Where this node keeps its checkpoint; None = no checkpoints. A node started with a
    checkpoint of the same run and stage here resumes from it."""
    every_steps: int = 50
    """Checkpoint every this many inner steps (and on graceful shutdown)."""

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "every_steps", f"must be >= 1, got {self.every_steps}", "use e.g. 50")


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
