"""Building a NodeConfig: defaults, a command's base values, a TOML file, then `--set` overrides,
with every value coerced to its field's type and every unknown name answered with a suggestion."""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from noloco_node.config.sections import SECTIONS, ConfigError, NodeConfig


# Optional fields for which the string "none" is a value of its own (a codec), not null.
NONE_IS_A_VALUE = {("outer", "codec_phi"), ("outer", "codec_delta"), ("pipeline", "gradient_codec")}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_coerce(v.strip() if isinstance(v, str) else v, args[0], name) for v in items if v != "")
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        kind = getattr(annotation, "__name__", str(annotation))
        article = "an" if kind[:1] in "aeiou" else "a"
        raise ConfigError(name, f"expected {kind}, got {value!r}", f"give {article} {kind} value") from None
    return value


def _build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if (section, key) == ("pipeline", "stage") and isinstance(value, str) and value.strip().lower() == "auto":
            value = None
        if (section, key) in NONE_IS_A_VALUE and isinstance(value, str) and value.strip().lower() == "none":
            kwargs[key] = "none"  # the lossless codec, not "unset" (which falls back to another codec field)
            continue
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.within(section) from None


def _refuse_unknown_names(values: Mapping[str, Any]) -> None:
    """One error naming every unknown section and field at once: a file with several typos was
    otherwise fixed one run at a time. The first one gets the full list of valid names."""
    unknown: list[tuple[str, str, str]] = []  # (name, problem, fix)
    for section, content in values.items():
        if section not in SECTIONS:
            fix = f"{_suggest(section, list(SECTIONS))}sections: {', '.join(SECTIONS)}"
            unknown.append((section, "unknown section", fix))
            continue
        hints = list(typing.get_type_hints(SECTIONS[section]))
        for key in content:
            if key not in hints:
                unknown.append(
                    (f"{section}.{key}", "unknown field", f"{_suggest(key, hints)}valid fields: {', '.join(hints)}")
                )
    if not unknown:
        return
    (name, problem, fix), rest = unknown[0], unknown[1:]
    if rest:
        problem += f" (and {len(rest)} more unknown: {', '.join(repr(n) for n, _, _ in rest)})"
        hints = [f"'{n}': {f.split('? ')[0]}?" for n, _, f in rest if f.startswith("did you mean")]
        fix += "".join(f"; {h}" for h in hints)
    raise ConfigError(name, problem, fix)


def build_config(values: Mapping[str, Mapping[str, Any]] | None = None) -> NodeConfig:
    """NodeConfig from nested {section: {field: value}}; values may be strings (from flags)."""
    values = values or {}
    sections = {}
    for section, content in values.items():
        if section in SECTIONS and not isinstance(content, Mapping):
            raise ConfigError(
                section, f"expected a table, got {content!r}", f"write it as [{section}] with fields below"
            )
    _refuse_unknown_names(values)
    for section, cls in SECTIONS.items():
        sections[section] = _build_section(section, cls, values.get(section, {}))
    return NodeConfig(**sections)


def parse_overrides(pairs: list[str]) -> dict[str, dict[str, str]]:
    """['outer.alpha=0.5', ...] -> {'outer': {'alpha': '0.5'}}."""
    nested: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(
                key or pair, f"override {pair!r} is not section.field=value", "write e.g. --set outer.alpha=0.5"
            )
        nested.setdefault(section, {})[name] = value.strip()
    return nested


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | Mapping[str, Mapping[str, Any]] = (),
    *,
    base: Mapping[str, Mapping[str, Any]] | None = None,
) -> NodeConfig:
    """Defaults, then `base` (a command's own defaults), then the TOML file at `path`, then
    `overrides` (flags win)."""
    values: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (base or {}).items()}
    if path is not None:
        try:
            with open(path, "rb") as f:
                for section, content in tomllib.load(f).items():
                    if isinstance(content, dict) and isinstance(values.get(section), dict):
                        values[section].update(content)
                    else:
                        values[section] = content
        except FileNotFoundError:
            raise ConfigError(
                "--config", f"no such file {str(path)!r}", "pass the path of an existing TOML file"
            ) from None
        except IsADirectoryError:
            raise ConfigError(
                "--config",
                f"{str(path)!r} is a directory",
                "pass the path of a TOML file in it, e.g. deploy/node.example.toml",
            ) from None
        except PermissionError:
            raise ConfigError(
                "--config", f"{str(path)!r} cannot be read (permission denied)", "make it readable by this user"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                "--config",
                f"{path} is not UTF-8 text (byte {exc.start})",
                "save it as UTF-8 TOML (a binary file or another encoding was given)",
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                "--config", f"{path} is not valid TOML ({exc})", "fix the TOML syntax at that line"
            ) from None
    extra = overrides if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    for section, content in extra.items():
        base = values.setdefault(section, {})
        if isinstance(base, dict):
            base.update(content)
    return build_config(values)
