"""The storage agent over Arrow Flight: the adapter between Flight calls and the agent's parts.

The agent on a storage node serves byte ranges of store files and of the replicas it keeps on
its own disk, makes replicas on request (from the store, or from another agent: tree fan-out),
keeps each for a TTL within a byte budget, takes the write-time streams of training mounts, and
reports its load. Its parts are assembled in hintfs/agent/node.py; this module only carries calls:

- `do_action`: an action (replicate, drop, signal, plan_window, tier_stat, has, status, ping,
  prefetch, stream_open, stream_publish, stream_abort): its request parsed, handled and answered
  as the dispatch table says (hintfs/agent/actions.py: kind -> typed request, handler, typed reply);
- `do_get`: a ticket (a byte range, a transformed sample, the ready samples of a plan window),
  answered as a record batch (hintfs/agent/actions.py `TICKETS`);
- `do_put`: the chunks of a write-time stream (hintfs/agent/intake.py; docs/cross_dc.md).
Every request is parsed by `hintfs.agent.rpc` (typed, bounded, paths by the one resolver) before it
reaches a handler; every error leaves as `hintfs.agent.rpc.rpc_error` (errno + message).
Who may call: see docs/security.md (a token, or the 0700 unix socket of a mount's own agent).

Flight runs each call on its own thread. `start_in_process` starts a mount's own agent;
`run_agent` is `hintfs agent`.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import signal
import threading
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as fl

from hintfs.agent import actions, rpc, socketdir
from hintfs.agent.node import Agent
from hintfs.common.refusals import RefusalLog
from hintfs.agent.rpc import rpc_error
from hintfs.common.clock import SYSTEM_CLOCK, Clock
from hintfs.common.errors import HintfsError
from hintfs.common.fdlimit import raise_open_file_limit
from hintfs.common.secrets import read_token_file
from hintfs.common.systemd import sd_notify
from mountconfig.schema import AgentConfig, AgentsConfig, FollowConfig, StoreConfig, TransformLoadConfig
from policy.stream import Sender
from hintfs.stores import check_store, open_store
from hintfs.stores.base import Store

log = logging.getLogger("hintfs.agent")


class _Caller(fl.ServerMiddleware):
    """A call that presented the agent's token: `principal` names that token (a fingerprint,
    never the token) for per-sender bounds and the status."""

    def __init__(self, principal: str):
        self.principal = principal


class TokenMiddlewareFactory(fl.ServerMiddlewareFactory):
    def __init__(self, token: str):
        self.token = token
        self.principal = "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]

    def start_call(self, info, headers):
        got = headers.get("authorization") or headers.get("Authorization") or []
        if not got or not hmac.compare_digest(str(got[0]).encode(), f"Bearer {self.token}".encode()):
            log.warning("refused %s call without a valid token", info.method)
            raise fl.FlightUnauthenticatedError("missing or wrong token")
        return _Caller(self.principal)


class _Versioned(fl.ServerMiddleware):
    """Every answer carries this agent's protocol version (`hintfs.agent.rpc.PROTOCOL`)."""

    def sending_headers(self):
        return {rpc.VERSION_HEADER: str(rpc.PROTOCOL)}


class VersionMiddlewareFactory(fl.ServerMiddlewareFactory):
    """A call of a protocol version this agent does not accept is refused before it is parsed:
    EPROTONOSUPPORT, one line naming both versions and the side to upgrade (docs/versions.md)."""

    def __init__(self) -> None:
        self.refusals = RefusalLog(60.0, keep=64)

    def start_call(self, info, headers):
        why = rpc.client_refusal(rpc.header_version(headers.get(rpc.VERSION_HEADER)))
        if why:
            since = self.refusals.note(why)      # one line a minute per mismatch
            if since is not None:
                log.error("refused a call: %s%s", why, RefusalLog.more(since))
            raise rpc_error(errno.EPROTONOSUPPORT, why)
        return _Versioned()


def _sender(context) -> Sender:
    """Who made a Flight call: the token it presented ("-": none configured) and its peer's host
    (the address without its port; "unix" for a unix socket). Streams are bounded per both."""
    caller = context.get_middleware("auth") if context is not None else None
    token = getattr(caller, "principal", "-")
    peer = context.peer() if context is not None else "-"
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer.rsplit(":", 1)[0]
    elif peer.startswith("unix"):
        peer = "unix"
    return Sender(token, peer or "-")


