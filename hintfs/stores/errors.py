"""Map store failures to errno values, so every dependency failure becomes a clear errno
(hintfs's own errors are `hintfs.common.errors.HintfsError`, which carry theirs)."""
from __future__ import annotations

import errno
import logging
import re

log = logging.getLogger("hintfs.errors")

# pyarrow's remote filesystems raise plain OSError with the service's message in the text.
_TEXT_PATTERNS = [
    (re.compile(r"NoSuchKey|NoSuchBucket|not found|does not exist|\b404\b", re.I), errno.ENOENT),
    (re.compile(r"ACCESS_DENIED|AccessDenied|Forbidden|\b403\b|permission denied", re.I), errno.EACCES),
    (re.compile(r"No space|ENOSPC|QuotaExceeded|EntityTooLarge", re.I), errno.ENOSPC),
    (re.compile(r"not empty|ENOTEMPTY", re.I), errno.ENOTEMPTY),
    (re.compile(r"already exists|EEXIST", re.I), errno.EEXIST),
]


def errno_of(exc: BaseException) -> int:
    """The errno a store exception should surface as; EIO when nothing more specific is known."""
    if isinstance(exc, FileNotFoundError):
        return errno.ENOENT
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, FileExistsError):
        return errno.EEXIST
    if isinstance(exc, IsADirectoryError):
        return errno.EISDIR
    if isinstance(exc, NotADirectoryError):
        return errno.ENOTDIR
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    text = str(exc)
    for pattern, code in _TEXT_PATTERNS:
        if pattern.search(text):
            return code
    return errno.EIO
