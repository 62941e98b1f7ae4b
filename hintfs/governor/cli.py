"""Entry point of `hintfs governor CONFIG` (called lazily by hintfs.cli, once the command runs
isolated in `/`; `python -m hintfs.governor.cli CONFIG` re-executes itself so first)."""

from __future__ import annotations

import logging
import sys

from mountconfig.governor import GovernorConfigError, load_governor_config


def main(config_path: str) -> int:
    try:
        cfg = load_governor_config(config_path)
    except GovernorConfigError as e:
        print(f"hintfs governor: {e}", file=sys.stderr)
        return 2
    # To stderr (the journal under systemd), at the config's level: this replaces the WARNING-only
    # logging `hintfs` sets up for its short-lived verbs, so the start and stop lines show.
    # One line per event: no name a client gave starts a log line of its own.
    from hintfs.common.logsetup import setup_logging
    setup_logging(cfg.log_level, None)
    import trio

    from hintfs.governor.daemon import DaemonStartError, GovernorDaemon

    daemon = GovernorDaemon(cfg)
    try:
        daemon.open()
    except (DaemonStartError, OSError) as e:
        print(f"hintfs governor: {e}", file=sys.stderr)
        return 1
    if cfg.metrics_port is not None:
        from hintfs.governor.metrics import start_metrics
        start_metrics(cfg.metrics_port, daemon)
    try:
        trio.run(_serve_until_signal, daemon)
    except KeyboardInterrupt:
        pass
    finally:
        daemon.close()  # removes the socket (its lock files and restart record stay)
    return 0


async def _serve_until_signal(daemon) -> None:
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.serve)
            async for sig in signals:
                logging.getLogger("hintfs.governor").info("%s: shutting down", signal.Signals(sig).name)
                nursery.cancel_scope.cancel()
                break


if __name__ == "__main__":  # python -m hintfs.governor.cli CONFIG
    if len(sys.argv) != 2:
        print("usage: python -m hintfs.governor.cli CONFIG", file=sys.stderr)
        sys.exit(2)
    from hintfs.common.procs import absolute_paths, become_isolated_daemon

    (config,) = absolute_paths(sys.argv[1])
    become_isolated_daemon("hintfs.governor.cli", [config])     # python -I, in / (docs/security.md)
    sys.exit(main(config))
