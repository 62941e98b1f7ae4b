"""The whole-object GET of a small S3 object (hintfs.stores.s3get, issue 39) answers the same
through libcurl (pycurl, the default) and through http.client (its fallback): against a loopback
server that answers what a test asks, including what a hostile or broken server would send."""
from __future__ import annotations

import http.server
import socket
import threading
from contextlib import contextmanager

import pytest

from hintfs.stores import s3get
from hintfs.stores.s3get import S3Getter, _header_fields

LAST_MODIFIED = "Sat, 05 Dec 2026 13:00:00 GMT"
MTIME_NS = 1796475600 * 1_000_000_000


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):   # noqa: N802 (http.server's name)
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()} | {"path": self.path})
        status, headers, body = self.server.answer
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def _server(answer):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen, srv.answer = [], answer
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def _getter(port: int, curl: bool, timeout_s: float = 5.0) -> S3Getter:
    g = S3Getter(bucket="b", access_key="AK", secret_key="SK", region="us-east-1", scheme="http",
                 endpoint=f"127.0.0.1:{port}", timeout_s=timeout_s)
    g.use_curl = curl
    return g


WAYS = [pytest.param(True, id="libcurl"), pytest.param(False, id="http.client")]


@pytest.fixture(autouse=True)
def _needs_pycurl(request):
    if "libcurl" in request.node.name and s3get.pycurl is None:
        pytest.fail("pycurl is a dependency (pyproject.toml): not installed")


@pytest.mark.parametrize("curl", WAYS)
def test_a_small_object_comes_whole_with_its_version_and_the_signed_host(curl):
    body = b"x" * 5000
    answer = (206, {"Content-Range": "bytes 0-4999/5000", "ETag": '"abc"', "Last-Modified": LAST_MODIFIED}, body)
    with _server(answer) as srv:
        g = _getter(srv.server_address[1], curl)
        got = g.get_whole("d/s p+c.bin", 64 << 10)
        assert got is not None and (got.data, got.size, got.etag, got.mtime_ns) == (body, 5000, '"abc"', MTIME_NS)
        again = g.get_whole("d/s p+c.bin", 64 << 10)     # (the kept-alive connection again)
        assert again is not None and again.data == body
    req = srv.seen[0]
    assert req["path"] == "/b/d/s%20p%2Bc.bin" and req["range"] == f"bytes=0-{(64 << 10) - 1}"
    assert req["host"] == g.host and req["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AK/")
    assert "x-amz-date" in req and "x-amz-content-sha256" in req


@pytest.mark.parametrize("curl", WAYS)
@pytest.mark.parametrize("answer", [
    pytest.param((200, {"ETag": '"a"', "Last-Modified": LAST_MODIFIED}, b"y" * (80 << 10)), id="range-ignored-too-large"),
    pytest.param((206, {"Content-Range": "bytes 0-9/100", "ETag": '"a"', "Last-Modified": LAST_MODIFIED}, b"z" * 10),
                 id="only-part-of-it"),
    pytest.param((404, {}, b"<Error><Code>NoSuchKey</Code></Error>"), id="not-found"),
    pytest.param((206, {"Content-Range": "bytes 0-9/10", "Last-Modified": LAST_MODIFIED}, b"z" * 10), id="no-etag"),
    pytest.param((206, {"Content-Range": "bytes 0-9/10", "ETag": '"a"', "Last-Modified": "yesterday"}, b"z" * 10),
                 id="bad-date"),
])
def test_what_is_not_a_whole_small_object_is_none_for_pyarrow_to_open(curl, answer):
    with _server(answer) as srv:
        assert _getter(srv.server_address[1], curl).get_whole("k", 64 << 10) is None


@pytest.mark.parametrize("curl", WAYS)
def test_a_server_that_never_answers_is_a_timeout(curl):
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)          # (accepted by the kernel, never read, never answered)
    try:
        with pytest.raises(TimeoutError):
            _getter(lsock.getsockname()[1], curl, timeout_s=0.3).get_whole("k", 1024)
    finally:
        lsock.close()


