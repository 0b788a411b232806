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
    [[profiles]]                     # every profile gives name, one_way_ms and mbit
    name = "wan"
    one_way_ms = 25                  # one-way delay added to each direction
    jitter_ms = 0                    # optional: uniform in [-jitter, +jitter], never reordering
    mbit = 50                        # each direction's rate in Mbit/s; 0 = unlimited
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

    def columns(self) -> dict:
        """What names the cell in a results row."""
        return {
            "cell": self.name,
            "group": self.group,
            "variant": self.variant.name if self.variant else "",
            "method": self.method,
            "replicas": self.replicas,
            "stages": self.stages,
            "profile": self.profile.name,
            "seed": self.seed,
        }


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
        for name in ("methods", "replicas", "stages", "seeds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                repeated = sorted({v for v in values if values.count(v) > 1})
                raise ConfigError(
                    f"scenario.{name}",
                    f"{', '.join(map(str, repeated))} given more than once (two cells of one name: the second "
                    "would overwrite the first, and a group's spread would count one run twice)",
                    "list each value once",
                )
        if min(self.replicas) < 2 and set(self.methods) - {"none"}:
            raise ConfigError(
                "scenario.replicas",
                "a cell with 1 replica per stage has no one to pair or average with: every outer round of "
                f"{', '.join(m for m in self.methods if m != 'none')} would go solo",
                "use replicas >= 2, or method none for one pipeline that only takes Adam steps",
            )
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
    profiles = tuple(
        _profile(i, p) for i, p in enumerate(raw.pop("profiles", None) or [{"name": "lan", "one_way_ms": 0, "mbit": 0}])
    )
    variants = []
    for i, v in enumerate(raw.pop("variants", [])):
        if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not v["name"]:
            raise ConfigError(f"scenario.variants[{i}]", "has no name", 'give each [[variants]] a name = "..."')
        variants.append(Variant(v["name"], tuple((k, x) for k, x in v.items() if k != "name")))
    for key in ("methods", "replicas", "stages", "seeds", "outer_sync_sizes", "outer_sync_methods", "paper"):
        if key in raw:
            raw[key] = tuple(raw[key]) if isinstance(raw[key], list) else (raw[key],)
    for key, value in raw.items():
        _check_type(key, value)
    return Scenario(profiles=profiles, variants=tuple(variants), **raw)


def _profile(index: int, entry: Any) -> LinkProfile:
    """One [[profiles]] entry: a link's delay and rate are given, never assumed (a profile named like
    a slow link but left without them would run unlimited under that name)."""
    field_name = f"scenario.profiles[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(
            field_name, "is not a table", 'write [[profiles]] then name = "...", one_way_ms = 25, mbit = 50'
        )
    missing = [k for k in ("name", "one_way_ms", "mbit") if k not in entry]
    if missing:
        raise ConfigError(
            field_name,
            f"profile {entry.get('name', '?')!r} lacks {', '.join(missing)}",
            "give each profile name, one_way_ms (one-way delay) and mbit (each direction's rate; 0 = unlimited)",
        )
    try:
        for key in ("one_way_ms", "jitter_ms", "mbit"):
            if key in entry and (isinstance(entry[key], bool) or not isinstance(entry[key], (int, float))):
                raise ValueError(f"{key} must be a number, got {entry[key]!r}")
        return LinkProfile(**entry)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            field_name, str(exc), "each profile has name, one_way_ms, jitter_ms (optional), mbit"
        ) from None


_INTS = ("steps", "eval_every", "eval_sequences", "outer_sync_numel", "outer_sync_repeats", "threads")
_INT_LISTS = ("replicas", "stages", "seeds", "outer_sync_sizes")
_NUMBERS = ("cell_timeout_s", "chaos_every_s", "chaos_stall_s", "chaos_delay_s")
_STRINGS = ("name", "outer_sync_codec", "chaos_action")
_STRING_LISTS = ("methods", "outer_sync_methods", "paper")


def _check_type(key: str, value: Any) -> None:
    """A scenario field of the wrong type, named with its fix before any cell runs (a string where
    a number belongs, `steps = 2.5`, `seeds = "0,1"`)."""
    field_name = f"scenario.{key}"
    if key in _INTS and not _is_int(value):
        raise ConfigError(field_name, f"expected a whole number, got {value!r}", f"write e.g. {key} = 10")
    if key in _INT_LISTS and not all(_is_int(v) for v in value):
        raise ConfigError(
            field_name, f"expected a list of whole numbers, got {list(value)!r}", f"write e.g. {key} = [0, 1]"
        )
    if key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(field_name, f"expected a number of seconds, got {value!r}", f"write e.g. {key} = 20")
    if key in _STRINGS and not isinstance(value, str):
        raise ConfigError(field_name, f"expected a string, got {value!r}", f'write e.g. {key} = "..." in quotes')
    if key in _STRING_LISTS and not all(isinstance(v, str) for v in value):
        raise ConfigError(field_name, f"expected a list of strings, got {list(value)!r}", f'write e.g. {key} = ["..."]')
    if key == "overrides" and not isinstance(value, dict):
        raise ConfigError(
            field_name, "expected a table of node config fields", 'write [overrides] and "section.field" = value lines'
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
