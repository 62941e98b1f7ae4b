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


def validation_message(err, *, prefix: str = "", root: str = "(document)", first_only: bool = False) -> str:
    """One line for a pydantic ValidationError: `key: reason` per error ('; '-joined), the key
    dotted and prefixed, 'unknown key' for extra keys. The one formatter of every schema."""
    parts = []
    for e in err.errors()[:1] if first_only else err.errors():
        key = ".".join(str(p) for p in e["loc"])
        key = prefix + key if key else (prefix.rstrip(".") or root)
        msg = "unknown key" if e["type"] == "extra_forbidden" else str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{key}: {msg}".replace("\n", " "))
    return "; ".join(parts)
