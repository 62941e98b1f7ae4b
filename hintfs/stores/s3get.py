"""One signed S3 GET that answers an open of a small object by itself (issue 39).

pyarrow opens an S3 object with a HEAD (size, Last-Modified, ETag) and reads it with a GET: two
requests, each a round trip and, on a server that shares the client's cores, CPU. A GET's own
response carries the same version (Content-Range's total size, Last-Modified, ETag) beside the
bytes, so an open of an object known to be small (a listing or a stat said so) asks for its first
`limit` bytes in one GET and gets the version and the whole object at once: the open's request
to the store is still made at the open (close-to-open is unchanged), one request instead of two.

`S3Getter` is that GET: SigV4-signed by hand (the standard library's hmac and http.client, one
kept-alive connection per thread), for stores with an explicit access key (the AWS default chain
of credentials, session tokens or instance roles, is pyarrow's alone: there the open is pyarrow's
HEAD and GET as before). Addressing: path style at `endpoint_override`; virtual-hosted style at
`s3.<region>.amazonaws.com` for a bucket without dots when no endpoint is given. Anything it
cannot answer (not found, an error, an object larger than `limit`) is `None`: the caller opens
the object through pyarrow as before.
"""
from __future__ import annotations

import datetime as dt
import email.utils
import hashlib
import hmac
import http.client
import os
import ssl
import threading
from urllib.parse import quote

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class Got:
    """An object read whole by one GET: its bytes and version."""
    __slots__ = ("data", "size", "mtime_ns", "etag")

    def __init__(self, data: bytes, size: int, mtime_ns: int, etag: str):
        self.data, self.size, self.mtime_ns, self.etag = data, size, mtime_ns, etag


class S3Getter:
    """Signed ranged GETs of one bucket (thread-safe: a connection per thread)."""

    def __init__(self, *, bucket: str, access_key: str, secret_key: str, region: str, scheme: str,
                 endpoint: str | None, timeout_s: float):
        self.bucket = bucket
        self._access, self._secret = access_key, secret_key
        self.region = region
        self.scheme = scheme
        self.timeout = timeout_s
        if endpoint:
            self.host, self._prefix = endpoint, f"/{bucket}"
        else:
            self.host, self._prefix = f"{bucket}.s3.{region}.amazonaws.com", ""
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None
        if scheme == "https":
            self._ssl = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        self._keys: tuple[str, bytes] | None = None   # (date, signing key of that day)

    @classmethod
    def of(cls, store_cfg, bucket: str) -> S3Getter | None:
        """The getter of an S3 store config, or None where it cannot sign (no explicit keys) or
        address (a bucket with dots on AWS, no region)."""
        if not store_cfg.access_key or not store_cfg.secret_key or not bucket:
            return None
        region = store_cfg.region or ("us-east-1" if store_cfg.endpoint_override else None)
        if region is None or (not store_cfg.endpoint_override and "." in bucket):
            return None
        return cls(bucket=bucket, access_key=store_cfg.access_key, secret_key=store_cfg.secret_key, region=region,
                   scheme=store_cfg.scheme, endpoint=store_cfg.endpoint_override, timeout_s=store_cfg.request_timeout_s)

    # -- signing -------------------------------------------------------------------------------
    def _signing_key(self, day: str) -> bytes:
        keys = self._keys
        if keys is not None and keys[0] == day:
            return keys[1]
        k = hmac.new(f"AWS4{self._secret}".encode(), day.encode(), hashlib.sha256).digest()
        for part in (self.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        self._keys = (day, k)
        return k

    def _headers(self, path: str, rng: str, now: dt.datetime) -> dict[str, str]:
        amz = now.strftime("%Y%m%dT%H%M%SZ")
        day = amz[:8]
        headers = {"host": self.host, "range": rng, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz}
        signed = ";".join(sorted(headers))
        canonical = "\n".join(["GET", path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed,
                               _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        sig = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self._access}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={sig}")
        return headers

    # -- the request ---------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(self.host, timeout=self.timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self.host, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def get_whole(self, key: str, limit: int) -> Got | None:
        """The object `key` (in the bucket) whole with its version, if it has 1..`limit` bytes;
        None for anything else (missing, larger, empty, an error: ask pyarrow). TimeoutError
        where the server does not answer within the request timeout."""
        try:
            path = self._prefix + "/" + quote(key, safe="/-_.~")
        except UnicodeEncodeError:   # (a name that is no UTF-8: pyarrow's to open)
            return None
        for attempt in range(2):   # (a kept-alive connection the server closed meanwhile: once more)
            try:
                conn = self._conn()
                conn.request("GET", path, headers=self._headers(path, f"bytes=0-{limit - 1}", dt.datetime.now(dt.UTC)))
                resp = conn.getresponse()
                length = int(resp.getheader("content-length", "-1"))
                total = _whole_size(resp.status, resp.getheader("content-range", ""), length)
                if total is None or not 0 < total <= limit:
                    # (an error's document, an object larger than asked for: never read into memory)
                    self._drop_conn()
                    return None
                body = resp.read()
            except TimeoutError:
                self._drop_conn()   # (the server does not answer: so says the open, no second wait)
                raise
            except (http.client.HTTPException, OSError, ValueError):
                self._drop_conn()
                if attempt:
                    return None
                continue
            break
        if resp.getheader("connection", "").lower() == "close":
            self._drop_conn()
        if len(body) != total:
            return None
        mtime = _http_date_ns(resp.getheader("last-modified"))
        etag = resp.getheader("etag")
        if mtime is None or not etag:
            return None
        return Got(body, total, mtime, etag)


def _whole_size(status: int, content_range: str, length: int) -> int | None:
    """The object's size where the response holds all of it (206 `bytes 0-N/TOTAL` with N + 1 =
    TOTAL, or 200 from a server that ignores Range), else None."""
    if status == 200:
        return length
    if status != 206:
        return None
    try:
        span, total_s = content_range.split(" ", 1)[1].split("/", 1)
        first, last = (int(x) for x in span.split("-", 1))
        total = int(total_s)
    except (IndexError, ValueError):
        return None
    return total if first == 0 and last + 1 == total == length else None


def _http_date_ns(raw: str | None) -> int | None:
    """Last-Modified of a response (`Sat, 05 Dec 2026 13:00:00 GMT`, whole seconds) in ns."""
    if not raw:
        return None
    try:
        return int(email.utils.parsedate_to_datetime(raw).timestamp()) * 1_000_000_000
    except (TypeError, ValueError):
        return None


__all__ = ["Got", "S3Getter"]