def test_a_proxy_in_the_environment_is_not_used(monkeypatch):
    """As http.client and pyarrow's SDK: the store's endpoint is asked directly, never through
    `http_proxy` (which would see the signed requests)."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    answer = (206, {"Content-Range": "bytes 0-2/3", "ETag": '"a"', "Last-Modified": LAST_MODIFIED}, b"abc")
    with _server(answer) as srv:
        got = _getter(srv.server_address[1], True).get_whole("k", 1024)
    assert got is not None and got.data == b"abc"


def test_header_lines_of_the_last_response_are_read():
    lines = [b"HTTP/1.1 100 Continue\r\n", b"ETag: old\r\n", b"\r\n", b"HTTP/1.1 206 Partial Content\r\n",
             b"Content-Range: bytes 0-2/3\r\n", b"etag:  \"v\" \r\n", b"X-Twice: 1\r\n", b"x-twice: 2\r\n", b"\r\n"]
    assert _header_fields(lines) == {"content-range": "bytes 0-2/3", "etag": '"v"', "x-twice": "2"}


@contextmanager
def _raw_server(response: bytes):
    """A server that answers each connection's first request with `response`, byte for byte."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    lsock.settimeout(0.1)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    conn.sendall(response)
                except OSError:
                    pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        lsock.close()


@pytest.mark.parametrize("curl", WAYS)
def test_a_garbled_answer_is_none_not_an_error(curl, caplog):
    """What a broken or hostile server sends (a length that is no number, no HTTP at all) is no
    object: None, for pyarrow to open; libcurl's failures are logged once per kind, not per open."""
    garbled = (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-2/3\r\nETag: \"a\"\r\n"
               b"Last-Modified: " + LAST_MODIFIED.encode() + b"\r\nContent-Length: 3x\r\n\r\nabc")
    with _raw_server(garbled) as port:
        assert _getter(port, curl).get_whole("k", 1024) is None
    def logged() -> int:
        return len([r for r in caplog.records if "libcurl failed" in r.getMessage()])
    before = logged()
    with _raw_server(b"SSH-2.0-OpenSSH_9.2\r\n") as port:
        g = _getter(port, curl)
        assert g.get_whole("k", 1024) is None
        first = logged()
        assert g.get_whole("k", 1024) is None and g.get_whole("k", 1024) is None
    assert logged() == first == before + (1 if curl else 0)


@pytest.mark.parametrize("curl", WAYS)
def test_https_trusts_the_ca_bundle_of_the_environment_and_nothing_else(curl, tmp_path, monkeypatch):
    """An S3 endpoint over TLS: its certificate is checked against `AWS_CA_BUNDLE` (as pyarrow's
    SDK does); signed by a CA not in the bundle, the GET is refused (None: pyarrow then refuses
    it too), never sent in the clear or unchecked."""
    import ssl

    from tests.helpers.certs import make_ca
    ca, other = make_ca(tmp_path / "ca"), make_ca(tmp_path / "other", "another CA")
    cert, key = ca.host(tmp_path / "host", "127.0.0.1")
    answer = (206, {"Content-Range": "bytes 0-2/3", "ETag": '"a"', "Last-Modified": LAST_MODIFIED}, b"abc")
    with _server(answer) as srv:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        port = srv.server_address[1]
        for bundle, ok in ((ca.pem, True), (other.pem, False)):
            monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
            g = S3Getter(bucket="b", access_key="AK", secret_key="SK", region="us-east-1", scheme="https",
                         endpoint=f"127.0.0.1:{port}", timeout_s=5.0)
            g.use_curl = curl
            got = g.get_whole("k", 1024)
            assert (got is not None and got.data == b"abc") if ok else got is None, (bundle, got)
    assert len(srv.seen) == 1      # (the refused handshake sent no request)
