"""Bounds checked on JSON text before `json.loads` reads it (whose recursion a deep document
would exhaust): the one scanner of brackets outside strings, for every input parsed from outside
(control documents, governor messages, journal records)."""
from __future__ import annotations


def nests_within(text: str, limit: int, *, arrays: bool = True) -> bool:
    """Whether the JSON text nests at most `limit` deep (brackets outside strings); with
    `arrays` False, whether it also has no array at all."""
    depth = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            if ch == "[" and not arrays:
                return False
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True
