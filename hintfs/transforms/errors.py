"""The one exception the transforms raise for bad media or impossible parameters."""
from __future__ import annotations


class TransformError(ValueError):
    """Corrupt, truncated or unsupported media, or parameters that cannot apply to it."""


class SampleEIO(OSError, TransformError):
    """What ``load_sample`` raises when the local transform of a raw-mode `.tensor` fails: an
    ``OSError`` with ``errno.EIO`` (as the open of a tensor-mode file the agent refused would
    be) that is still a ``TransformError``. A corrupt source is EIO whichever mode serves it."""


class TransformTimeout(TransformError):
    """A sample ran over its ``time_limit_s`` (its worker was killed). May pass on a less busy
    machine, so the agent remembers it for a short while only."""


class WorkerDied(TransformError):
    """The worker process making a sample died twice (a crash, the OOM killer, SIGKILL)."""
