"""A real S3 server on loopback for tests (moto's server, not a mocked client), and a pyarrow
client of it."""
from __future__ import annotations

import socket
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_server() -> Iterator[tuple[object, int]]:
    """(the server, its port), stopped when the generator is closed: a test module's fixture is
    `yield from moto_server()`."""
    from moto.server import ThreadedMotoServer
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield server, port
    finally:
        try:
            server.stop()
        except Exception:
            pass


def s3fs(port: int):
    import pyarrow.fs as pafs
    return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="test",
                             secret_key="test", region="us-east-1", allow_bucket_creation=True)


def store_extra(port: int) -> str:
    """The `[store]` keys of a mount of this server (after `uri`)."""
    return (f'endpoint_override = "127.0.0.1:{port}"\nscheme = "http"\nregion = "us-east-1"\n'
            f'access_key = "test"\nsecret_key = "test"\nconnect_timeout_s = 1\nrequest_timeout_s = 3\n')
