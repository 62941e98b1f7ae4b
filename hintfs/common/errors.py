"""One error type for hintfs: an errno the kernel or a client understands, and a one-line reason."""
from __future__ import annotations

import errno


class HintfsError(OSError):
    """Raised by hintfs itself with an explicit errno and reason (`err.errno`, `err.strerror`)."""

    def __init__(self, code: int, reason: str):
        super().__init__(code, reason)

    @property
    def errname(self) -> str:
        return errno.errorcode.get(self.errno or errno.EIO, "EIO")


def validation_message(err, *, prefix: str = "", root: str = "(document)", first_only: bool = False,
                       skip_loc: int = 0) -> str:
    """One line for a pydantic ValidationError: `key: reason` per error ('; '-joined), the key
    dotted and prefixed (`root` when it is empty), 'unknown key' for extra keys. `skip_loc`: leave
    out the first parts of each key (a tagged union's tag). The one formatter of every schema and
    message. Nothing of the input is kept (a refused 40 MiB request must not stay referenced)."""
    parts = []
    errors = err.errors(include_url=False, include_input=False, include_context=False)
    for e in errors[:1] if first_only else errors:
        key = ".".join(str(p) for p in e["loc"][skip_loc:])
        key = prefix + key if key else (prefix.rstrip(".") or root)
        msg = "unknown key" if e["type"] == "extra_forbidden" else str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{key}: {msg}".replace("\n", " "))
    return "; ".join(parts)
