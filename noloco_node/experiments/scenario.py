"""An experiment scenario: a grid over method x variant x replicas D x stages P x network profile
x seed, plus what every cell shares (steps, node config overrides, evaluation). From a TOML file:

    name = "example"
    methods = ["noloco", "diloco", "dp"]
    replicas = [2]
    stages = [2]
    seeds = [0]
    steps = 60                       # inner steps per cell
    eval_every = 10                  # validation loss and weight spread every K inner steps
    eval_sequences = 32              # held-out sequences per evaluation
    outer_sync_sizes = [2, 4, 8]     # N for the outer-sync-time measurement (per profile)
    outer_sync_numel = 1000000
    outer_sync_methods = []          # [] = noloco and diloco when the grid has them (dp counts as diloco)
    outer_sync_codec = "bf16"        # NoLoCo's wire codec in the outer-sync measurement (diloco: fp32)
    outer_sync_repeats = 1           # rounds measured per (method, profile, N), each with fresh peers
    threads = 1                      # torch threads per node process
    paper = ["..."]                  # the claims this scenario checks, quoted at the top of the report
    cell_timeout_s = 600
    [overrides]                      # node config for every cell (section.field = value)
    "model.hidden_size" = 64
    [[profiles]]
    name = "wan"
    one_way_ms = 25
    jitter_ms = 0
    mbit = 50
    [[variants]]                     # optional: named override sets crossed with the grid
    name = "gamma0.35"
    "outer.gamma" = 0.35

A cell's name is method[-variant]-D-P-profile-seed; cells that differ only in the seed form a
group, whose numbers the report gives as mean and standard deviation over seeds.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from noloco_node.config import METHODS, ConfigError
from noloco_node.netem.relay import LinkProfile

GRID_METHODS = tuple(METHODS)
SYNC_METHODS = ("noloco", "diloco")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Cell:
    method: str
    replicas: int
    stages: int
    profile: LinkProfile
    seed: int
    variant: Variant | None = None

    @property
    def group(self) -> str:
        """The cell's name without the seed: cells of one group differ only in the seed."""
        middle = f"-{self.variant.name}" if self.variant else ""
        return f"{self.method}{middle}-D{self.replicas}-P{self.stages}-{self.profile.name}"

    @property
    def name(self) -> str:
        return f"{self.group}-s{self.seed}"


