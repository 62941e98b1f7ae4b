"""Store faults under an S3 mount (issue 35, part 3), against a real S3 server on loopback (JuiceFS's
S3 gateway) behind a fault proxy: connections reset mid-request, a server that accepts and never
answers, the server killed mid-multipart-upload and mid-listing. The rule checked every time (the
publish rule, docs/semantics.md): a close either succeeds and the store has the whole new file, or
fails with EIO and the store keeps the previous version; no operation waits past the store's
timeouts (plus the SDK's retries: the bounds here are loose, the point is "never hangs")."""
from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest

from tests.conftest import needs_fuse, wait_for
from tests.helpers.s3 import s3_server as _s3_server
from tests.helpers.s3 import s3fs, store_extra

pytestmark = needs_fuse

BUCKET = "faults"
MiB = 1 << 20
TIMEOUTS = "connect_timeout_s = 1\nrequest_timeout_s = 3\n"


class FaultProxy:
    """A TCP proxy on loopback in front of the S3 server. `reset_after`: the next `resets`
    connections to carry that many request bytes are reset (RST) there; a connection that never
    carries that much (a HEAD, a listing) takes none of them, so which of the client's pooled
    connections an upload uses does not decide whether the fault happens; `blackhole`: new
    connections are accepted and read, never answered. Threads stop at `close()`."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.reset_after = 0
        self.resets = 0
        self.blackhole = False
        self.sent = 0                 # request bytes forwarded, all connections
        self.reset_done = 0
        self.closed = False
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(client)
                hole = self.blackhole
            threading.Thread(target=self._serve, args=(client, hole), daemon=True).start()

    def _take_reset(self, carried: int) -> bool:
        """Whether a connection that has now carried `carried` request bytes is to be reset."""
        with self.lock:
            if self.resets > 0 and self.reset_after and carried >= self.reset_after:
                self.resets -= 1
                self.reset_done += 1
                return True
        return False

    def _serve(self, client: socket.socket, hole: bool) -> None:
        if hole:
            try:
                while not self.closed and client.recv(65536):
                    pass
            except OSError:
                pass
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        with self.lock:
            self.conns.append(upstream)
        carried = [0]

        def pump(src: socket.socket, dst: socket.socket, request: bool) -> None:
            try:
                while not self.closed:
                    data = src.recv(65536)
                    if not data:
                        break
                    if request:
                        carried[0] += len(data)
                        with self.lock:
                            self.sent += len(data)
                        if self._take_reset(carried[0]):
                            for s in (client, upstream):   # RST both ways
                                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                                s.close()
                            return
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)

    def drop_connections(self) -> None:
        """Close every connection made so far (the client's pool must connect again)."""
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        self.drop_connections()


@pytest.fixture
def s3_server(tmp_path):
    yield from _s3_server(tmp_path / "s3")


@pytest.fixture
def faulty(s3_server, mount_factory, tmp_path):
    yield from _faulty(s3_server, mount_factory, tmp_path, TIMEOUTS)


@pytest.fixture
def faulty_short(s3_server, mount_factory, tmp_path):
    """Shorter timeouts: a server that never answers costs each request `request_timeout_s`."""
    yield from _faulty(s3_server, mount_factory, tmp_path, "connect_timeout_s = 1\nrequest_timeout_s = 1\n")


def _faulty(s3_server, mount_factory, tmp_path, timeouts: str):
    fs = s3fs(s3_server)
    fs.create_dir(BUCKET)
    proxy = FaultProxy(s3_server.port)
    keys = store_extra(s3_server).replace(s3_server.endpoint, proxy.endpoint)
    keys = "\n".join(line for line in keys.splitlines() if "timeout_s" not in line) + "\n" + timeouts
    m = mount_factory(extra=f'\n[cache]\nspool_dir = "{tmp_path / "spool"}"\n', store_uri=f"s3://{BUCKET}",
                      store_extra=keys)
    try:
        yield m, fs, proxy, s3_server
    finally:
        proxy.close()


def _get(fs, rel: str) -> bytes | None:
    import pyarrow.fs as pafs
    if fs.get_file_info(f"{BUCKET}/{rel}").type != pafs.FileType.File:
        return None
    with fs.open_input_stream(f"{BUCKET}/{rel}") as f:
        return f.read()


def _put(fs, rel: str, data: bytes) -> None:
    with fs.open_output_stream(f"{BUCKET}/{rel}") as f:
        f.write(data)


def _write(path, data: bytes) -> OSError | None:
    """Write `data` to `path` through the mount and close it: the error close() raised, or None."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as err:
        return err
    try:
        os.write(fd, data)
    except OSError as err:
        os.close(fd)
        return err
    try:
        os.close(fd)
    except OSError as err:
        return err
    return None


def _whole_or_previous(fs, rel: str, err: OSError | None, new: bytes, previous: bytes | None) -> None:
    got = _get(fs, rel)
    if err is None:
        assert got == new, f"close() returned 0 but the store has {None if got is None else len(got)} bytes"
    else:
        # EACCES is what the store said: a gateway being stopped or started has answered a part
        # upload with AccessDenied (seen once under a load of 10); the store's word is passed on
        # (docs/semantics.md), and the previous version stays either way
        assert err.errno in (errno.EIO, errno.ENOSPC, errno.EACCES), err
        assert got == previous, "a failed close changed the store's file"


@pytest.mark.parametrize("reset_after,resets", [(64 << 10, 1), (3 * MiB, 2), (64 << 10, 50)])
def test_connections_reset_mid_upload_publish_whole_or_fail_and_keep_the_previous(faulty, reset_after, resets):
    m, fs, proxy, _server = faulty
    previous = os.urandom(3 * MiB + 5)
    _put(fs, "f.bin", previous)
    new = os.urandom(20 * MiB + 11)           # several parts (multipart upload)
    proxy.reset_after, proxy.resets = reset_after, resets
    proxy.drop_connections()          # (the upload then makes new connections, which the faults hit)
    t0 = time.monotonic()
    err = _write(m.mnt / "f.bin", new)
    took = time.monotonic() - t0
    assert proxy.reset_done >= 1, "no connection was reset: the fault did not happen"
    _whole_or_previous(fs, "f.bin", err, new, previous)
    assert took < 120, f"the close took {took:.0f} s"
    # The daemon keeps serving once the faults stop.
    proxy.resets = 0
    assert _write(m.mnt / "after.bin", b"ok") is None and _get(fs, "after.bin") == b"ok"


def test_a_server_that_never_answers_fails_operations_within_the_timeouts(faulty_short):
    m, fs, proxy, _server = faulty_short
    _put(fs, "old.bin", b"previous")
    proxy.blackhole = True
    proxy.drop_connections()
    t0 = time.monotonic()
    err = _write(m.mnt / "old.bin", b"new bytes")
    took = time.monotonic() - t0
    assert err is not None and err.errno in (errno.EIO, errno.ENOENT, errno.ETIMEDOUT), err
    assert took < 120, f"the operations waited {took:.0f} s"
    proxy.blackhole = False
    assert _get(fs, "old.bin") == b"previous"
    assert wait_for(lambda: _write(m.mnt / "later.bin", b"x") is None, timeout=60)


def test_the_server_killed_mid_multipart_upload_and_restarted(faulty):
    m, fs, proxy, server = faulty
    previous = os.urandom(MiB)
    _put(fs, "big.bin", previous)
    new = os.urandom(48 * MiB)
    result: dict = {}

    def writer() -> None:
        result["err"] = _write(m.mnt / "big.bin", new)

    start = proxy.sent
    t = threading.Thread(target=writer)
    t.start()
    # Kill the server once the upload is under way (some parts sent, not all).
    assert wait_for(lambda: proxy.sent - start > 12 * MiB or not t.is_alive(), timeout=60)
    killed = t.is_alive()
    server.stop(timeout_s=0.1)
    try:
        t.join(150)
        assert not t.is_alive(), "the close never returned with the server gone"
    finally:
        server.start()
    assert wait_for(lambda: _get(fs, "big.bin") is not None, timeout=30)
    _whole_or_previous(fs, "big.bin", result["err"], new, previous)
    if killed:
        assert result["err"] is not None or _get(fs, "big.bin") == new
    assert wait_for(lambda: _write(m.mnt / "again.bin", b"again") is None, timeout=60)
    assert _get(fs, "again.bin") == b"again"


def test_the_server_killed_mid_listing_and_restarted(faulty):
    m, fs, proxy, server = faulty
    n = 600
    for i in range(0, n, 100):
        threads = [threading.Thread(target=_put, args=(fs, f"many/f{j:05d}", b"x")) for j in range(i, i + 100)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    result: dict = {}

    def lister() -> None:
        try:
            result["names"] = os.listdir(m.mnt / "many")
        except OSError as err:
            result["err"] = err

    t = threading.Thread(target=lister)
    t.start()
    time.sleep(0.05)
    server.stop(timeout_s=0.1)
    try:
        t.join(150)
        assert not t.is_alive(), "the listing never returned with the server gone"
    finally:
        server.start()
    if "names" in result:
        assert len(result["names"]) == n      # a listing is whole or an error, never a part
    else:
        # EACCES: what the store said (the JuiceFS gateway, while it stops, has answered a page
        # of the listing with AccessDenied; the mount passes the store's errno on, as for uploads);
        # ENOTDIR: seen once in ~12 runs: the folder's stat while the gateway stopped came back
        # from pyarrow as a file's (which request answered so was not found)
        assert result["err"].errno in (errno.EIO, errno.ETIMEDOUT, errno.ENOENT, errno.EACCES, errno.ENOTDIR), \
            result["err"]
    assert wait_for(lambda: len(os.listdir(m.mnt / "many")) == n, timeout=60)