class AgentServer(fl.FlightServerBase):
    """The Flight server of one agent. `config` is `[agent]` (where it listens, TLS, its token,
    and the agent's own keys); `peers`, `follow`, `transform_load` are `[agents]`, `[follow]`,
    `[transform_load]` (hintfs/agent/node.py says what each part takes). `require_token`: refuse to start
    without `[agent] token_file` unless `auth = "none"` (`hintfs agent`)."""

    def __init__(self, store: Store, config: AgentConfig, *, peers: AgentsConfig | None = None,
                 follow: FollowConfig | None = None, transform_load: TransformLoadConfig | None = None,
                 location: str | None = None, persistent: bool = False, require_token: bool = False,
                 clock: Clock = SYSTEM_CLOCK):
        tls = None
        if config.tls_cert_file and config.tls_key_file:
            with open(config.tls_cert_file, "rb") as c, open(config.tls_key_file, "rb") as k:
                tls = [fl.CertKeyPair(c.read(), k.read())]
        middleware: dict[str, fl.ServerMiddlewareFactory] = {"version": VersionMiddlewareFactory()}
        if config.token_file:
            middleware["auth"] = TokenMiddlewareFactory(read_token_file(config.token_file))
        elif require_token and config.auth != "none":
            raise HintfsError(errno.EPERM, "an agent that listens on a network needs [agent] token_file "
                              "(a 0600 file holding a shared secret); set [agent] auth = \"none\" only on a "
                              "host where every local user may read every file of the store")
        super().__init__(location or config.location, tls_certificates=tls, middleware=middleware)
        self.agent = Agent(store, config, peers=peers or AgentsConfig(), follow=follow or FollowConfig(),
                           transform_load=transform_load or TransformLoadConfig(), persistent=persistent,
                           clock=clock)
        self.socket_dir: socketdir.SocketDir | None = None   # the in-process agent's socket folder

    def local_replica_fd(self, path: str, size: int, mtime_ns: int) -> int:
        """(the mount in this process) A new fd of the replica of exactly this version, or -1."""
        return self.agent.catalog.local_fd(path, size, mtime_ns)

    def do_action(self, context, action):
        with _errors_as_rpc():
            reply = actions.act(self.agent, action.type, action.body, _sender(context))
        yield fl.Result(reply.wire())

    def list_actions(self, context):
        return [(name, a.doc) for name, a in actions.ACTIONS.items()]

    def do_get(self, context, ticket):
        with _errors_as_rpc():
            entry, req = actions.parse_ticket(ticket.ticket)
            return fl.RecordBatchStream(entry.handler(self.agent, req))

    def do_put(self, context, descriptor, reader, writer):
        with _errors_as_rpc():
            req = rpc.parse_put(descriptor.command)
            reply = self.agent.intake.put(req, reader, _sender(context))
            writer.write(pa.py_buffer(reply.wire()))

    def shutdown(self):
        self.agent.stop()
        super().shutdown()
        self.agent.close()
        if self.socket_dir is not None:
            self.socket_dir.remove()


@contextlib.contextmanager
def _errors_as_rpc() -> Iterator[None]:
    """Whatever a handler raises leaves as an errno + message (never a bare traceback text)."""
    try:
        yield
    except fl.FlightError:
        raise
    except OSError as err:
        code = err.errno or errno.EIO
        raise rpc_error(code, err.strerror or str(err)) from None
    except OverflowError as err:    # a number past what the system call takes (rpc bounds them first)
        raise rpc_error(errno.EINVAL, f"a number is out of range: {err}") from None
    except Exception as err:
        log.exception("agent request failed")
        raise rpc_error(errno.EIO, f"internal error: {type(err).__name__}") from None


def start_in_process(store: Store, config: AgentConfig, *, peers: AgentsConfig | None = None,
                     follow: FollowConfig | None = None, transform_load: TransformLoadConfig | None = None,
                     clock: Clock = SYSTEM_CLOCK) -> tuple[AgentServer, str]:
    """The mount's own agent when no agents are configured: a thread serving a unix socket in a
    private 0700 folder (hintfs/agent/socketdir.py), so only the mount's own user can reach it."""
    sock_dir = socketdir.make()
    location = f"grpc+unix://{sock_dir.socket}"
    try:
        server = AgentServer(store, config, peers=peers, follow=follow, transform_load=transform_load,
                             location=location, clock=clock)
    except BaseException:
        sock_dir.remove()
        raise
    server.socket_dir = sock_dir
    # (it serves from its construction: no serve() thread, which only waits. pyarrow's serve()
    # keeps one process-wide "server being served": when one returns it shuts that one down,
    # which may be another server of this process by then)
    return server, location


def run_agent(config: AgentConfig, *, store: StoreConfig, spool_dir: str, peers: AgentsConfig,
              follow: FollowConfig, transform_load: TransformLoadConfig) -> int:
    """`hintfs agent`: the store of `[store]` (its spool under `spool_dir`), served until SIGTERM."""
    opened = open_store(store, spool_dir)
    check_store(opened, store)
    if not config.token_file and config.auth == "none":
        log.warning("agent at %s runs WITHOUT authentication ([agent] auth = \"none\"): anyone who can "
                    "reach it can read every file of %s", config.location, opened.description)
    open_files = raise_open_file_limit()   # before the catalog sizes its fd cache from it
    server = AgentServer(opened, config, peers=peers, follow=follow, transform_load=transform_load,
                         persistent=True, require_token=True)
    log.info("agent serving %s at %s (replicas in %s; up to %d open files, half for replicas read lately)", opened.description,
             config.location, config.data_dir, open_files)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=server.shutdown).start())
    sd_notify("READY=1")
    server.serve()
    return 0
