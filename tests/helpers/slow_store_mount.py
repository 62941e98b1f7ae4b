"""Mount a file:// store whose reads of files named `slow*` take SLOW_S seconds (test helper)."""
import sys
import time

from hintfs.stores.local import LocalReader, LocalStore
from fusefs.mount import run_mount
from mountconfig import load_config

SLOW_S = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0


class SlowReader(LocalReader):
    __slots__ = ()

    def read_nowait(self, offset, size):
        return None          # never a page-cache hit: every read goes to the store thread

    def read(self, offset, size):
        time.sleep(SLOW_S)   # a store that hangs on this file
        return super().read(offset, size)


class SlowStore(LocalStore):
    def open_reader(self, rel):
        reader, st = super().open_reader(rel)
        if rel.rsplit("/", 1)[-1].startswith("slow"):
            reader.__class__ = SlowReader
        return reader, st


if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    from urllib.parse import urlparse
    sys.exit(run_mount(cfg, sys.argv[2], store=SlowStore(urlparse(cfg.store.uri).path)))
