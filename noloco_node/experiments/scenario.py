"""An experiment scenario: a grid over method x replicas D x stages P x network profile x seed,
plus what every cell shares (steps, node config overrides, evaluation). From a TOML file:

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
    threads = 1                      # torch threads per node process
    cell_timeout_s = 600
    [overrides]                      # node config for every cell (section.field = value)
    "model.hidden_size" = 64
    [[profiles]]
    name = "wan"
    one_way_ms = 25
    jitter_ms = 0
    mbit = 50
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from noloco_node.config import METHODS, ConfigError
from noloco_node.netem.relay import LinkProfile

GRID_METHODS = tuple(m for m in METHODS if m != "none")


@dataclass(frozen=True)
class Cell:
    method: str
    replicas: int
    stages: int
    profile: LinkProfile
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-D{self.replicas}-P{self.stages}-{self.profile.name}-s{self.seed}"


@dataclass(frozen=True)
class Scenario:
    name: str = "experiment"
    methods: tuple[str, ...] = GRID_METHODS
    replicas: tuple[int, ...] = (2,)
    stages: tuple[int, ...] = (2,)
    seeds: tuple[int, ...] = (0,)
    profiles: tuple[LinkProfile, ...] = (LinkProfile("lan"),)
    steps: int = 40
    eval_every: int = 10
    eval_sequences: int = 32
    outer_sync_sizes: tuple[int, ...] = (2, 4, 8)
    outer_sync_numel: int = 1_000_000
    threads: int = 1
    cell_timeout_s: float = 600.0
    chaos_action: str | None = None
    """Chaos profile: kill (and restart from checkpoint), stall or delay a random node of each
    cell every chaos_every_s seconds (experiments/chaos.py); None = no chaos."""
    chaos_every_s: float = 20.0
    chaos_stall_s: float = 8.0
    chaos_delay_s: float = 1.0
    overrides: dict[str, Any] = field(default_factory=dict)

    def chaos_profile(self):
        from noloco_node.experiments.chaos import ChaosProfile

        return ChaosProfile(action=self.chaos_action, every_s=self.chaos_every_s, stall_s=self.chaos_stall_s,
                            delay_s=self.chaos_delay_s)

    def __post_init__(self) -> None:
        for method in self.methods:
            if method not in GRID_METHODS:
                raise ConfigError("scenario.methods", f"unknown method {method!r}", f"use {', '.join(GRID_METHODS)}")
        for name in ("replicas", "stages", "outer_sync_sizes"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"scenario.{name}", "must be a non-empty list of positive integers", "e.g. [2]")
        if min(self.outer_sync_sizes) < 2:
            raise ConfigError("scenario.outer_sync_sizes", "an outer round needs N >= 2", "e.g. [2, 4, 8]")
        for name in ("steps", "eval_every", "eval_sequences", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scenario.{name}", f"must be >= 1, got {getattr(self, name)}", "use a positive integer")
        if self.chaos_action is not None:
            try:
                self.chaos_profile()
            except ValueError as exc:
                raise ConfigError("scenario.chaos_action", str(exc), "use kill, stall or delay with positive seconds") from None
        if len({p.name for p in self.profiles}) != len(self.profiles):
            raise ConfigError("scenario.profiles", "profile names repeat", "give every [[profiles]] a distinct name")

    def cells(self) -> list[Cell]:
        return [Cell(m, d, p, prof, s) for prof, d, p, m, s in
                itertools.product(self.profiles, self.replicas, self.stages, self.methods, self.seeds)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["profiles"] = [p.to_dict() for p in self.profiles]
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
    for key in ("methods", "replicas", "stages", "seeds", "outer_sync_sizes"):
        if key in raw:
            raw[key] = tuple(raw[key]) if isinstance(raw[key], list) else (raw[key],)
    return Scenario(profiles=profiles, **raw)
