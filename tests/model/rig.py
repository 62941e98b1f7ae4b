"""Mounts for the model-based test: one store, one or two mounts of it with the cache timeouts
the model assumes (0: every open and stat asks the store), passthrough on or off. Used by
tests/model/test_model.py and bench/model_test.py."""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator

from tests.model.harness import Rig

CONFIG = """[store]
uri = "file://{store}"

[cache]
attr_timeout_s = 0
entry_timeout_s = 0
{immutable}
[mount]
passthrough = "{passthrough}"
{mount_extra}

[logging]
file = "{log}"
level = "INFO"
"""


def _mount(cfg: Path, mnt: Path) -> None:
    from hintfs.cli.mount import cmd_mount
    cmd_mount(argparse.Namespace(config=str(cfg), mountpoint=str(mnt), foreground=False, ready_fd=None))


def _umount(mnt: Path) -> None:
    import subprocess
    from hintfs.cli.umount import cmd_umount
    if os.path.ismount(mnt):
        try:
            cmd_umount(argparse.Namespace(mountpoint=str(mnt), timeout=None))
        except Exception:
            pass
    with open("/proc/self/mounts") as f:
        if any(line.split()[1] == str(mnt) for line in f):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def _remount_and_pids(mnts: list[Path], cfgs: list[Path]):
    """(remount(i), daemon_pid(i)) of a rig's mounts: a dead daemon's mount cannot answer, so
    each mount's daemon pid is remembered at its first question and at each remount."""
    pids: dict[int, int] = {}

    def ask(i: int) -> int:
        import json
        return json.loads((mnts[i] / ".hintfs" / "stats").read_text())["pid"]

    def remount(i: int) -> None:
        _umount(mnts[i])
        _mount(cfgs[i], mnts[i])
        pids[i] = ask(i)

    def pid_of(i: int) -> int:
        if i not in pids:
            pids[i] = ask(i)
        return pids[i]

    return remount, pid_of


def _fast_keys(fast_path: bool, reads: bool = False) -> dict[str, str]:
    """The config keys of a fast-path rig (`model_rig`, `model_rig_s3`): every path immutable, its
    folders listed for lookups at once, files marked ahead after one open; none otherwise. `reads`
    (nothing immutable): a folder's names registered, checked, after one open
    (docs/fastpath.md, "Checked names"), or the model's small folders would rarely meet them."""
    if not fast_path:
        return {"immutable": "", "mount_extra": "fast_opens_ahead = 1" if reads else ""}
    return {"immutable": 'immutable_globs = ["*"]\nrelist_quiet_s = 0', "mount_extra": "fast_opens_ahead = 1"}


@contextlib.contextmanager
def model_rig(mounts: int = 1, passthrough: bool = True, base: Path | None = None,
              fast_path: bool = False, reads: bool = False) -> Iterator[Rig]:
    """A store and `mounts` mounts of it; everything unmounted and removed at the end. With
    `fast_path`, every path is declared immutable, so that reopened files are answered by the
    fast path (fusefs/fastpath.py): meant for one mount, whose own changes the kernel sees (two
    mounts would each keep what the other changed, as the declaration allows). Its folders change
    all the time: they are listed for lookups at once (`relist_quiet_s = 0`) and their files marked
    ahead after one open (`fast_opens_ahead = 1`), or the model would meet neither."""
    own = base is None
    base = Path(tempfile.mkdtemp(prefix="hintfs-model-")) if base is None else base
    store = base / "store"
    store.mkdir(parents=True, exist_ok=True)
    mnts, cfgs = [], []
    try:
        for i in range(mounts):
            mnt = base / f"mnt{i}"
            mnt.mkdir(exist_ok=True)
            cfg = base / f"m{i}.toml"
            cfg.write_text(CONFIG.format(store=store, passthrough="auto" if passthrough else "off",
                                         log=base / f"m{i}.log",
                                         **_fast_keys(fast_path, reads)))
            _mount(cfg, mnt)
            mnts.append(mnt)
            cfgs.append(cfg)

        remount_and_forget, pid_of = _remount_and_pids(mnts, cfgs)

        yield Rig(store, mnts, passthrough, remount=remount_and_forget, daemon_pid=pid_of)
    finally:
        for mnt in mnts:
            _umount(mnt)
        if own:
            shutil.rmtree(base, ignore_errors=True)


# `model_rig_s3(listed=True)`: short, so that listed answers expire within a seed's steps.
LISTED_ATTR_TIMEOUT_S = 0.3

S3_CONFIG = """[store]
uri = "s3://{bucket}"
{keys}
[cache]
attr_timeout_s = {attr_timeout}
entry_timeout_s = 0
spool_dir = "{spool}"
{cache_dir}
{immutable}
[mount]
passthrough = "{passthrough}"
{mount_extra}

[logging]
file = "{log}"
level = "INFO"
"""


