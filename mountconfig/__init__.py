from .load import ConfigError, effective_config_json, load_config, parse_config
from .schema import MountConfig

__all__ = ["ConfigError", "MountConfig", "effective_config_json", "load_config", "parse_config"]
