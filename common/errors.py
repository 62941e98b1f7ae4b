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
