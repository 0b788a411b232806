"""The sections of the two optimizers: inner (the Adam steps of a stage) and outer (the method
that syncs replicas: noloco, diloco, dp or none) with its per-method reference defaults. Split
from sections.py; `noloco_node.config` exports them."""

from __future__ import annotations

from dataclasses import dataclass

from noloco_node.codec.names import DENSE, check_delta_codec, check_phi_codec
from noloco_node.config.checks import _require

METHODS = ("noloco", "diloco", "dp", "none")
# Reference hyperparameters per method (the authors' code, as docs/research.md gives them): H, alpha, beta.
METHOD_DEFAULTS = {"noloco": (50, 0.5, 0.7), "diloco": (100, 0.3, 0.7), "dp": (1, 0.0, 0.0), "none": (1, 0.0, 0.0)}


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
