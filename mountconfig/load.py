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
        reason = validation_message(err, root="(top level)", model=MountConfig)
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
    cfg = parse_config(data, str(path))
    store = data.get("store")
    if not isinstance(store, dict) or "uri" not in store:
        # The schema's default store (file:///srv/data) is for configs built in code: a file that
        # names no store is a mistake (an empty file, a wrong file), never a mount of /srv/data.
        raise ConfigError(f"{path}: store.uri is not set: name the store in a [store] table, e.g. "
                          '[store] uri = "file:///srv/data" or "s3://bucket/prefix" (docs/config.md)')
    return cfg


def allow_nonempty(cfg: MountConfig) -> MountConfig:
    """`cfg` with `[mount] nonempty = true` (`hintfs mount --nonempty`)."""
    return cfg.model_copy(update={"mount": cfg.mount.model_copy(update={"nonempty": True})})


def effective_config_json(cfg: MountConfig) -> bytes:
    """The config with every default filled in, secrets masked: what `.hintfs/config` shows."""
    data = cfg.model_dump(mode="json")
    store = data.get("store", {})
    if store.get("secret_key"):
        store["secret_key"] = "***"
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
