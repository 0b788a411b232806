"""One typed config per node: frozen dataclasses per section, from TOML, overridable by flags.

Sources, lowest to highest precedence: defaults, a TOML file (`--config node.toml`), then
`--set section.field=value` flags (and the CLI's shortcut flags, which become the same overrides).
Every error names the field and says how to fix it. Imports the standard library only, so
`noloco-node --help` stays instant.

`sections.py` holds the sections (fields, defaults, checks), `links.py` those of how a node talks
(network, security, timeouts), `pipeline.py` the pipeline's, `optimizers.py` the inner and outer
optimizers', `checks.py` the error they raise; `loading.py` builds a NodeConfig.
"""

from noloco_node.config.checks import ConfigError
from noloco_node.config.links import NetworkConfig, SecurityConfig, TimeoutsConfig
from noloco_node.config.loading import build_config, load_config, parse_overrides
from noloco_node.config.optimizers import METHOD_DEFAULTS, METHODS, InnerConfig, OuterConfig
from noloco_node.config.pipeline import PipelineConfig
from noloco_node.config.sections import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    FaultsConfig,
    LogConfig,
    ModelConfig,
    NodeConfig,
    RunConfig,
)

__all__ = [
    "METHOD_DEFAULTS",
    "METHODS",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "FaultsConfig",
    "InnerConfig",
    "LogConfig",
    "ModelConfig",
    "NetworkConfig",
    "NodeConfig",
    "OuterConfig",
    "PipelineConfig",
    "RunConfig",
    "SecurityConfig",
    "TimeoutsConfig",
    "build_config",
    "load_config",
    "parse_overrides",
]
