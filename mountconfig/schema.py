"""The mount config: one typed schema; pydantic does the validation.

Every tunable has a default and a description; docs/config.md is generated from these
descriptions (``hintfs config-doc``) so the two cannot drift apart.
"""
from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hintfs.common.paths import relpath
from mountconfig.governor import GovernorConfig
from hintfs.transforms.params import TransformRule


def _store_path(v: str) -> str:
    try:
        return relpath(v)
    except OSError as err:   # pydantic reports ValueError with the key it belongs to
        raise ValueError(err.strerror) from None


class Section(BaseModel):
    # Unknown keys are mistakes (a typo silently ignored is a tunable silently at its default).
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreConfig(Section):
    uri: str = Field(
        "file:///srv/data",
        description="The existing store, as a pyarrow.fs URI: file:///path, s3://bucket/prefix, "
        "hdfs://namenode:port/path. Required in a config file (`hintfs mount`, `hintfs agent`): a file "
        "without it is refused; the default applies only to configs built in code.",
    )
    endpoint_override: str | None = Field(
        None, description="S3 only: host:port of an S3-compatible server (MinIO, Ceph RGW, JuiceFS's gateway)."
    )
    scheme: Literal["https", "http"] = Field("https", description="S3 only: protocol to the endpoint.")
    region: str | None = Field(None, description="S3 only: region; pyarrow's default resolution when unset.")
    access_key: str | None = Field(
        None, description="S3 only: access key; unset means the AWS default chain (env, profile, instance role)."
    )
    secret_key: str | None = Field(None, description="S3 only: secret key, together with access_key.")
    request_checksum: Literal["when_required", "when_supported"] | None = Field(
        None, description="S3 only: when the AWS SDK adds a checksum to a request (its "
        "AWS_REQUEST_CHECKSUM_CALCULATION, set for the daemon's S3 client only). \"when_supported\" (the "
        "SDK's own default) sends multipart parts with a CRC trailer in aws-chunked encoding, which "
        "many S3-compatible servers refuse (`MissingContentLength` from MinIO-based gateways such as "
        "JuiceFS's: every upload of a file larger than one part fails); \"when_required\" sends checksums "
        "only where the API demands one. Unset: \"when_required\" when `endpoint_override` is set (unless "
        "the environment sets AWS_REQUEST_CHECKSUM_CALCULATION), else the SDK's default.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Remote stores: connection timeout in seconds.")
    request_timeout_s: float = Field(30.0, gt=0, description="Remote stores: per-request timeout in seconds.")
    startup_check: bool = Field(
        True, description="Fail `hintfs mount` at once when the store root cannot be listed."
    )
    # Reads of remote stores (hintfs/stores/arrow.py, hintfs/stores/readahead.py; issue 39).
    whole_object_bytes: int = Field(
        1 << 20, ge=0, le=64 << 20,
        description="Remote stores: an object up to this size is read whole at open (then every read of "
        "that open is served from memory, or with a host cache from the copy it keeps of those bytes, by "
        "passthrough where the kernel has it); on S3 with "
        "`access_key` set, one a listing or a stat said is this small is opened by a single GET whose "
        "response gives its version too (no HEAD); 0: never.",
    )
    read_ahead_bytes: int = Field(
        64 << 20, ge=0, le=1 << 30,
        description="Remote stores without the host cache: the most bytes read ahead of one open file "
        "that reads sequentially (ranged reads in parallel; the window starts at two 8 MiB reads and "
        "doubles while the reader keeps coming); 0: no read-ahead. With `[cache] dir` the cache's "
        "fetch is the read-ahead (`fetch_threads`, `fetch_block_bytes`).",
    )
    read_buffer_bytes: int = Field(
        1 << 30, ge=1 << 20, le=1 << 40,
        description="Remote stores: the most bytes held in memory for all open files together "
        "(objects read whole at open, reads ahead); beyond it, reads ask the store for what they ask.",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme = urlparse(uri).scheme
        if scheme not in ("file", "s3", "hdfs", "viewfs"):
            raise ValueError(f"unsupported store scheme {scheme!r}: use file://, s3:// or hdfs://")
        if scheme == "file" and (urlparse(uri).netloc not in ("", "localhost")
                                 or not urlparse(uri).path.startswith("/")):
            raise ValueError("file:// URIs need an absolute path, e.g. file:///srv/data")
        return uri


class CacheConfig(Section):
    attr_timeout_s: float = Field(
        1.0, ge=0, description="How long the kernel may trust file attributes without asking again."
    )
    entry_timeout_s: float = Field(
        1.0, ge=0, description="How long the kernel may trust a name lookup (including negative ones)."
    )
    immutable_globs: list[str] = Field(
        default_factory=list,
        description="Paths (fnmatch globs, relative to the store root) that are never modified once "
        "written, e.g. checkpoints: their attributes and names are cached for `immutable_timeout_s`, "
        "and the kernel keeps the listing of a folder that matches (until it changes through this mount "
        "or its mtime does); a file of this host's store opened once is then reopened without Python "
        "(the fast path, `mount.fast_path_inodes`, docs/fastpath.md), reading the version that open found.",
    )
    immutable_timeout_s: float = Field(3600.0, ge=0, description="Attr/entry timeout for immutable paths.")
    relist_quiet_s: float = Field(
        2.0, ge=0, le=3600,
        description="A folder of `immutable_globs` paths changed through this mount is listed for the "
        "lookups to come (and its names answered inside the daemon's FUSE library, `mount.fast_lookups`) "
        "only once it has been left alone this long: a writer creating file after file there would "
        "otherwise have it listed again every few files (docs/fastpath.md). 0: at once.",
    )
    max_entries: int = Field(
        2_000_000, ge=1000, le=1 << 40,
        description="Most names (inodes) the daemon keeps for the kernel's cache: every entry a listing "
        "or lookup gave the kernel costs the daemon memory until the kernel forgets it (about 570 bytes "
        "each; 1,040 with the listings kept for `immutable_globs`, docs/operations.md). Past this count "
        "the daemon asks the kernel to forget the oldest idle names (down to 90%): a later `stat` of one "
        "is a lookup again. Open files and files being written are never asked. The listings kept for "
        "immutable folders hold at most this many names too (least recently used folders go first), "
        "those made for one user at most half of it (that user's own oldest go first; a larger folder "
        "is not kept).",
    )
    spool_dir: str = Field(
        "/var/cache/hintfs/spool",
        description="Remote stores only: local directory where written files are staged until close "
        "uploads them. file:// stores stage next to the target instead, so the rename is atomic. An "
        "absolute path; created 0700 and owned by the daemon's user: another user's folder or a symlink "
        "is refused at mount time (hintfs/common/owndir.py).",
    )
    # The host cache of remote stores (hintfs/stores/hostcache.py, docs/hostcache.md).
    dir: str = Field(
        "", description="Remote stores (s3://, hdfs://) only: a local directory where whole files read "
        "through the mount are kept, so a second open is served from local disk (by the kernel, with FUSE "
        "passthrough). Each file is verified against the store's version (size, mtime, ETag) at every "
        "open: a file changed in the store is never served from here. Created 0700, owned by the daemon's "
        "user; it must not be inside the mountpoint. Empty (the default): no host cache. Ignored for "
        "file:// stores (their files are local already).",
    )
    budget_bytes: int = Field(
        16 << 30, ge=1 << 20, le=1 << 50,
        description="Most bytes the host cache keeps; a fetch beyond it evicts the least recently opened "
        "files first (a file still open keeps its bytes until it is closed).",
    )
    fetch_threads: int = Field(
        8, ge=1, le=256, description="Host cache: ranged reads from the store in flight at once, over all "
        "files being fetched (each read is `fetch_block_bytes`).",
    )
    fetch_block_bytes: int = Field(
        8 << 20, ge=64 << 10, le=256 << 20,
        description="Host cache: size of each ranged read of a whole-file fetch.",
    )
    fetch_mapped: bool = Field(
        False, description="Host cache, S3 with explicit keys: a fetch maps its cache file and reads each block's "
        "GET straight into it, and reads of fetched blocks are answered from the mapping (one copy of each "
        "byte in the fetch instead of two: less daemon CPU, but 8 files fetched at once ran 0.68x as fast as "
        "buffered on 2 vCPUs, 0.83x as fast as through pyarrow on 16 cores: the mapping's page faults; bench/notes/s3_cold.md); false: `fetch_buffered`.",
    )
    fetch_buffered: bool = Field(
        True, description="Host cache, S3 with explicit keys, where blocks are not read into a mapping "
        "(`fetch_mapped = false`, or a filesystem without shared mappings): each block's GET is read into a "
        "buffer of the fetch thread and written with pwrite (two copies of each byte, no page faults on the "
        "cache file); false: read through pyarrow.",
    )
    min_file_bytes: int = Field(
        1, ge=0, description="Host cache: smaller files are never cached (read from the store each time).",
    )
    max_file_bytes: int = Field(
        0, ge=0, description="Host cache: larger files are never cached; 0: up to `budget_bytes`.",
    )

    @field_validator("dir")
    @classmethod
    def _cache_dir(cls, v: str) -> str:
        if v and not v.startswith("/"):
            raise ValueError("must be an absolute path (or empty: no host cache)")
        if "\0" in v:
            raise ValueError("contains a NUL byte")
        return v

    @field_validator("spool_dir")
    @classmethod
    def _spool_dir(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        if "\0" in v:
            raise ValueError("contains a NUL byte")
        return v

    @model_validator(mode="after")
    def _file_bounds(self) -> CacheConfig:
        if self.max_file_bytes and self.max_file_bytes > self.budget_bytes:
            raise ValueError(f"max_file_bytes ({self.max_file_bytes}) is larger than budget_bytes "
                             f"({self.budget_bytes}): such a file could never be cached")
        if self.max_file_bytes and self.min_file_bytes > self.max_file_bytes:
            raise ValueError(f"min_file_bytes ({self.min_file_bytes}) is larger than max_file_bytes "
                             f"({self.max_file_bytes}): no file could be cached")
        return self


class MountOptions(Section):
    fsname: str = Field("hintfs", description="Name shown in /proc/mounts and `df`.")
    allow_other: bool = Field(True, description="Let users other than the mounting one use the mount.")
    io_threads: int = Field(
        16, ge=1, le=512, description="Threads for blocking store I/O (cache misses, uploads, listings)."
    )
    max_tasks: int = Field(
        256, ge=1, le=100000, description="Most FUSE requests handled concurrently by the trio loop."
    )
    readdir_page: int = Field(
        1000, ge=16, le=100000, description="Directory entries fetched from the store per listing page."
    )
    passthrough: Literal["auto", "off"] = Field(
        "auto", description="FUSE passthrough for files on this host: the kernel serves reads and writes of "
        "an open file straight from the store file of a `file://` store or the host cache's copy of a "
        "remote file (`[cache] dir`), or, when writing, from its staging file, at disk speed; the daemon still sees opens and closes (publish on close stays atomic). \"auto\" (the "
        "default): where the kernel (Linux >= 6.9), libfuse/pyfuse3 (`make setup` builds them) and "
        "privileges (root) allow it, else today's path, said once in the log and in `hintfs status`. "
        "\"off\": never (every byte through the daemon, counted in its stats). What it changes for "
        "consistency and stats: docs/semantics.md.",
    )
    passthrough_min_free_mb: int = Field(
        1024, ge=0, le=1 << 30,
        description="Under passthrough the kernel writes the staging file itself and the daemon never "
        "sees a write fail. So a file is opened for writing by passthrough only while the filesystem of "
        "its staging file has at least this much free space (MiB); below it, its writes go through the "
        "daemon, which sees every error. A publish of a passthrough write is refused (ENOSPC at close, "
        "the previous version kept) when that filesystem has less than 1/16 of it free then: a write "
        "may have failed unseen. 0: passthrough whatever the free space, and no check at publish. "
        "docs/semantics.md, \"The publish rule\".",
    )
    fast_path_inodes: int = Field(
        65536, ge=0, le=1 << 22,
        description="Files whose later read-only opens are answered inside the daemon's FUSE library "
        "without Python (the fast path, docs/fastpath.md): only plain files of this host's store, "
        "under FUSE passthrough, matching `cache.immutable_globs` (or any, each open checked: "
        "`fast_checked_opens`), never a path a route names or a hint has replicas of. Each holds one open fd and one backing id until the kernel forgets the file, a "
        "write, truncate, rename or unlink through this mount, a hint's replica of it, or a newer file "
        "needs its place (the user holding the most gives up its oldest). At most a quarter of the "
        "daemon's open-file limit. 0: off.",
    )
    fast_checked_opens: bool = Field(
        True,
        description="On a file:// store, the fast path (`fast_path_inodes`) takes files not declared "
        "immutable too: each read-only open answered inside the FUSE library first checks, as the "
        "store's close-to-open check does under passthrough, that the path (resolved beneath the store "
        "root) still names the file the mark was made on; another file, none or a symlink sends the "
        "open to Python, which opens the name's new file. Their GETATTRs stay in Python "
        "(docs/fastpath.md, \"Checked marks\"). Needs the patched pyfuse3 and openat2. false: only "
        "immutable paths are marked.",
    )
    fast_lookups: bool = Field(
        True,
        description="Lookups of the plain files of a folder listed for the lookups to come (a tool "
        "going through a folder of `cache.immutable_globs` paths by path: `stat`, a loader's opens) "
        "are answered inside the daemon's FUSE library without Python, from that listing, until it "
        "expires or anything in the folder changes through this mount (docs/fastpath.md, "
        "\"Lookups\"). Each name listed then holds one cached entry (bounded by `cache.max_entries`; the "
        "names registered for one user's lookups by half of it, that user's oldest folders given up first). "
        "On a file:// store, a folder not declared immutable whose files a reader is opening has its names "
        "registered too, each lookup checked against the store and answered with the attributes of then "
        "(`fast_checked_opens`; docs/fastpath.md, \"Checked names\"). "
        "Needs the patched pyfuse3. false: every lookup in Python.",
    )
    fast_opens_ahead: int = Field(
        2, ge=0, le=1_000_000,
        description="Once this many files of a folder whose names are answered inside the FUSE library "
        "(`fast_lookups`) were opened for reading through Python, its other registered files are marked "
        "for the fast path ahead of their opens (`fast_path_inodes`: each holds an fd and a backing id; "
        "free places are taken, then those of the same user's oldest marks, never another user's), so their first opens and releases are "
        "answered without Python too (a loader going through a folder of small files; docs/fastpath.md, "
        "\"Opens ahead\"). On a file:// store, once this many files of a folder not declared immutable got "
        "checked marks (`fast_checked_opens`) at their first opens, the lookups of its other files mark "
        "them (docs/fastpath.md, \"Marks at lookup\"). On an object store with a host cache, once this many small objects of a listed "
        "folder were opened so, its other small objects the kernel knows are fetched whole into the host cache "
        "and marked the same way (at most a quarter of `cache.budget_bytes`; docs/fastpath.md, \"Fetches "
        "ahead\"). 0: a file is marked at its own first open.",
    )
    request_spin_us: int = Field(
        20, ge=0, le=1000,
        description="After answering a request, keep reading /dev/fuse for up to this many "
        "microseconds before waiting in the event loop: a reader that opens file after file sends its "
        "next request a few microseconds after the reply, and a wait and a wake-up cost the daemon "
        "more. It spends that much CPU at the end of each run of requests (small files, one reader: "
        "+35% files/s on a first pass, docs/fastpath.md). Needs the patched pyfuse3. 0: wait at once.",
    )
    listing_spin_us: int = Field(
        300, ge=0, le=5000,
        description="After a listing ends (the daemon gave a folder's last names), the next wait for a "
        "request spins up to this many microseconds instead of `request_spin_us`: a walk (`find`, "
        "`os.walk`) opens its next folder once it has gone through this one's names, ~100-300 "
        "microseconds later. At most that much CPU per folder listed (`find` over 1,000,000 files: "
        "bench/notes/metadata.md). Needs the patched pyfuse3. 0: no longer than `request_spin_us`.",
    )
    writeback_cache: bool = Field(
        False, description="Let the kernel batch small writes into larger ones. The kernel then trusts "
        "its own idea of file sizes, so changes made to the store by anyone else are not seen until "
        "remount: only for stores written through this one mount. The kernel does not combine it with "
        "FUSE passthrough: with it, every byte goes through the daemon.",
    )
    read_ahead_kb: int = Field(
        4096, ge=0, le=1 << 20,
        description="Kernel read-ahead window of the mount (its bdi's read_ahead_kb; 0 keeps the "
        "kernel's 128). Larger windows make the kernel send 1 MiB reads instead of 128 KiB ones "
        "to sequential readers: fewer requests through the daemon.",
    )
    unmount_timeout_s: float = Field(
        30.0, gt=0, description="At unmount (`hintfs umount`, SIGTERM/SIGINT): how long the daemon keeps "
        "serving files still open for writing; what is open then is abandoned and named (docs/operations.md)."
    )
    nonempty: bool = Field(
        False, description="Mount over a mountpoint folder that holds files (they are hidden, not "
        "removed, until the unmount). False (the default): such a mount is refused in one line, since "
        "files there are usually ones written while the mount was down (`hintfs mount --nonempty` "
        "allows it once). A dead hintfs mount left by a killed daemon is detached first and is not "
        "\"non-empty\".",
    )


class MetricsConfig(Section):
    enabled: bool = Field(False, description="Serve Prometheus metrics over HTTP: one endpoint per host "
                          "and port for every mount of the same user, each series labelled `mount` "
                          "(docs/operations.md, Metrics).")
    bind: str = Field("127.0.0.1", description="Address the metrics endpoint binds (the mount that serves "
                      "the port binds its own).")
    port: int = Field(9464, ge=0, le=65535, description="Port of the host's metrics endpoint: the same on "
                      "every mount of the host (0: pick a free one, for tests).")
    dir: str | None = Field(None, description="Folder where the mounts with metrics on meet (their "
                            "snapshots, the port's lock): 0700, the mounts' user's. Unset: "
                            "/run/hintfs/metrics as root, else <tmp>/hintfs-metrics-<uid>.")

    @field_validator("dir")
    @classmethod
    def _metrics_dir(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError("must be an absolute path")
        return v


class LoggingConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    file: str | None = Field(
        None, description="Log file; unset means stderr (the journal under systemd)."
    )


class AgentConfig(Section):
    """`hintfs agent CONFIG` on a storage node; also the in-process agent of a mount with no agents."""
    location: str = Field("grpc://127.0.0.1:8815", description="Flight location to bind: loopback unless "
                          "told otherwise; grpc+tls://host:port with tls_cert_file/tls_key_file.")
    data_dir: str = Field("/var/lib/hintfs/replicas", description="Where this agent keeps its replicas.")
    budget_bytes: int = Field(64 << 30, ge=0, description="Most bytes of replicas kept on this agent's disk; "
                              "a copy beyond it evicts replicas by policy (expired, then older "
                              "checkpoints, least recently used first), with up to 2% of the budget "
                              "more from those for the next copies, or is refused (ENOSPC).")
    token_file: str | None = Field(None, description="File holding the shared token clients must send "
                                      "(mode 0600, owned by the agent's user). `hintfs agent` refuses to start "
                                      "without one unless `auth = \"none\"`. A mount's own in-process agent "
                                      "needs none: it listens on a unix socket only its user can reach.")
    auth: Literal["token", "none"] = Field("token", description="`hintfs agent`: \"token\" requires "
                                           "`token_file`; \"none\" serves anyone who can reach `location` "
                                           "(logged as a warning at start): only where every such user may "
                                           "read every file of the store.")
    tls_cert_file: str | None = Field(None, description="PEM certificate for TLS.")
    tls_key_file: str | None = Field(None, description="PEM private key for TLS.")
    max_concurrent_reads: int = Field(64, ge=1, description="Reads served at once; more wait their turn.")
    bandwidth_bytes_s: int = Field(0, ge=0, description="Cap on bytes served per second (0: none). "
                                   "Benchmarks use it to emulate a data node's disk or NIC.")
    reclaim_interval_s: float = Field(1.0, gt=0, description="How often expired replicas are removed.")
    link_bytes_s: int = Field(0, ge=0, description="Bandwidth budget of the link this agent copies across "
                              "(cross-DC); copies from the store are then scheduled by priority class "
                              "(anomaly > eval > background) and weight. 0: no scheduling.")
    link_chunk_bytes: int = Field(4 << 20, ge=4096, description="Unit of scheduling on the link: a higher "
                                  "class takes the link at the next chunk boundary.")
    local_socket: str | None = Field(None, description="A unix socket (created 0600) where mounts on "
                                        "this host, run by the agent's user or root, receive a read-only fd "
                                        "of a complete replica, so an eval mount with `[[routes]] local_socket` "
                                        "serves it by FUSE passthrough (kernel reads). Unset: none.")
    stream_prefixes: list[str] | None = Field(None, description="Eval tier: store prefixes a training "
                                                 "mount may stream files into (write-time streaming). A "
                                                 "stream's bytes become the replica the eval side reads, so "
                                                 "its sender (any holder of the token) is trusted for them; "
                                                 "unset: the `[follow] prefixes`; empty: no streams.")
    stream_idle_s: float = Field(120.0, gt=0, le=86400, description="Eval tier: a stream from a training "
                                 "mount (write-time streaming) with no call for this long and not published "
                                 "is dropped: its sender died or gave up, the follower copies the file.")
    stream_max_open: int = Field(4096, ge=4, le=1 << 20, description="Eval tier: most streams held at once "
                                 "(each keeps a descriptor until it is a replica or dropped), and never more "
                                 "than a quarter of the agent's open-file limit. A new stream past it is "
                                 "refused (EAGAIN, one log line); the follower copies that file after close.")
    stream_max_per_peer: int = Field(512, ge=1, le=1 << 20, description="Eval tier: most streams held for one "
                                     "peer host (a training host), and never more than a quarter of the "
                                     "streams the tier may hold, so that other hosts keep streaming (EAGAIN).")
    stream_max_per_token: int = Field(4096, ge=1, le=1 << 20, description="Eval tier: most streams held for "
                                      "one token. The agent has one token, which often serves a whole fleet: "
                                      "this bounds all token holders together, beside `stream_max_per_peer`.")
    stream_peer_share: float = Field(0.5, gt=0, le=1, description="Eval tier: the share of `budget_bytes` "
                                     "the chunks of one peer host's streams may hold before they are replicas. "
                                     "Stream chunks count in `budget_bytes` like replicas (a chunk past the "
                                     "budget evicts replicas as a copy does, or is refused: ENOSPC).")
    stream_record_wait_s: float = Field(2.0, ge=0, le=600, description="Eval tier: a published stream is "
                                        "served only once the store's word confirms its version: a journal "
                                        "record of it, else, after this long, a stat of the store file (the "
                                        "versions due are stat-ed together). At once without `[follow]`.")
    stream_verify_poll_s: float = Field(0.01, gt=0, le=60, description="Eval tier with `[follow]`: for 2 s "
                                        "after each stream publish, and while a published version waits for "
                                        "the store's word, the journal's current time slice is listed this often "
                                        "(one listing at a time, and no sooner after one than its bytes allow at ~256 KB/s: "
                                        "a big slice is listed less often), so that the commit marker's version is "
                                        "confirmed about when its publish arrives. Fewer listings (a larger "
                                        "value) cost a marker up to this long before eval mounts see it.")


    @field_validator("stream_prefixes")
    @classmethod
    def _stream_prefixes(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_store_path(p) for p in v]

    @model_validator(mode="after")
    def _tls(self) -> AgentConfig:
        # (else gRPC fails to listen with a line that suggests a busy port)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both (docs/deploy.md)")
        if self.location.startswith("grpc+tls://") and not self.tls_cert_file:
            raise ValueError(f"location {self.location} needs tls_cert_file and tls_key_file (this host's "
                             "certificate and key: docs/deploy.md)")
        return self


class AgentsConfig(Section):
    """The storage agents a mount talks to."""
    locations: list[str] = Field(default_factory=list, description="Flight locations of the agents; "
                                 "empty starts one agent inside the mount over `agent.data_dir`.")
    token_file: str | None = Field(None, description="Token sent to the agents (a 0600 file owned by "
                                      "the mount's user): those of `locations`, the `[[routes]]` tier agents "
                                      "(an eval mount's token for its tier), and `[stream]`'s unless it names "
                                      "its own. In an agent's config: the token it sends its peers.")
    tls_root_file: str | None = Field(None, description="PEM root certificate(s) that agents' TLS "
                                      "certificates (`grpc+tls://`) must be signed by: for `locations`, "
                                      "`[[routes]]` and `[stream]` alike (a CA, or the old and the new one "
                                      "while it is rotated: docs/deploy.md). Unset: the system's roots.")


class ReplicasConfig(Section):
    """Replication hints and reads from hot replicas (restart storms)."""
    default_replicas: int = Field(1, ge=1, description="Fewest replicas of a hinted file.")
    max_replicas: int = Field(16, ge=1, description="Most replicas of one file.")
    safe_readers_per_replica: int = Field(32, ge=1, description="Concurrent readers one replica serves "
                                          "before reads queue: p99 within 2x p50, p50 within 2x one reader's "
                                          "(`hintfs calibrate`).")
    max_hint_files: int = Field(100_000, ge=1, description="Most files in one hint document.")
    read_timeout_s: float = Field(5.0, gt=0, description="A replica read slower than this fails over.")
    hedge_after_ms: float = Field(200.0, ge=0, description="Send a second read to another source after "
                                  "this long (0: no hedging).")
    block_bytes: int = Field(4 << 20, ge=4096, description="Unit of reads from replicas; concurrent misses "
                             "of one block on this host are fetched once.")
    stripe_bytes: int = Field(256 << 10, ge=0, description="A block of a file with several replicas is read in "
                              "pieces of at least this many bytes from as many replicas at once, so each host "
                              "spreads its bytes over the agents; a file of fewer blocks than replicas in "
                              "pieces of at least 64 KiB, one per replica (0: each block from one replica).")


class TransformLoadConfig(Section):
    """Storage-side transforms (`x.mp4.tensor`): workers, cache, lookahead, load-aware fallback."""
    workers: int = Field(1, ge=1, le=256, description="Transform processes per agent (one decode thread each).")
    cache_bytes: int = Field(1 << 30, ge=0, description="Bytes of transformed samples an agent keeps.")
    lookahead_steps: int = Field(2, ge=0, le=1000, description="Plan steps N+1..N+W materialized while step N is read.")
    lookahead_max_steps: int = Field(64, ge=0, le=4096, description="Most steps the agents may grow a plan's "
                                     "lookahead to when the predicted transform work of its window nears their "
                                     "capacity (within each job's share of `cache_bytes`); the mount sends "
                                     "that many steps at most.")
    fallback: bool = Field(True, description="Serve raw bytes (the client transforms the identical tensor) for "
                           "the samples storage cannot finish before their plan step at its measured "
                           "capacity, cheapest first, and when a sample misses `deadline_ms`.")
    cpu_enter: float = Field(0.80, gt=0, le=1, description="Superseded by the per-sample fallback (issue 40): "
                             "only for mounts that send no plan steps (older mounts), the agent CPU share at "
                             "which every sample goes raw.")
    cpu_leave: float = Field(0.70, gt=0, le=1, description="Superseded, as `cpu_enter`: the share below which "
                             "that stops.")
    fixed_raw_share: float | None = Field(None, ge=0, le=1, description="For measurement: send this share of "
                                          "the plans' samples worth sending raw (not an image still needing "
                                          "its decode check) raw, the cheapest for the client first, instead "
                                          "of following the capacity; no other fallback then.")
    fixed_raw_order: Literal["client", "relief"] = Field(
        "client", description="For measurement, with `fixed_raw_share`: which samples that share is: "
        "`client`, the cheapest for the client first (issue 40's order); `relief`, the most storage work "
        "saved per unit of client work first (the schedule's own order until issue 40's run 14; now "
        "`client` is).")
    image_raw_check: Literal["decode", "header"] = Field(
        "decode", description="What an image gets on storage before its raw container goes out (fallback): "
        "`decode` decodes it once, as the transform would, so a `.tensor` never holds an image the transform "
        "refuses (its raw container then saves storage only the resize and encode, unless the image was "
        "checked or transformed before); `header` only the checks that need no decoder, as a video gets: "
        "the raw container saves storage the whole transform, and damage only a decoder finds is `EIO` from "
        "the client's `load_sample` instead of at the open (docs/transforms.md).")
    deadline_ms: float = Field(2000.0, gt=0, description="A sample not transformed by then is served raw "
                               "(with fallback on).")
    mount_pull_bytes: int = Field(256 << 20, ge=0, description="Mount side: at the first read of plan step N, "
                                  "the tensors of steps N and N+1 the agents have ready are fetched in one "
                                  "call per agent and kept here (at most this many bytes) for their opens; "
                                  "0: one call per open.")


class JournalConfig(Section):
    """Training side: record every file this mount publishes, so eval DCs learn of it at once."""
    enabled: bool = Field(False, description="Write one small record per closed file to `dir` in the store.")
    dir: str = Field(".hintfs-journal", description="Store folder of the journal (hidden in the mount).")
    retention_s: float = Field(86400.0, gt=0, description="Records older than this are deleted by the "
                               "writing mounts (checked every retention/10, at most every 10 min), so "
                               "the followers' listing stays short. A follower down for longer misses "
                               "older records: reads of those files go to the store and fetch them then.")


    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        return _store_path(v)

class FollowConfig(Section):

    """Eval side, in an agent: copy each new checkpoint from the (remote) store as it is written."""
    prefixes: list[str] = Field(default_factory=list, description="Store prefixes to follow (empty: off).")
    journal_dir: str = Field(".hintfs-journal", description="Where training mounts journal closed files; "
                             "without it the agent polls the listing of the prefixes.")
    commit_marker: str = Field(".metadata", description="File name that completes a checkpoint (DCP: "
                               ".metadata); copied last, then the checkpoint is complete.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept per job folder.")
    ttl_s: float = Field(86400.0, gt=0, description="How long a followed checkpoint's replicas live.")
    poll_interval_s: float = Field(0.5, gt=0, description="How often the journal (or listing) is read.")
    parallel: int = Field(16, ge=1, le=256, description="Ranged reads in flight per file copy (fill the "
                          "bandwidth-delay product of the link).")


    @field_validator("prefixes")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_store_path(p) for p in v]

    @field_validator("journal_dir")
    @classmethod
    def _journal(cls, v: str) -> str:
        return _store_path(v)

class StreamConfig(Section):
    """Training side: send each file under `prefixes` to the eval DC's tier agents while it is
    written (write-time streaming, docs/cross_dc.md). The writer never waits for the link."""
    prefixes: list[str] = Field(default_factory=list, description="Store prefixes whose files are "
                                "streamed (empty: off).")
    agents: list[str] = Field(default_factory=list, description="Flight locations of the eval tiers' "
                              "agents (grpc:// or grpc+tls://); every file goes to each of them.")
    token_file: str | None = Field(None, description="Token sent to the tier agents (a 0600 file owned "
                                      "by the mount's user); unset: `[agents] token_file`.")
    link_bytes_s: int = Field(0, ge=0, description="Budget of this mount's sends on the link (bytes/s; "
                              "0: none). The eval agent's pulls have their own `[agent] link_bytes_s`: "
                              "split the link between them.")
    chunk_bytes: int = Field(1 << 20, ge=64 << 10, le=64 << 20, description="Unit of a stream: whole "
                             "chunks leave behind the writer, the partial tail at close; one CRC-32C each. "
                             "Also the grain of `first_by_reads`.")
    call_bytes: int = Field(4 << 20, ge=64 << 10, le=64 << 20, description="Most bytes of one call to a "
                            "tier (consecutive chunks go together). While a file grows, the chunks at its "
                            "growing end that no eval read named wait to fill a call (fewer calls, less CPU "
                            "on the writer's host); equal to `chunk_bytes`, each whole chunk leaves at once.")
    compress: bool = Field(True, description="Send each chunk compressed (zstd, level 1) where that "
                           "saves a twentieth of its bytes: the link between datacenters is the scarce "
                           "resource (DCP's files of small tensors: ~0.89). Costs the sender ~1.5 ms of CPU "
                           "per MiB; a 64 KiB probe keeps incompressible chunks at ~1% of that. The link "
                           "budget (`link_bytes_s`) still counts the bytes before compression.")
    parallel: int = Field(8, ge=1, le=64, description="Calls in flight at once (fill the link's "
                          "bandwidth-delay product).")
    first_by_reads: bool = Field(True, description="Send first the chunks that eval jobs read of the "
                                 "previous checkpoint's file of the same name (the tier names them in its answer "
                                 "to the stream's open; docs/cross_dc.md, \"Eval reads first\").")
    others_in_flight: int = Field(1, ge=0, le=64, description="With `first_by_reads`: calls of other "
                                  "chunks in flight while named chunks are on their way (of all this mount's "
                                  "files; otherwise the others go `parallel` at a time).")
    others_while_writing: bool = Field(True, description="With `first_by_reads`: chunks the tier did not "
                                       "name are sent while the file is written too (false: only at its "
                                       "close; the writer's host spends no CPU on them meanwhile, and the "
                                       "tier holds the rest later).")
    poll_interval_s: float = Field(0.02, gt=0, le=10, description="How often open staging files are "
                                   "checked for new whole chunks.")
    max_held_bytes: int = Field(8 << 30, ge=0, description="Most bytes of closed files kept open for "
                                "streams the tier has not acknowledged; beyond it the oldest is given up "
                                "(the tier then copies that file after close, from the journal).")
    idle_s: float = Field(120.0, gt=0, le=86400, description="A stream whose sends fail for this long is "
                          "given up (the tier drops streams idle this long; the follower copies the file).")
    timeout_s: float = Field(10.0, gt=0, le=600, description="One call to a tier agent.")
    sender: Literal["process", "threads"] = Field("process", description="Where the sends run: "
                                                  "`process`, a child process of the mount (its Python lock "
                                                  "and its faults are not the mount's; started again if it "
                                                  "dies), or `threads` of the mount itself.")
    sender_nice: int = Field(5, ge=0, le=19, description="CPU niceness of the sends (the child process, or "
                             "the mount's send threads): on a busy host the job's writes and uploads run "
                             "first (at 5 the job gets three quarters of a CPU both want; at 10 the sends "
                             "starved whenever the job's CPU was full: docs/cross_dc.md). Above 0 the child "
                             "leads a session of its own whose autogroup gets this niceness, so that it "
                             "counts against the job's processes too; in a cpu cgroup (systemd) it orders "
                             "the sends against the mount's threads only.")
    sender_cpus: list[int] | None = Field(None, description="CPUs the sender process runs on (Linux "
                                             "CPU numbers, as `taskset -c` takes them; unset: the mount's). On "
                                             "a host with cores the job leaves free, put it there: its reads, "
                                             "checksums and sends then never take the writer's CPU. Needs "
                                             "`sender = \"process\"`.")

    @field_validator("sender_cpus")
    @classmethod
    def _cpus(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("sender_cpus is empty: leave it out to run the sender on the mount's CPUs")
        if len(set(v)) != len(v):
            raise ValueError(f"sender_cpus {v} names a CPU twice")
        here = os.cpu_count() or 1
        missing = [c for c in v if not 0 <= c < here]
        if missing:
            raise ValueError(f"sender_cpus: no CPU {missing[0]} on this host (it has CPUs 0-{here - 1})")
        return sorted(v)

    @field_validator("prefixes")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_store_path(p) for p in v]

    @field_validator("agents")
    @classmethod
    def _agents(cls, v: list[str]) -> list[str]:
        for loc in v:
            if not loc.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
                raise ValueError(f"{loc!r}: a tier agent is grpc://host:port or grpc+tls://host:port")
        return v

    @model_validator(mode="after")
    def _complete(self):
        if self.prefixes and not self.agents:
            raise ValueError("[stream] prefixes need [stream] agents (the eval tiers to send to)")
        if self.sender_cpus is not None and self.sender != "process":
            raise ValueError('[stream] sender_cpus needs sender = "process" (threads run on the mount\'s CPUs)')
        return self


class RouteConfig(Section):
    """Eval side, in the mount: paths under `prefix` are read from the local tier when it has them."""
    prefix: str = Field(description="Relpath prefix in the mount.")
    local_agent: str = Field(description="Flight location of the local tier's agent.")
    fetch_on_read: bool = Field(True, description="A read of a file the local tier lacks asks it to fetch "
                                "that file first (the read itself goes to the store meanwhile).")
    local_socket: str | None = Field(None, description="The tier agent's `[agent] local_socket` when it "
                                        "runs on this host: its replicas are then opened by FUSE passthrough.")
    local_socket_uid: int = Field(0, ge=0, lt=2**32 - 1, description="The uid the tier agent of "
                                  "`local_socket` runs as. An fd is taken from the socket only if its peer "
                                  "(SO_PEERCRED) is this user, the socket and every folder from / to it are "
                                  "owned by root or this user and no other user may write them (sticky "
                                  "folders such as /tmp aside), and the fd is a regular file; else the "
                                  "read goes the normal way (one log line).")
    stream_wait_s: float = Field(5.0, ge=0, le=600, description="A lookup or open of a file a training "
                                 "mount is streaming to the tier and has not published yet waits this long "
                                 "for the publish, then goes to the store (which has the older version or "
                                 "none). Unpublished bytes are never served.")


    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _store_path(v)

class MountConfig(Section):
    store: StoreConfig = Field(default_factory=StoreConfig, description="The store hintfs is a view of.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Kernel caching, write staging and the host cache of remote stores.")
    mount: MountOptions = Field(default_factory=MountOptions, description="FUSE mount options.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus endpoint.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="This host's storage agent.")
    agents: AgentsConfig = Field(default_factory=AgentsConfig, description="Agents the mount uses.")
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig, description="Hints and replica reads.")
    journal: JournalConfig = Field(default_factory=JournalConfig, description="Closed-file journal (training side).")
    follow: FollowConfig = Field(default_factory=FollowConfig, description="Predictive replication (eval-side agent).")
    stream: StreamConfig = Field(default_factory=StreamConfig, description="Write-time streaming to eval tiers (training side).")
    routes: list[RouteConfig] = Field(default_factory=list, description="`[[routes]]`: local-tier routing (eval side).")
    transforms: list[TransformRule] = Field(default_factory=list, description="`[[transforms]]` rules: "
                                            "glob, kind (image|video), params; the first match wins.")
    transform_load: TransformLoadConfig = Field(default_factory=TransformLoadConfig,
                                                description="Where and when transforms run.")
    governor: GovernorConfig = Field(
        default_factory=GovernorConfig,
        description="The GPU-memory governor (`hintfs governor CONFIG` reads this table; the mount ignores it).",
    )
