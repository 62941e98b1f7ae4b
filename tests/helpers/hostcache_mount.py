"""Mount a remote store behind the host cache, wired the way the mount daemon wires it (test
helper: `python tests/helpers/hostcache_mount.py CONFIG MOUNTPOINT`, in the foreground).

The store is `open_store(..., cfg.cache)` (the host cache when `[cache] dir` is set), its counters
are attached to the mount's stats, and it is closed after unmount. Used by the mount tests
where `hintfs mount` does not wire the host cache itself."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common.logsetup import setup_logging  # noqa: E402
from fusefs import mount as fmount  # noqa: E402
from mountconfig import load_config  # noqa: E402
from stores import open_store  # noqa: E402

if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    setup_logging(cfg.logging.level, cfg.logging.file)
    store = open_store(cfg.store, cfg.cache.spool_dir, cfg.cache)
    assemble = fmount.assemble

    def assemble_with_counters(cfg, store):
        mount = assemble(cfg, store)
        attach = getattr(store, "attach_stats", None)
        if attach is not None:
            attach(mount.stats)
        return mount

    fmount.assemble = assemble_with_counters
    try:
        status = fmount.run_mount(cfg, sys.argv[2], store=store)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    sys.exit(status)
