"""A config's values as TOML that `--config` reads back to the same config (the standard library
reads TOML but does not write it). Written for the plain values config sections hold: strings,
numbers, booleans and lists of them; a None is left out (the field's default)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def to_toml(sections: Mapping[str, Mapping[str, Any]], *, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for section, fields in sections.items():
        lines += ["", f"[{section}]"]
        lines += [f"{name} = {_value(value)}" for name, value in fields.items() if value is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__} {value!r}")
