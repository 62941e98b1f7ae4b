"""Signed S3 requests pyarrow cannot make: one GET that answers an open of a small object by
itself (issue 39), and a listing of the names after a given one (issue 37).

pyarrow opens an S3 object with a HEAD (size, Last-Modified, ETag) and reads it with a GET: two
requests, each a round trip and, on a server that shares the client's cores, CPU. A GET's own
response carries the same version (Content-Range's total size, Last-Modified, ETag) beside the
bytes, so an open of an object known to be small (a listing or a stat said so) asks for its first
`limit` bytes in one GET and gets the version and the whole object at once: the open's request
to the store is still made at the open (close-to-open is unchanged), one request instead of two.

`S3Getter` is that GET: SigV4-signed by hand (the standard library's hmac; one kept-alive
connection per thread), for stores with an explicit access key (the AWS default chain
of credentials, session tokens or instance roles, is pyarrow's alone: there the open is pyarrow's
HEAD and GET as before). Addressing: path style at `endpoint_override`; virtual-hosted style at
`s3.<region>.amazonaws.com` for a bucket without dots when no endpoint is given. Anything it
cannot answer (not found, an error, an object larger than `limit`) is `None`: the caller opens
the object through pyarrow as before.

The whole-object GET goes through libcurl (`pycurl`) where it is installed: the request, the
response's headers and its body are read in C with the interpreter's lock released, and the only
Python calls are one `list.append` per header line and one `BytesIO.write` per body chunk. A
mount reading thousands of small objects is bound by that lock (one core), and http.client spends
~3x as much of it per GET (its status line, headers and body are read by Python code, the headers
parsed by `email`): bench/notes/s3_cold.md. Without pycurl, http.client does it as before.

`S3Getter.get_range_into` is a ranged GET of one version (`If-Match`) whose body goes from the
socket straight into the caller's buffer: the host cache's fetch reads each block into its mapping
of the cache file (no copy through pyarrow's buffers, no `pwrite`; docs/hostcache.md).

`S3Getter.list_after` is a ListObjectsV2 with `start-after`: the entries of one folder whose names
sort after a given name. pyarrow lists a folder whole; the journal's readers (`journal.SliceListings`)
list the same time slice many times a second, and a slice of a busy journal is thousands of
names: listed whole, only the listings' budget (256 KB/s) bounded their bytes; listed from the
newest record they were 2.5% of the bytes written (bench/scale_xdc.py). The response is a server's document: bounded in size per page
(LIST_PAGE_BYTES) and in pages, parsed by the standard library's expat (which refuses entity
expansion bombs and never fetches external entities); keys come URL-encoded (`encoding-type=url`:
a key with characters XML 1.0 cannot carry is still a key), must lie in the folder asked for, and
anything unexpected makes the answer None (the caller lists through pyarrow as before).
"""
from __future__ import annotations

import datetime as dt
import email.utils
import hashlib
import hmac
import http.client
import logging
import os
import ssl
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from io import BytesIO
from urllib.parse import quote, unquote_plus

try:   # (libcurl: the small objects' GETs off the interpreter's lock; optional, see above)
    import pycurl
except ImportError:   # pragma: no cover - pycurl is a dependency; http.client is the fallback
    pycurl = None

log = logging.getLogger("hintfs.s3get")
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
LIST_PAGE_KEYS = 1000              # entries a listing page asks for (S3's own most)
LIST_PAGE_BYTES = 4 << 20          # a page's response larger than this is not read
LIST_MAX_PAGES = 100               # a listing of more pages is pyarrow's (the caller's fallback)


