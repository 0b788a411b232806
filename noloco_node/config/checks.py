"""How a config section refuses a value: the error names the dotted field and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value. `field` is dotted (`outer.alpha`); the message includes the fix."""

    def __init__(self, field_name: str, problem: str, fix: str) -> None:
        self.field, self.problem, self.fix = field_name, problem, fix
        # A flag (--port) or a positional argument (MODEL_DIR, as --help names it) is no config field.
        what = "flag" if field_name.startswith("-") else "argument" if field_name.isupper() else "config field"
        super().__init__(f"{what} '{field_name}': {problem}. Fix: {fix}")

    def within(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.field}", self.problem, self.fix)


def _require(ok: bool, name: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(name, problem, fix)
