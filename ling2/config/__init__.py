"""Ling2's typed config: schema, loader and derived values."""

from ling2.config.loader import ConfigError, load_config, parse_overrides, to_yaml
from ling2.config.schema import Config
from ling2.config.enums import ModelName

__all__ = ["Config", "ConfigError", "ModelName", "load_config", "parse_overrides", "to_yaml"]