def _q(value: str) -> str:
    """SigV4's URI encoding of a query parameter (every byte but A-Z a-z 0-9 - _ . ~)."""
    return quote(value, safe="-_.~")


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
        self.use_curl = pycurl is not None
        self._curl_errors_logged: set[int] = set()

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

    def _headers(self, path: str, rng: str | None, now: dt.datetime, query: str = "",
                 extra: dict[str, str] | None = None) -> dict[str, str]:
        """The signed headers of a GET of `path` (`query`: its canonical query string, sorted and
        encoded by `_q`; `rng`: a Range header, or none; `extra`: more headers, lower-case names,
        signed too)."""
        amz = now.strftime("%Y%m%dT%H%M%SZ")
        day = amz[:8]
        headers = {"host": self.host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz}
        if rng is not None:
            headers["range"] = rng
        if extra:
            headers.update(extra)
        signed = ";".join(sorted(headers))
        canonical = "\n".join(["GET", path, query, *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed,
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

        if self.use_curl:
            return self._curl_whole(path, limit)

        def whole(resp: http.client.HTTPResponse) -> int | None:
            # (an error's document, an object larger than asked for: never read into memory)
            return _whole_total(resp.status, resp.getheader, limit)

        got = self._get(path, path, "", f"bytes=0-{limit - 1}", whole)
        if got is None:
            return None
        resp, body = got
        return _got(body, resp.getheader)

    # -- the whole-object GET through libcurl -----------------------------------------------------
    def _curl(self):
        c = getattr(self._local, "curl", None)
        if c is None:
            c = pycurl.Curl()
            c.setopt(pycurl.NOSIGNAL, 1)
            c.setopt(pycurl.PROXY, "")               # (as http.client and pyarrow: no proxy from the environment)
            c.setopt(pycurl.PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS)
            c.setopt(pycurl.CONNECTTIMEOUT_MS, int(self.timeout * 1000))
            c.setopt(pycurl.TIMEOUT_MS, int(self.timeout * 1000))
            if self.scheme == "https":   # (the CAs http.client's context trusts: `__init__`)
                bundle, system = os.environ.get("AWS_CA_BUNDLE"), ssl.get_default_verify_paths()
                if bundle or system.cafile:
                    c.setopt(pycurl.CAINFO, bundle or system.cafile)
                if system.capath and not bundle:
                    c.setopt(pycurl.CAPATH, system.capath)
            self._local.curl = c
        return c

    def _curl_whole(self, path: str, limit: int) -> Got | None:
        """`get_whole` by libcurl: the same request (the Host header is the signed one), the same
        answers. A body longer than `limit` is refused by curl before or while it arrives."""
        c = self._curl()
        headers = self._headers(path, f"bytes=0-{limit - 1}", dt.datetime.now(dt.UTC))
        lines: list[bytes] = []
        body = BytesIO()
        c.setopt(pycurl.URL, f"{self.scheme}://{self.host}{path}")
        c.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()])
        c.setopt(pycurl.MAXFILESIZE_LARGE, limit)
        c.setopt(pycurl.HEADERFUNCTION, lines.append)
        c.setopt(pycurl.WRITEFUNCTION, body.write)
        try:
            c.perform()
        except pycurl.error as err:
            code = err.args[0] if err.args else 0
            c.close()
            self._local.curl = None
            if code == pycurl.E_OPERATION_TIMEDOUT:
                raise TimeoutError(f"S3 GET of {path}: no answer within {self.timeout:g} s") from None
            if code not in self._curl_errors_logged and code != pycurl.E_FILESIZE_EXCEEDED:
                self._curl_errors_logged.add(code)   # (once per kind: a TLS set-up that fails fails every time)
                log.warning("S3 GET by libcurl failed (%s): such opens go through pyarrow", err.args[-1])
            return None
        header = _header_fields(lines).get
        data = body.getvalue()
        total = _whole_total(c.getinfo(pycurl.RESPONSE_CODE), header, limit)
        return _got(data, header) if total is not None and len(data) == total else None

    def get_range_into(self, key: str, offset: int, buf: memoryview, etag: str) -> bool:
        """The object's bytes at `offset`, `len(buf)` of them, read from the socket straight into
        `buf` (a host cache fetch's block: its mapping of the cache file) by one ranged GET that
        only the version `etag` answers (`If-Match`: a replaced object is 412). True when `buf`
        was filled by that version; False for anything else (an error, another version, a short
        or longer answer; `buf` may then hold part of the answer): the caller reads the block
        through pyarrow. TimeoutError where the server does not answer within the request timeout."""
        n = len(buf)
        if n <= 0 or offset < 0 or not etag:
            return False
        try:
            path = self._prefix + "/" + quote(key, safe="/-_.~")
        except UnicodeEncodeError:
            return False
        rng = f"bytes={offset}-{offset + n - 1}"

        def exact(resp: http.client.HTTPResponse) -> int | None:
            # (an error's document, another version or another range: never read)
            ok = (resp.status == 206 and int(resp.getheader("content-length", "-1")) == n
                  and resp.getheader("etag") == etag
                  and resp.getheader("content-range", "").startswith(f"bytes {offset}-{offset + n - 1}/"))
            return n if ok else None

        return self._get(path, path, "", rng, exact, extra={"if-match": etag}, into=buf) is not None

    def list_after(self, folder_key: str, after: str, max_keys: int | None = None
                   ) -> list[tuple[str, int, int, bool]] | None:
        """The entries of the folder whose keys start with `folder_key` (ending in "/"; "" for
        the bucket's top) named after `after` (S3's order: bytewise UTF-8), as (name, size,
        mtime_ns, is_folder), sorted; None where this listing cannot be answered here (an error
        status, a page too large, more than LIST_MAX_PAGES pages, a document not as S3 writes
        it): list through pyarrow. TimeoutError where the server does not answer in time.
        `max_keys` (at most LIST_PAGE_KEYS): only the first page, of that many entries at most
        (the first names after `after`, not all of them)."""
        one_page = max_keys is not None
        keys = min(max_keys, LIST_PAGE_KEYS) if max_keys is not None else LIST_PAGE_KEYS
        params = {"list-type": "2", "delimiter": "/", "encoding-type": "url", "max-keys": str(keys),
                  "prefix": folder_key}
        if after:
            params["start-after"] = folder_key + after
        path = self._prefix + "/"
        out: list[tuple[str, int, int, bool]] = []
        for _page in range(1 if one_page else LIST_MAX_PAGES):
            query = "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(params.items()))
            body = self._get_page(path, query)
            if body is None:
                return None
            page = _listing_page(body, folder_key)
            if page is None:
                return None
            entries, token = page
            out += entries
            if token is None or one_page:
                return sorted(out)
            params["continuation-token"] = token
        return None

    def _get_page(self, path: str, query: str) -> bytes | None:
        def listing(resp: http.client.HTTPResponse) -> int | None:
            # (an error's document, or one too large or chunked: not read)
            length = int(resp.getheader("content-length", "-1"))
            return length if resp.status == 200 and 0 <= length <= LIST_PAGE_BYTES else None

        got = self._get(f"{path}?{query}", path, query, None, listing)
        return None if got is None else got[1]

    def _get(self, target: str, path: str, query: str, rng: str | None,
             size_of: Callable[[http.client.HTTPResponse], int | None], extra: dict[str, str] | None = None,
             into: memoryview | None = None) -> tuple[http.client.HTTPResponse, bytes] | None:
        """One signed GET of `target` (`path` and its canonical `query`; `extra`: more signed
        headers), once more on a fresh connection if a kept-alive one fails: (the response, its
        body) where `size_of` accepts the response (the body's length; None: not read) and the
        body is that long, else None. `into`: the body is read from the socket into this buffer
        (as long as `size_of` says) and the body returned is b"". TimeoutError where the server
        does not answer within the request timeout (no second wait)."""
        for attempt in range(2):
            try:
                conn = self._conn()
                conn.request("GET", target, headers=self._headers(path, rng, dt.datetime.now(dt.UTC), query, extra))
                resp = conn.getresponse()
                want = size_of(resp)
                if want is None:
                    self._drop_conn()
                    return None
                if into is None:
                    body = resp.read()
                    got = len(body)
                else:
                    body, got = b"", 0
                    while got < want:   # (http.client reads from the socket into the slice given)
                        k = resp.readinto(into[got:want])
                        if not k:
                            break
                        got += k
            except TimeoutError:
                self._drop_conn()
                raise
            except (http.client.HTTPException, OSError, ValueError):
                self._drop_conn()
                if attempt:
                    return None
                continue
            if got != want or resp.getheader("connection", "").lower() == "close":
                self._drop_conn()   # (a short body leaves the connection mid-response)
            return (resp, body) if got == want else None
        return None


