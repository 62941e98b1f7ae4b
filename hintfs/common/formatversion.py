"""Where a format version stands against the versions a reader reads (docs/versions.md): the one
check behind every format's refusal line (agent RPC, fd socket, journal records, stream wire,
governor protocol, agent data, host-cache entries, control documents). Each format words its own
line: which side to upgrade depends on who writes and who reads it."""
from __future__ import annotations


def placed(version: object, reads: tuple[int, int]) -> str | None:
    """None: `version` is read (lo <= version <= hi); else "newer" or "older" than `reads`, or
    "unreadable" (not an int: a bool or a string is no version)."""
    if type(version) is not int:
        return "unreadable"
    lo, hi = reads
    return "newer" if version > hi else "older" if version < lo else None
