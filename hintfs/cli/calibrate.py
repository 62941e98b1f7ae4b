"""`hintfs calibrate --agent LOCATION --path RELPATH`: measure how many concurrent readers one
replica serves (sets replicas.safe_readers_per_replica)."""
from __future__ import annotations

import errno

from hintfs.agent.client import AgentClient
from hintfs.agent.rpc import MAX_READ_BYTES
from hintfs.common.secrets import read_tls_roots, read_token_file
from hintfs.calibrate import calibrate
from hintfs.cli.base import UserError
from hintfs.cli.errors import squash


def add_options(parser) -> None:
    """The options of `calibrate` (also on the hidden older spelling `hintfs hints calibrate - - ...`)."""
    parser.add_argument("--agent", metavar="LOCATION", help="the agent's Flight location, e.g. grpc://node:8815")
    parser.add_argument("--path", metavar="RELPATH", help="a file in the agent's store, relative to the store root")
    parser.add_argument("--size", type=int, default=None, help="the file's size in bytes (default: read it once)")
    parser.add_argument("--token-file", default=None, help="the agent's token file (its [agent] token_file)")
    parser.add_argument("--tls-root-file", default=None, help="the CA that signed a grpc+tls agent's certificate "
                        "(the mounts' [agents] tls_root_file)")
    parser.add_argument("--max-readers", type=int, default=256, help="the most readers to try (default 256)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per reader count (default 2)")
    parser.add_argument("--block", type=int, default=1 << 20, help="bytes per read (default 1 MiB)")


def add_parser(subparsers) -> None:
    cal = subparsers.add_parser("calibrate", help="measure the concurrent readers one replica serves "
                                "(sets replicas.safe_readers_per_replica)")
    add_options(cal)
    cal.set_defaults(func=cmd_calibrate)


def _probe_failure(args, err: OSError) -> str:
    where = f"the agent at {args.agent}"
    if err.errno in (errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ETIMEDOUT):
        return f"cannot reach {where}: is `hintfs agent` running there, and is the host:port right?"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{where} refused the request: give its token with --token-file (the agent's [agent] token_file)"
    if err.errno == errno.ENOENT:
        return f"{where} has no file {args.path} in its store: give --path relative to the store root"
    return f"cannot read {args.path} from {where}: {squash(err.strerror or str(err))}"


def cmd_calibrate(args) -> int:
    if not args.agent or not args.path:
        raise UserError("calibrate needs --agent LOCATION --path RELPATH (a file in the store)")
    if "://" not in args.agent:
        raise UserError(f"--agent {args.agent}: a location has a scheme, e.g. grpc://{args.agent}")
    token = read_token_file(args.token_file) if args.token_file else None   # HintfsError: one line
    # One read first: an unreachable agent, a refused token or a missing file is an error here,
    # not a table of zero reads per second.
    tls_root = read_tls_roots(args.tls_root_file) if args.tls_root_file else None
    probe = AgentClient(args.agent, token=token, tls_root=tls_root, timeout_s=10.0)
    try:
        first = probe.read(args.path, 0, MAX_READ_BYTES if args.size is None else 1)
    except OSError as err:
        raise UserError(_probe_failure(args, err)) from None
    finally:
        probe.close()
    size = len(first) if args.size is None else args.size
    result = calibrate(args.agent, args.path, size, args.max_readers, args.seconds, args.block, token, tls_root)
    for row in result["levels"]:
        print(f"{row['readers']:>5} readers: {row['reads_per_s']:>9.1f} reads/s  p50 {row['p50_ms']:.2f} ms"
              f"  p99 {row['p99_ms']:.2f} ms")
    print(f"safe_readers_per_replica = {result['safe_readers_per_replica']}")
    return 0