def _listing_page(body: bytes, folder_key: str) -> tuple[list[tuple[str, int, int, bool]], str | None] | None:
    """(entries, the next page's continuation token or None) of a ListObjectsV2 response; None
    for a document that is not one (or whose keys are not URL-encoded, or lie outside the folder)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None
    if root.tag != f"{_NS}ListBucketResult" or (root.findtext(f"{_NS}EncodingType") or "").lower() != "url":
        return None
    out: list[tuple[str, int, int, bool]] = []
    try:
        for item in root.iterfind(f"{_NS}Contents"):
            name = _child_name(item.findtext(f"{_NS}Key"), folder_key)
            stamp = (item.findtext(f"{_NS}LastModified") or "").strip()
            size = int(item.findtext(f"{_NS}Size") or "-1")
            when = dt.datetime.fromisoformat(stamp)
            if name is None or not name or size < 0 or when.tzinfo is None:
                return None
            ns = int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000
            out.append((name, size, ns, False))
        for item in root.iterfind(f"{_NS}CommonPrefixes"):
            name = _child_name((item.findtext(f"{_NS}Prefix") or "").removesuffix("/") or None, folder_key)
            if not name:
                return None
            out.append((name, 0, 0, True))
    except ValueError:
        return None
    truncated = (root.findtext(f"{_NS}IsTruncated") or "").strip().lower() == "true"
    token = root.findtext(f"{_NS}NextContinuationToken") if truncated else None
    if truncated and not token:
        return None
    return out, token


def _child_name(raw: str | None, folder_key: str) -> str | None:
    """The name within `folder_key` of a listed key (URL-encoded, form style); None when it is not
    one there."""
    if raw is None:
        return None
    key = unquote_plus(raw, errors="surrogateescape")   # (S3 and MinIO write a space as "+")
    if not key.startswith(folder_key):
        return None
    name = key[len(folder_key):]
    return None if "/" in name or name in ("", ".", "..") else name


def _header_fields(lines: list[bytes]) -> dict[str, str]:
    """The header fields of the last response in `lines` (curl's header lines: a status line, then
    `Name: value` lines; an interim 1xx response before the final one is skipped), names
    lower-cased; a field given twice keeps the last value."""
    out: dict[str, str] = {}
    for raw in lines:
        line = raw.decode("latin-1").rstrip("\r\n")
        if line.startswith("HTTP/"):
            out = {}
        elif ":" in line:
            name, _, value = line.partition(":")
            out[name.strip().lower()] = value.strip()
    return out


def _whole_total(status: int, header: Callable[[str], str | None], limit: int) -> int | None:
    """The object's size where a response to `Range: bytes=0-(limit-1)` holds all of it and it has
    1..`limit` bytes (`header(name)`: the response's header, lower-case name, or None); None for
    anything else (an error, a larger object, a Content-Length that is no number)."""
    try:
        length = int(header("content-length") or "-1")
    except ValueError:   # (a server's header: anything)
        return None
    total = _whole_size(status, header("content-range") or "", length)
    return total if total is not None and 0 < total <= limit else None


def _got(body: bytes, header: Callable[[str], str | None]) -> Got | None:
    """`body`, an object read whole, with the version its response's headers give; None where
    they give none (no ETag, a Last-Modified that is no HTTP date)."""
    mtime = _http_date_ns(header("last-modified"))
    etag = header("etag")
    return Got(body, len(body), mtime, etag) if mtime is not None and etag else None


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
