"""A worker process of the model-based test (tests/model/harness.py): it holds its own file
descriptors and runs one filesystem call per request, so the harness can interleave several
processes' calls at operation boundaries (a seed replays exactly).

Protocol: one JSON document per line on stdin, one per line on stdout. A request is
`{"op": NAME, "args": [...]}`; the answer `{"ok": VALUE}` or `{"err": ERRNO}`. Bytes travel as
base64 (`{"b64": "..."}`). Run isolated (`python -I tests/model/worker.py`): it imports nothing
of the repository."""
from __future__ import annotations

import base64
import errno
import json
import mmap
import os
import sys


def _enc(value):
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [_enc(v) for v in value]
    return value


def _dec(value):
    if isinstance(value, dict) and "b64" in value:
        return base64.b64decode(value["b64"])
    if isinstance(value, list):
        return [_dec(v) for v in value]
    return value


def _mmap_write(fd: int, off: int, data: bytes) -> int:
    """Write `data` at `off` through a shared mapping of the file (it must be that long), msync."""
    import fcntl
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise OSError(errno.EACCES, "a shared writable mapping needs O_RDWR")
    size = os.fstat(fd).st_size
    if off + len(data) > size or not data:
        raise OSError(errno.EINVAL, "outside the file")
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[off:off + len(data)] = data
        m.flush()
    return len(data)


def _stat(path: str):
    st = os.lstat(path)
    return [st.st_mode, st.st_size, st.st_nlink]


def _readdir(path: str):
    return sorted(os.listdir(path))


def _read_tree(root: str):
    """Every entry under `root` as [relpath, kind, data or target] (the store, read directly)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            r = name if rel == "." else f"{rel}/{name}"
            if os.path.islink(p):
                out.append([r, "symlink", os.readlink(p)])
            elif os.path.isdir(p):
                out.append([r, "dir", None])
            else:
                with open(p, "rb") as f:
                    out.append([r, "file", f.read()])
    return out


OPS = {
    "open": lambda path, flags: os.open(path, flags, 0o644),
    "close": os.close,
    "dup": os.dup,
    "write": os.write,
    "pwrite": lambda fd, data, off: os.pwrite(fd, data, off),
    "pread": lambda fd, n, off: os.pread(fd, n, off),
    "read": os.read,
    "lseek": os.lseek,
    "ftruncate": os.ftruncate,
    "fsync": os.fsync,
    "fstat_size": lambda fd: os.fstat(fd).st_size,
    "mmap_write": _mmap_write,
    "truncate": os.truncate,
    "rename": os.rename,
    "unlink": os.unlink,
    "mkdir": lambda p: os.mkdir(p, 0o755),
    "rmdir": os.rmdir,
    "link": os.link,
    "symlink": os.symlink,
    "readlink": os.readlink,
    "chmod": os.chmod,
    "utime": lambda p, ns: os.utime(p, ns=tuple(ns), follow_symlinks=False),
    "stat": _stat,
    "readdir": _readdir,
    "read_tree": _read_tree,
    "read_file": lambda p: open(p, "rb").read(),
}


def main() -> None:
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        try:
            value = OPS[req["op"]](*_dec(req["args"]))
            answer = {"ok": _enc(value)}
        except OSError as err:
            answer = {"err": err.errno or errno.EIO}
        except (ValueError, KeyError, TypeError) as err:   # the harness's own mistake
            answer = {"bug": repr(err)}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
