"""Loading a mount config file and turning validation errors into one readable line each."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import ValidationError

from hintfs.common.errors import validation_message

from .schema import MountConfig


class ConfigError(Exception):
    """A user mistake in the config: the message names the key and what is wrong."""


def parse_config(data: dict, source: str = "config") -> MountConfig:
    try:
        return MountConfig.model_validate(data)
    except ValidationError as err:
        reason = validation_message(err, root="(top level)")
        raise ConfigError(f"{source}: {reason}") from None


def load_config(path: str | Path) -> MountConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse_config(data, str(path))


def effective_config_json(cfg: MountConfig) -> bytes:
    """The config with every default filled in, secrets masked: what `.hintfs/config` shows."""
    data = cfg.model_dump(mode="json")
    store = data.get("store", {})
    if store.get("secret_key"):
        store["secret_key"] = "***"
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
