"""Path rules: names from the kernel are checked here so nothing can address outside the store."""
from __future__ import annotations

import errno
import posixpath

from .errors import StoreError
from .store import STAGING_PREFIX

CONTROL_DIR = ".hintfs"


def child(parent: str, name: bytes) -> str:
    """The store-relative path of `name` inside `parent`; refuses names that could escape."""
    try:
        text = name.decode("utf-8", "surrogateescape")
    except Exception:  # pragma: no cover - surrogateescape never fails
        raise StoreError(errno.EINVAL, "undecodable name")
    if text in ("", ".", "..") or "/" in text or "\0" in text:
        raise StoreError(errno.EINVAL, f"invalid name {text!r}")
    return f"{parent}/{text}" if parent else text


def is_hidden_name(name: str) -> bool:
    """Names the mount never shows: staging files of writes in progress."""
    return name.startswith(STAGING_PREFIX)


def symlink_target_ok(link_rel: str, target: str) -> bool:
    """A symlink may only point inside the store: relative, and never climbing above the root."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    base = posixpath.dirname(link_rel)
    resolved = posixpath.normpath(posixpath.join("/", base, target))
    # normpath of "/.." is "/", so also count the climb explicitly.
    depth = 0
    for part in posixpath.join(base, target).split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return resolved.startswith("/")
