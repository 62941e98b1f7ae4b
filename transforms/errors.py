"""The one exception the transforms raise for bad media or impossible parameters."""
from __future__ import annotations


class TransformError(ValueError):
    """Corrupt, truncated or unsupported media, or parameters that cannot apply to it."""