@dataclass(frozen=True)
class Scenario:
    name: str = "experiment"
    methods: tuple[str, ...] = ("noloco", "diloco", "dp")
    """[] = no training cells (an outer-sync-only scenario)."""
    replicas: tuple[int, ...] = (2,)
    stages: tuple[int, ...] = (2,)
    seeds: tuple[int, ...] = (0,)
    profiles: tuple[LinkProfile, ...] = (LinkProfile("lan"),)
    steps: int = 40
    eval_every: int = 10
    eval_sequences: int = 32
    outer_sync_sizes: tuple[int, ...] = (2, 4, 8)
    outer_sync_numel: int = 1_000_000
    outer_sync_methods: tuple[str, ...] = ()
    outer_sync_codec: str = "bf16"
    outer_sync_repeats: int = 1
    threads: int = 1
    cell_timeout_s: float = 600.0
    chaos_action: str | None = None
    """Chaos profile: kill (and restart from checkpoint), stall or delay a random node of each
    cell every chaos_every_s seconds (experiments/chaos.py); None = no chaos."""
    chaos_every_s: float = 20.0
    chaos_stall_s: float = 8.0
    chaos_delay_s: float = 1.0
    overrides: dict[str, Any] = field(default_factory=dict)
    variants: tuple[Variant, ...] = ()
    paper: tuple[str, ...] = ()

    def chaos_profile(self):
        from noloco_node.experiments.chaos import ChaosProfile

        return ChaosProfile(
            action=self.chaos_action, every_s=self.chaos_every_s, stall_s=self.chaos_stall_s, delay_s=self.chaos_delay_s
        )

    def __post_init__(self) -> None:
        for method in self.methods:
            if method not in GRID_METHODS:
                raise ConfigError("scenario.methods", f"unknown method {method!r}", f"use {', '.join(GRID_METHODS)}")
        for method in self.outer_sync_methods:
            if method not in SYNC_METHODS:
                raise ConfigError(
                    "scenario.outer_sync_methods", f"unknown method {method!r}", "use noloco and/or diloco"
                )
        for name in ("replicas", "stages", "outer_sync_sizes"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"scenario.{name}", "must be a non-empty list of positive integers", "e.g. [2]")
        if min(self.outer_sync_sizes) < 2:
            raise ConfigError("scenario.outer_sync_sizes", "an outer round needs N >= 2", "e.g. [2, 4, 8]")
        for name in ("steps", "eval_every", "eval_sequences", "threads", "outer_sync_repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"scenario.{name}", f"must be >= 1, got {getattr(self, name)}", "use a positive integer"
                )
        if self.chaos_action is not None:
            try:
                self.chaos_profile()
            except ValueError as exc:
                raise ConfigError(
                    "scenario.chaos_action", str(exc), "use kill, stall or delay with positive seconds"
                ) from None
        if len({p.name for p in self.profiles}) != len(self.profiles):
            raise ConfigError("scenario.profiles", "profile names repeat", "give every [[profiles]] a distinct name")
        if len({v.name for v in self.variants}) != len(self.variants):
            raise ConfigError("scenario.variants", "variant names repeat", "give every [[variants]] a distinct name")

    def sync_methods(self) -> tuple[str, ...]:
        """The methods whose one outer round is measured against N."""
        if self.outer_sync_methods:
            return self.outer_sync_methods
        return tuple(m for m in SYNC_METHODS if m in self.methods or m == "diloco" and "dp" in self.methods)

    def cells(self) -> list[Cell]:
        """Seeds innermost, so a group's cells run back to back."""
        return [
            Cell(m, d, p, prof, s, v)
            for prof, d, p, m, v, s in itertools.product(
                self.profiles, self.replicas, self.stages, self.methods, self.variants or (None,), self.seeds
            )
        ]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["profiles"] = [p.to_dict() for p in self.profiles]
        d["variants"] = [{"name": v.name, **dict(v.overrides)} for v in self.variants]
        return d


def load_scenario(path: str | Path | None, **replace: Any) -> Scenario:
    """A scenario from TOML (None = the defaults); `replace` wins over the file (CLI flags)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("scenario", f"no such file {str(path)!r}", "pass the path of a scenario TOML") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("scenario", f"{path} is not valid TOML ({exc})", "fix the TOML syntax") from None
    raw.update({k: v for k, v in replace.items() if v is not None})
    known = set(Scenario.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"scenario.{unknown[0]}", "unknown field", f"valid fields: {', '.join(sorted(known))}")
    try:
        profiles = tuple(LinkProfile(**p) for p in raw.pop("profiles", [{"name": "lan"}]))
    except (TypeError, ValueError) as exc:
        raise ConfigError("scenario.profiles", str(exc), "each profile has name, one_way_ms, jitter_ms, mbit") from None
    variants = []
    for i, v in enumerate(raw.pop("variants", [])):
        if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not v["name"]:
            raise ConfigError(f"scenario.variants[{i}]", "has no name", 'give each [[variants]] a name = "..."')
        variants.append(Variant(v["name"], tuple((k, x) for k, x in v.items() if k != "name")))
    for key in ("methods", "replicas", "stages", "seeds", "outer_sync_sizes", "outer_sync_methods", "paper"):
        if key in raw:
            raw[key] = tuple(raw[key]) if isinstance(raw[key], list) else (raw[key],)
    return Scenario(profiles=profiles, variants=tuple(variants), **raw)