@contextlib.contextmanager
def model_rig_s3(mounts: int = 1, host_cache: bool = False, base: Path | None = None,
                 blocks: bool = False, fast_path: bool = False, listed: bool = False) -> Iterator[Rig]:
    """An S3 store (JuiceFS's S3 gateway on loopback) and `mounts` mounts of it; with `host_cache`,
    each mount has a `[cache] dir` (its writes then go by passthrough from the spool file, and
    complete files are read from the cache). `blocks` (with `host_cache`): no object is read whole
    at open (`whole_object_bytes = 0`) and fetches go by 64 KiB blocks, so the model's files
    (up to ~170 KB) are read from fetches in flight and their mapped blocks (docs/hostcache.md).
    `fast_path` (with `host_cache`, one mount): every path immutable, as `model_rig`'s, so that
    reopened objects are answered by the fast path and a folder's small objects are fetched ahead
    after one open (docs/fastpath.md, "Fetches ahead").
    `listed`: attributes are kept for LISTED_ATTR_TIMEOUT_S, so a `stat` of a name a listing
    returned is answered from that listing, and a folder whose listed answers expired is listed
    again (docs/semantics.md, the S3 stat row). One mount sees its own changes at once, so the
    model holds as it is."""
    from tests.helpers.s3server import JuiceFSGateway
    own = base is None
    base = Path(tempfile.mkdtemp(prefix="hintfs-model-s3-")) if base is None else base
    server = JuiceFSGateway(str(base / "s3")).start()
    bucket = "model"
    mnts, cfgs = [], []
    try:
        fs = server.filesystem()
        fs.create_dir(bucket)
        for i in range(mounts):
            mnt = base / f"mnt{i}"
            mnt.mkdir(exist_ok=True)
            cfg = base / f"m{i}.toml"
            cfg.write_text(S3_CONFIG.format(
                bucket=bucket, keys=server.store_keys('connect_timeout_s = 2\nrequest_timeout_s = 10\n'
                                                      + ("whole_object_bytes = 0\n" if blocks else "")),
                spool=base / f"spool{i}",
                cache_dir=(f'dir = "{base / f"hc{i}"}"' + ("\nfetch_block_bytes = 65536" if blocks else ""))
                if host_cache else "",
                passthrough="auto" if host_cache else "off", log=base / f"m{i}.log",
                attr_timeout=LISTED_ATTR_TIMEOUT_S if listed else 0, **_fast_keys(fast_path)))
            _mount(cfg, mnt)
            mnts.append(mnt)
            cfgs.append(cfg)

        def read_tree(folder: str) -> list[tuple[str, str, object]]:
            import pyarrow.fs as pafs
            out = []
            sel = pafs.FileSelector(f"{bucket}/{folder}", recursive=True, allow_not_found=True)
            for info in fs.get_file_info(sel):
                rel = info.path[len(f"{bucket}/{folder}/"):]
                if not rel or rel.rsplit("/", 1)[-1].startswith(".hintfs-tmp."):
                    continue
                if info.type == pafs.FileType.Directory:
                    out.append((rel, "dir", None))
                else:
                    with fs.open_input_stream(info.path) as f:
                        out.append((rel, "file", f.read()))
            return out

        def make_folder(folder: str) -> None:
            fs.create_dir(f"{bucket}/{folder}")

        def list_keys(folder: str) -> list[str]:
            """Every key and folder under `folder` as the bucket lists them (staging names too)."""
            import pyarrow.fs as pafs
            sel = pafs.FileSelector(f"{bucket}/{folder}", recursive=True, allow_not_found=True)
            return [info.path[len(f"{bucket}/{folder}/"):] for info in fs.get_file_info(sel)]

        from hintfs.stores.arrow import ArrowStore
        reader_store = ArrowStore(fs, bucket, str(base / "spool-rig"), "the rig's reader")

        def object_version(rel: str) -> tuple[tuple[int, int, str], bytes] | None:
            """The version of the object at `rel` (a store path) as the host cache tells versions
            (size, Last-Modified, ETag of the open's HEAD: `version_of`) and its bytes; None if
            the store has no object there."""
            from hintfs.stores.hostcache import version_of
            try:
                reader, st = reader_store.open_reader(rel)
            except (FileNotFoundError, IsADirectoryError):
                return None
            try:
                return version_of(reader, st), reader.read(0, st.size) if st.size else b""
            finally:
                reader.close()

        remount_and_forget, pid_of = _remount_and_pids(mnts, cfgs)

        yield Rig(base / "s3", mnts, host_cache, remount=remount_and_forget, daemon_pid=pid_of,
                  read_tree=read_tree, make_folder=make_folder, list_keys=list_keys,
                  object_version=object_version, spools=[base / f"spool{i}" for i in range(mounts)],
                  host_caches=[base / f"hc{i}" for i in range(mounts)] if host_cache else [])
    finally:
        for mnt in mnts:
            _umount(mnt)
        server.close()
        if own:
            shutil.rmtree(base, ignore_errors=True)


__all__ = ["model_rig", "model_rig_s3"]
