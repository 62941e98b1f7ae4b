"""`hintfs agent CONFIG`: run the storage agent (Arrow Flight) in this process, isolated
(`python -I` in `/`: hintfs.cli.main re-executes it first).

The agent's room is imported when the verb runs, so that every other verb starts quickly."""
from __future__ import annotations

import errno
import socket
from urllib.parse import urlparse

from hintfs.common.logsetup import setup_logging
from hintfs.cli.base import UserError, absolute_args, load_config


def add_parser(subparsers) -> None:
    a = subparsers.add_parser("agent", help="run a storage agent (Arrow Flight) on this node")
    a.add_argument("config", help="the host's config (TOML): its [store] and [agent] tables")
    a.set_defaults(func=cmd_agent, daemon=daemon_argv)


def daemon_argv(args) -> list[str]:
    """The command line that runs this agent again from `/` (hintfs.cli.main: daemons run isolated)."""
    return ["agent", *absolute_args(args, "config")]


def check_port_free(location: str) -> None:
    """A UserError now, in one line, if the TCP address of `location` is taken (gRPC would log
    its own lines to stderr and fail with 'Server did not start properly')."""
    url = urlparse(location)
    if not url.scheme.startswith("grpc") or url.scheme == "grpc+unix" or not url.port:
        return
    host = url.hostname or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, url.port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise UserError(f"[agent] location {location}: cannot resolve {host}: {err.strerror}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise UserError(f"[agent] location {location}: port {url.port} is in use (another agent?): "
                                    "stop that process or choose another port") from None
                # anything else (an address family this host lacks, ...): gRPC decides


def cmd_agent(args) -> int:
    from hintfs.agent.server import run_agent

    cfg = load_config(args.config)
    check_port_free(cfg.agent.location)
    setup_logging(cfg.logging.level, cfg.logging.file)
    # An OSError (the store, the data folder, the token file) is one line by hintfs.cli.errors:
    # `hintfs agent: store file:///x: the folder /x does not exist (...)`.
    return run_agent(cfg.agent, store=cfg.store, spool_dir=cfg.cache.spool_dir, peers=cfg.agents,
                     follow=cfg.follow, transform_load=cfg.transform_load)
