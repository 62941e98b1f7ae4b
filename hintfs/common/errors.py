"""One error type for hintfs: an errno the kernel or a client understands, and a one-line reason."""
from __future__ import annotations

import difflib
import errno
import typing


class HintfsError(OSError):
    """Raised by hintfs itself with an explicit errno and reason (`err.errno`, `err.strerror`)."""

    def __init__(self, code: int, reason: str):
        super().__init__(code, reason)

    @property
    def errname(self) -> str:
        return errno.errorcode.get(self.errno or errno.EIO, "EIO")


def _schema_of(tp):
    """The pydantic model in the type `tp` (itself, or inside `X | None`, `list[X]`, ...), or None."""
    if isinstance(tp, type) and hasattr(tp, "model_fields"):
        return tp
    for arg in typing.get_args(tp):
        found = _schema_of(arg)
        if found is not None:
            return found
    return None


def _did_you_mean(model, loc: tuple) -> str:
    """' (did you mean X?)' for the unknown key at `loc` of `model`, when a known key of its table is
    close enough to be the one meant (difflib); else ''."""
    table = model
    for part in loc[:-1]:
        if isinstance(part, int):          # a list's item: `table` is already the item's model
            continue
        fields = getattr(table, "model_fields", {})
        if part not in fields:
            return ""
        table = _schema_of(fields[part].annotation)
    known = list(getattr(table, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
    return f" (did you mean {close[0]}?)" if close else ""


def validation_message(err, *, prefix: str = "", root: str = "(document)", first_only: bool = False,
                       skip_loc: int = 0, model=None) -> str:
    """One line for a pydantic ValidationError: `key: reason` per error ('; '-joined), the key
    dotted and prefixed (`root` when it is empty), 'unknown key' for extra keys, with the nearest
    known key of the pydantic `model` that was validated when one is close (`store.urii: unknown
    key (did you mean uri?)`). `skip_loc`: leave out the first parts of each key (a tagged union's
    tag). The one formatter of every schema and message. Nothing of the input is kept (a refused
    40 MiB request must not stay referenced)."""
    parts = []
    errors = err.errors(include_url=False, include_input=False, include_context=False)
    for e in errors[:1] if first_only else errors:
        key = ".".join(str(p) for p in e["loc"][skip_loc:])
        key = prefix + key if key else (prefix.rstrip(".") or root)
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + (_did_you_mean(model, tuple(e["loc"])) if model is not None else "")
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{key}: {msg}".replace("\n", " "))
    return "; ".join(parts)
