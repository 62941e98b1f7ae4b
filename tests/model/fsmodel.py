"""A reference model of docs/semantics.md for the model-based test (tests/model/harness.py).

Pure Python, no I/O. It knows what the documents promise, not how the code does it:

- The store holds files as *inodes* (content and mode) under paths, folders and symlinks. A reader
  of a store file holds that inode: a later publish (a rename over the path) does not change what
  it reads, as on a local disk.
- Each mount has at most one *writer* per path: the staging inode every descriptor opened for
  writing on that mount shares (read-your-writes). The publish rule ("The publish rule" in
  docs/semantics.md): every close of a descriptor after a change, every fsync, a rename of the open
  file on the same mount, and the last release publish the writer's whole content to its path;
  a writer whose file was unlinked on its mount never publishes. Two mounts know nothing of each
  other's writers: the last publish wins.
- Close-to-open across mounts: the harness runs its mounts with `attr_timeout_s = 0` and
  `entry_timeout_s = 0`, so every open and stat sees the store as it is (the model has no
  timeouts to wait out).
- Names: a file a mount is writing is visible by name on that mount (lookup, stat, open) before
  it is published, but listed only once published. A folder holding a file still being written
  through any mount (its staging file, beside the target on `file://`) is not empty.

Out of the model's scope, with why (docs/semantics.md, "The model-based test", lists them too):
hard links (one inode per file on a mount; tested by their own tests), times (utimens is run,
its values are not compared: the daemon's clock and the kernel's), special files, ownership
(one user), extended attributes (unsupported), page-cache timing of other mounts beyond
close-to-open.
"""
from __future__ import annotations

import errno
import itertools
import posixpath
from dataclasses import dataclass, field

_ino_ids = itertools.count(1)


@dataclass(eq=False)
class Ino:
    """A file's content: the store's, or a mount's staging."""
    data: bytearray = field(default_factory=bytearray)
    mode: int = 0o644
    id: int = field(default_factory=lambda: next(_ino_ids))
    moves: int = 0     # renames in an object store (each a copy: a new Last-Modified, or the same second's)

    def copy(self) -> Ino:
        return Ino(bytearray(self.data), self.mode)

    def __repr__(self) -> str:
        return f"Ino(#{self.id}, {len(self.data)} bytes, {self.mode:o})"


DIR = "dir"


@dataclass(frozen=True)
class Symlink:
    target: str


Entry = Ino | str | Symlink


@dataclass(eq=False)
class Writer:
    """A mount's staging of one path, shared by every write descriptor of that path on the mount."""
    path: str                    # where it publishes (follows renames made through its own mount)
    staging: Ino
    refs: int = 0                # open write descriptions (opens), not descriptors
    dirty: bool = True           # changed since the last publish (a new or truncated file is)
    live: bool = False           # the staging *is* the published inode (file://, after a rename)
    unlinked: bool = False
    failed: bool = False         # a close failed: these bytes are never published
    # written through the daemon on a mount with passthrough (S3 with a host cache: a reader the
    # daemon serves was open on the file when this writer was made; the kernel serves one inode
    # one way): the daemon sees every write, so an untouched writer publishes nothing
    by_daemon: bool = False


@dataclass(eq=False)
class OFD:
    """An open file description (what `dup` shares): its mount, path and how it was opened."""
    mount: int
    path: str
    readable: bool
    writable: bool
    append: bool
    offset: int = 0
    writer: Writer | None = None   # write descriptions: the mount's writer they share
    # read-only descriptions: the inode read, or the writer followed (the mount's writer of the
    # file when it was opened: its staging while it lives, then what it left)
    bound: Ino | None = None
    follow: Writer | None = None
    refs: int = 1               # descriptors (fds) of this description
    released: bool = False
    # its name left the mount (unlinked, or renamed over, through that mount): the kernel's file of
    # this description is no longer the one the mount shows at `path`
    detached: bool = False
    node_writer: Writer | None = None   # the writer of the same file when it was detached
    key: str = ""               # the name it was opened by (an object store reads that key)
    moves_at_open: int = 0      # its object's `Ino.moves` when it was opened
    # an object-store reader whose object was renamed (a copy and a delete; away and back, so its
    # key holds it again) between its open and this mount's writer of the name: whether that
    # writer's file is the reader's is timing's (a new Last-Modified second or not, as another
    # mount sees it), so what it reads and its fstat are unspecified (the model does not tell
    # which mount renamed it: for this mount's own renames that is broader than needed)
    unsure: bool = False



class _Fail(Exception):
    """An operation the model says fails with `code` (a publish or a staging that cannot be made)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Divergence(AssertionError):
    """The system did something the model says it must not."""


def err(code: int) -> tuple[str, int]:
    return ("err", code)


def ok(value=None) -> tuple[str, object]:
    return ("ok", value)


class Model:
    def __init__(self, mounts: int, passthrough: bool, local_store: bool = True):
        self.store: dict[str, Entry] = {}
        self.writers: list[dict[str, Writer]] = [{} for _ in range(mounts)]
        self.passthrough = passthrough
        self.local_store = local_store     # file://: staging beside the target, publish by rename
        self.ofds: dict[int, OFD] = {}     # harness handle -> description
        self._opened_object: dict[int, object] = {}   # id(read description) -> the store object it opened
        self._ofd_ids = itertools.count(1)

    # -- names ------------------------------------------------------------------------------------
    @staticmethod
    def parent(path: str) -> str:
        return posixpath.dirname(path)

    def _dir_exists(self, path: str) -> bool:
        return path == "" or self.store.get(path) == DIR

    def _resolve(self, path: str, m: int = 0) -> tuple[str | None, int | None]:
        """Follow a final symlink (the kernel does, in the reader's namespace) up to 8 times; a
        name the mount is writing is that file, whatever the store holds there."""
        for _ in range(8):
            e = self.view(m, path)
            if not isinstance(e, Symlink):
                return path, None
            path = posixpath.normpath(posixpath.join(self.parent(path), e.target))
        return None, errno.ELOOP

    def view(self, m: int, path: str) -> Entry | None:
        """What mount `m` finds at `path`: its own writer's staging, else the store's entry."""
        w = self.writers[m].get(path)
        if w is not None and not w.unlinked:
            return w.staging
        return self.store.get(path)

    def _staging_in(self, folder: str, m: int) -> bool:
        """A file being written lies in `folder`, so it is not empty: a file mount `m` has open for
        writing there (the mount's own view, on any store: docs/semantics.md), or on file:// any
        mount's staging file not published yet (it lies beside its target)."""
        for i, ws in enumerate(self.writers):
            for p, w in ws.items():
                if self.parent(p) == folder and not w.unlinked and (i == m or (self.local_store and not w.live)):
                    return True
        return False

    def listing(self, folder: str) -> list[str]:
        n = len(folder) + 1 if folder else 0
        return sorted(p[n:] for p in self.store if self.parent(p) == folder)

    # -- publish ----------------------------------------------------------------------------------
    def publish(self, w: Writer, closing: bool) -> None:
        """Raises _Fail(EIO) when the publish fails: the store keeps its previous version, and the
        writer's later changes are never published either (a close failed: docs/semantics.md)."""
        if w.unlinked:
            w.dirty = False
            return
        if w.failed:
            raise _Fail(errno.EIO)   # a close failed: every later one fails too, nothing is published
        if not w.dirty:
            return
        path = w.path
        if self.local_store and not self._dir_exists(self.parent(path)):
            w.failed = True      # (its folder was removed or renamed away by another mount)
            raise _Fail(errno.EIO)
        w.dirty = False
        if w.live:
            # published in place (passthrough) and written there since: nothing moves, unless the
            # name holds another file by now, which this one replaces again, whole, by copy
            if self.store.get(path) is not w.staging:
                self.store[path] = w.staging.copy()
                self._name_replaced(w)
            return
        if self.passthrough and self.local_store:
            keep = w.refs - (1 if closing else 0) > 0
            if keep:
                self.store[path] = w.staging.copy()
            else:
                self.store[path] = w.staging
                w.live = True
        elif self.local_store:
            self.store[path] = w.staging
            w.live = True
        else:
            self.store[path] = w.staging.copy()
            # an object's key makes its folders (object stores have no folders of their own)
            folder = self.parent(path)
            while folder and folder not in self.store:
                self.store[folder] = DIR
                folder = self.parent(folder)

    def _name_replaced(self, w: Writer) -> None:
        """`w`, published in place and no longer the file its mount shows at its name (a new open
        took the name: "the new open gets its own file"), just replaced the name again by copy. As
        with a rename over the name through that mount, the readers open there on the file the name
        held keep that file, and their fstat is of it; a writer the mount has at the name keeps
        the name (its publish comes later)."""
        m = next((o.mount for o in self.ofds.values() if o.writer is w), None)
        if m is None or self.writers[m].get(w.path) is not None:
            return
        for o in self.ofds.values():
            if o.mount == m and o.path == w.path and o.writer is None and o.follow is None \
                    and not o.detached and o.bound is not w.staging:
                o.detached, o.node_writer = True, None

    def _private(self, w: Writer) -> None:
        """Before a write through the daemon after a publish: the staging is copied (the published
        file never changes). With passthrough the kernel writes the staging itself: not copied."""
        if w.live and not self.passthrough:
            if self.local_store and not w.unlinked and not self._dir_exists(self.parent(w.path)):
                raise _Fail(errno.ENOENT)   # the copy is staged beside the target: its folder is gone
            # (a file whose name is gone gets a nameless copy)
            w.staging = w.staging.copy()
            w.live = False

    def _changed(self, w: Writer) -> None:
        w.dirty = True

    # -- operations (each returns ("ok", value) or ("err", errno)) --------------------------------
    def _indistinct(self, o: OFD, e: Entry | None) -> bool:
        """`o`, a reader bound to one object, and `e`, the object at its name now, are two objects
        the mount cannot tell apart on an object store: the same bytes (the same size and ETag) and
        maybe the same Last-Modified second (docs/semantics.md, "Object stores in the model")."""
        mine = o.bound
        return (not self.local_store and o.follow is None and isinstance(mine, Ino) and isinstance(e, Ino)
                and mine is not e and mine.data == e.data)

    def renew_unsure(self, m: int, path: str) -> bool:
        """Whether an open of `path` on mount `m` now finds readers open there on an object the
        mount may or may not tell from the one at the name (`_indistinct`): whether it gives the
        name a new inode is the system's to say (`open(renewed=...)`, from its `opens_renewed`)."""
        if self.writers[m].get(path) is not None:
            return False
        e = self.store.get(path)
        return any(o.mount == m and o.path == path and o.writer is None and not o.detached and self._indistinct(o, e)
                   for o in self.ofds.values())

    def open(self, m: int, path: str, flags: int, served_by_daemon: bool = False,
             renewed: bool | None = None) -> tuple:
        """`served_by_daemon`: with a host cache, readers are served by passthrough only once the
        file is complete in the cache (a matter of timing): the harness says whether the system
        refused a writer for a conflict (ETXTBSY) or not. `renewed` (where `renew_unsure`): whether
        the system took the object at the name for another file than its open readers' (else they
        stay on the name's inode, as if it were theirs)."""
        import os
        acc = flags & os.O_ACCMODE
        if flags & os.O_CREAT and flags & os.O_EXCL and self._dir_exists(self.parent(path)) \
                and self.view(m, path) is not None:
            return err(errno.EEXIST)          # (a symlink there is not followed)
        path2, code = self._resolve(path, m)
        if code:
            return err(code)
        path = path2
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        e = self.view(m, path)
        if e == DIR:
            if acc != os.O_RDONLY:
                return err(errno.EISDIR)
            return err(errno.EISDIR)      # the harness never opens folders for reading
        if e is not None and flags & os.O_CREAT and flags & os.O_EXCL:
            return err(errno.EEXIST)
        if e is None and not flags & os.O_CREAT:
            return err(errno.ENOENT)
        writable = acc in (os.O_WRONLY, os.O_RDWR)
        readable = acc in (os.O_RDONLY, os.O_RDWR)
        ofd = OFD(m, path, readable, writable, bool(flags & os.O_APPEND), key=path)
        ws = self.writers[m]
        if ws.get(path) is None:
            # Close-to-open on one page cache per file and mount: descriptors open here on an
            # older file than the store now has at the name keep it, on a file of their own.
            for o in self.ofds.values():
                if o.mount == m and o.path == path and o.writer is None and not o.detached:
                    mine = o.follow.staging if o.follow is not None else o.bound
                    if mine is not e and not (renewed is False and self._indistinct(o, e)):
                        o.detached, o.node_writer = True, None
        if writable or flags & os.O_TRUNC:
            w = ws.get(path)
            if w is not None and w.live and self.passthrough:
                # published in place, a dup may still write there: the new open gets its own file
                # (the name is looked up again: the store's file, if it still has one)
                del ws[path]
                self._detach(m, path, w)
                w = None
                e = self.store.get(path)
                if e is not None and not isinstance(e, Ino):
                    # another mount put a symlink or a folder there: the open is of what the
                    # name now holds, resolved like any other (a loop is ELOOP)
                    return self.open(m, path, flags, served_by_daemon)
                if e is None and not flags & os.O_CREAT:
                    return err(errno.ENOENT)
            if w is None and self.passthrough and not served_by_daemon and any(
                    o.mount == m and o.path == path and o.writer is None and not o.detached
                    for o in self.ofds.values()):
                # The kernel serves every open file of one inode from one backing file: a reader
                # of the store file is open, so a writer (its staging) cannot be (docs/semantics.md)
                return err(errno.ETXTBSY)
            if w is None:
                by_daemon = self.passthrough and not self.local_store and any(
                    o.mount == m and o.path == path and o.writer is None and not o.detached
                    for o in self.ofds.values())
                if e is None:
                    w = Writer(path, Ino(), by_daemon=by_daemon)
                else:
                    # An existing file: its content; with passthrough the daemon cannot tell
                    # whether the kernel wrote it, so it publishes at the first close anyway.
                    w = Writer(path, e.copy() if isinstance(e, Ino) else Ino(),
                               dirty=self.passthrough and not by_daemon, by_daemon=by_daemon)
                ws[path] = w
            if flags & os.O_TRUNC:
                try:
                    self._private(w)
                except _Fail as f:
                    if w.refs == 0:
                        del ws[path]
                    return err(f.code)
                w.staging.data.clear()
                self._changed(w)
            w.refs += 1
            ofd.writer = w
            for other in self.ofds.values():
                # every open file of the file on this mount reads what the mount stages (one
                # file, one page cache per mount): readers opened before the writer too
                if other.mount == m and other.path == path and other.writer is None and not other.detached:
                    other.follow = w
                    if other.bound is not None and other.bound.moves != other.moves_at_open:
                        other.unsure = True
        else:
            w = ws.get(path)
            if w is not None:
                if self.passthrough and not w.by_daemon:
                    ofd.bound = w.staging
                else:
                    ofd.follow = w
            else:
                ofd.bound = e
                ofd.moves_at_open = e.moves
                self._opened_object[id(ofd)] = e
        h = next(self._ofd_ids)
        self.ofds[h] = ofd
        return ok(h)

    def _ofd(self, h: int) -> OFD:
        return self.ofds[h]

    def _content(self, ofd: OFD) -> Ino:
        if ofd.writer is not None:
            return ofd.writer.staging
        w = ofd.follow
        if w is not None:
            # Read-your-writes on one mount: the reader reads what the mount's current writer of
            # the file has staged, whichever open wrote it; with none, what the last one left
            # (the mount keeps it for the readers still open: a later rename or unlink of the
            # name does not change what they read).
            if ofd.detached:
                return (ofd.node_writer or w).staging
            current = self.writers[ofd.mount].get(ofd.path)
            if current is not None:
                ofd.follow = current
                return current.staging
            return w.staging
        assert ofd.bound is not None
        return ofd.bound

    def _readable_end(self, ofd: OFD, content: Ino) -> int:
        """Where reads of a description end. The kernel keeps one size per file on a mount and
        asks the mount for it before a read (attr_timeout 0): a reader holding an older file than
        the mount now shows reads its own bytes, but no further than the current size."""
        if ofd.writer is None and not self.passthrough:   # (passthrough reads: the backing file's size)
            size = self._node_size(ofd, content)
            if size is not None:
                return min(len(content.data), size)
        return len(content.data)

    def _object_gone(self, ofd: OFD) -> tuple | None:
        """Object stores read an open file by its key (ranged GETs): once the store holds another
        object there, or none, the open file's reads are the new object's or ENOENT
        (docs/semantics.md, "Object stores")."""
        if ofd.unsure:
            return ("any", None)
        if self.local_store or ofd.writer is not None or ofd.follow is not None:
            return None
        cur = self.store.get(ofd.key)
        if cur is ofd.bound or ofd.bound is not self._opened_object.get(id(ofd)):
            return None      # (a reader of a writer's staging reads that file)
        # unspecified: the new object's bytes (within the size seen at open), the end of the file,
        # or ENOENT; with the host cache a complete file is read from its local copy
        return ("any", None)

    def _timing_dependent(self, ofd: OFD, content: Ino) -> bool:
        """With a host cache, a reader is served by passthrough only once its file is complete in
        the cache (timing): whether the kernel clamps its reads to the mount's current size of the
        file (the daemon's path) or not (passthrough) is not the model's to say."""
        if self.local_store or not self.passthrough or ofd.writer is not None:
            return False
        size = self._node_size(ofd, content)
        return size is not None and size != len(content.data)

    def pread(self, h: int, n: int, off: int) -> tuple:
        ofd = self._ofd(h)
        if not ofd.readable:
            return err(errno.EBADF)
        gone = self._object_gone(ofd)
        if gone is not None:
            return gone
        content = self._content(ofd)
        if self._timing_dependent(ofd, content):
            return ("any", None)
        end = min(off + n, self._readable_end(ofd, content))
        return ok(bytes(content.data[off:end]))

    def read(self, h: int, n: int) -> tuple:
        ofd = self._ofd(h)
        if not ofd.readable:
            return err(errno.EBADF)
        gone = self._object_gone(ofd)
        if gone is not None:
            return gone
        content = self._content(ofd)
        if self._timing_dependent(ofd, content):
            return ("any", None)
        end = min(ofd.offset + n, self._readable_end(ofd, content))
        data = bytes(content.data[ofd.offset:end])
        ofd.offset += len(data)
        return ok(data)

    def _write_at(self, ofd: OFD, data: bytes, off: int | None) -> tuple:
        w = ofd.writer
        if w is None:
            return err(errno.EBADF)
        try:
            self._private(w)
        except _Fail as f:
            return err(f.code)
        buf = w.staging.data
        if off is None:
            off = len(buf) if ofd.append else ofd.offset
            ofd.offset = off + len(data)
        elif ofd.append:
            off = len(buf)          # Linux: pwrite on an O_APPEND file appends
        if len(buf) < off:
            buf.extend(b"\0" * (off - len(buf)))
        buf[off:off + len(data)] = data
        self._changed(w)
        return ok(len(data))

    def write(self, h: int, data: bytes) -> tuple:
        return self._write_at(self._ofd(h), data, None)

    def pwrite(self, h: int, data: bytes, off: int) -> tuple:
        return self._write_at(self._ofd(h), data, off)

    def mmap_write(self, h: int, off: int, data: bytes) -> tuple:
        ofd = self._ofd(h)
        w = ofd.writer
        if w is None or not ofd.readable:
            return err(errno.EACCES)
        if off + len(data) > len(w.staging.data) or not data:
            return err(errno.EINVAL)
        if ofd.append:
            return err(errno.EINVAL)
        result = self._write_at(ofd, data, off)
        # msync(MS_SYNC) is an fsync of the file, which publishes; under passthrough the mapping
        # is the backing file's and msync never reaches the mount. Python's mmap holds a dup of
        # the descriptor: closing the map is a close(2), a FLUSH, which publishes either way.
        try:
            if not self.passthrough:
                self.publish(w, closing=False)
        except _Fail as f:
            return err(f.code)
        try:
            self.publish(w, closing=True)
        except _Fail:
            pass                     # (Python's mmap does not report its close)
        return result

    def ftruncate(self, h: int, size: int) -> tuple:
        ofd = self._ofd(h)
        w = ofd.writer
        if w is None:
            return err(errno.EINVAL)
        try:
            self._private(w)
        except _Fail as f:
            return err(f.code)
        data = w.staging.data
        if size < len(data):
            del data[size:]
        else:
            data.extend(b"\0" * (size - len(data)))
        self._changed(w)
        return ok()

    def fsync(self, h: int) -> tuple:
        ofd = self._ofd(h)
        if ofd.writer is not None:
            try:
                self.publish(ofd.writer, closing=False)
            except _Fail as f:
                return err(f.code)
        return ok()

    def advance(self, h: int, n: int) -> None:
        """A read the model did not predict returned `n` bytes: the description's offset moves."""
        self._ofd(h).offset += n

    def fstat_size(self, h: int) -> tuple:
        """fstat asks the mount for the file's attributes (FUSE has no per-descriptor ones): a
        reader sees the mount's current view of its file's name (a writer's staged size on that
        mount), while its reads keep the content it opened."""
        ofd = self._ofd(h)
        if ofd.unsure:
            return ("any", None)
        if not self.local_store and ofd.writer is None and ofd.follow is None and (
                (not ofd.detached and self.view(ofd.mount, ofd.path) is None) or self._object_gone(ofd)):
            # an object store's reader has no local file to stat once the object it opened is gone,
            # whoever removed it or took its key (this mount too: an unlink or a rename over it)
            return ("any", None)
        content = self._content(ofd)
        if ofd.writer is None:
            size = self._node_size(ofd, content)
            if size is not None:
                return ok(size)
        return ok(len(content.data))

    def dup(self, h: int) -> tuple:
        ofd = self._ofd(h)
        ofd.refs += 1
        return ok(h)        # the harness keeps one handle per description, counting its fds

    def close(self, h: int) -> tuple:
        ofd = self._ofd(h)
        ofd.refs -= 1
        w = ofd.writer
        result = ok()
        if w is not None:
            # Every close(2) is a FLUSH, and the mount cannot tell the last one of a description
            # (`closing`: this open is taken as done writing; a dup may still write, in place).
            try:
                self.publish(w, closing=True)
            except _Fail as f:
                result = err(f.code)
            if ofd.refs == 0:
                w.refs -= 1
                if w.refs == 0:
                    try:
                        self.publish(w, closing=False)   # the last release: nobody to tell
                    except _Fail:
                        pass
                    if self.writers[ofd.mount].get(w.path) is w:
                        del self.writers[ofd.mount][w.path]
        if ofd.refs == 0:
            ofd.released = True
            del self.ofds[h]
        return result

    # -- namespace --------------------------------------------------------------------------------
    def stat(self, m: int, path: str) -> tuple:
        """(kind, size, mode) of lstat: 'file', 'dir' or 'symlink'."""
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        e = self.view(m, path)
        if e is None:
            return err(errno.ENOENT)
        if e == DIR:
            return ok(("dir", None, None))
        if isinstance(e, Symlink):
            return ok(("symlink", len(e.target), None))
        assert isinstance(e, Ino)
        return ok(("file", len(e.data), e.mode))

    def readdir(self, m: int, path: str) -> tuple:
        if path and self.store.get(path) != DIR:
            return err(errno.ENOENT if path not in self.store else errno.ENOTDIR)
        return ok(self.listing(path))

    def mkdir(self, m: int, path: str) -> tuple:
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        if self.view(m, path) is not None:
            return err(errno.EEXIST)
        self.store[path] = DIR
        return ok()

    def rmdir(self, m: int, path: str) -> tuple:
        e = self.store.get(path)
        if e is None:
            return err(errno.ENOENT)
        if e != DIR:
            return err(errno.ENOTDIR)
        if self.listing(path) or self._staging_in(path, m):
            return err(errno.ENOTEMPTY)
        del self.store[path]
        return ok()

    def unlink(self, m: int, path: str) -> tuple:
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        w = self.writers[m].get(path)
        e = self.store.get(path)
        if e == DIR:
            return err(errno.EISDIR)
        if e is None and w is None:
            return err(errno.ENOENT)
        self.store.pop(path, None)
        self._detach(m, path, w)
        if w is not None:
            w.unlinked = True          # never published; its descriptors keep working
            del self.writers[m][path]
        self._end_still_named(m, path)
        return ok()

    def _end_still_named(self, m: int, path: str) -> None:
        """The name went through mount `m` (unlinked, or renamed over): the writers of a file
        published in place there whose name a new open took since (`open`: "the new open gets its
        own file") no longer publish to it."""
        for ofd in self.ofds.values():
            w = ofd.writer
            if ofd.mount == m and w is not None and w.path == path and not w.unlinked \
                    and self.writers[m].get(path) is not w:
                w.unlinked = True

    def _detach(self, m: int, path: str, w: Writer | None) -> None:
        for ofd in self.ofds.values():
            if ofd.mount == m and ofd.path == path and not ofd.detached:
                ofd.detached, ofd.node_writer = True, w

    def _node_size(self, ofd: OFD, content: Ino) -> int | None:
        """The size the kernel has for the file of a read-only description: the mount's view of its
        name while attached; once detached, its file's writer's (the same file), else its own."""
        if ofd.detached:
            # (the mount keeps an unlinked file's staging while any descriptor of it is open)
            w = ofd.node_writer
            return len(w.staging.data) if w is not None else None
        e = self.view(ofd.mount, ofd.path)
        return len(e.data) if isinstance(e, Ino) and e is not content else None

    def symlink(self, m: int, target: str, path: str) -> tuple:
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        if self.view(m, path) is not None:
            return err(errno.EEXIST)
        if not self.local_store:
            return err(errno.EPERM)      # object stores have no symlinks (docs/semantics.md)
        self.store[path] = Symlink(target)
        return ok()

    def readlink(self, m: int, path: str) -> tuple:
        if not self._dir_exists(self.parent(path)):
            return err(errno.ENOENT)
        e = self.view(m, path)
        if e is None:
            return err(errno.ENOENT)
        if not isinstance(e, Symlink):
            return err(errno.EINVAL)
        return ok(e.target)

    def chmod(self, m: int, path: str, mode: int) -> tuple:
        p, code = self._resolve(path, m)
        if code:
            return err(code)
        if not self._dir_exists(self.parent(p)):
            return err(errno.ENOENT)
        e = self.view(m, p)
        if e is None:
            return err(errno.ENOENT)
        if not self.local_store:
            return err(errno.EPERM)      # object stores have no modes to change
        if isinstance(e, Ino):
            e.mode = mode
            s = self.store.get(p)
            if isinstance(s, Ino):
                s.mode = mode
        return ok()

    def utime(self, m: int, path: str) -> tuple:
        if not self._dir_exists(self.parent(path)) or self.view(m, path) is None:
            return err(errno.ENOENT)
        w = self.writers[m].get(path)
        if w is not None and self.passthrough and not w.by_daemon:
            # the times are set on the staging file too; under passthrough the mount tells a
            # change by (size, mtime): the next close publishes the file again (any store: on S3
            # the host cache's writers are passthrough's too)
            w.dirty = True
        return ok()

    def truncate(self, m: int, path: str, size: int) -> tuple:
        p, code = self._resolve(path, m)
        if code:
            return err(code)
        if not self._dir_exists(self.parent(p)):
            return err(errno.ENOENT)
        e = self.view(m, p)
        if e is None:
            return err(errno.ENOENT)
        if e == DIR:
            return err(errno.EISDIR)
        w = self.writers[m].get(p)
        if w is not None:
            try:
                self._private(w)
            except _Fail as f:
                return err(f.code)
            data = w.staging.data
        else:
            assert isinstance(e, Ino)
            new = e.copy()
            data = new.data
            self.store[p] = new
            w = None
        if size < len(data):
            del data[size:]
        else:
            data.extend(b"\0" * (size - len(data)))
        if w is not None:
            self._changed(w)
        return ok()

    def rename(self, m: int, old: str, new: str) -> tuple:
        if not self._dir_exists(self.parent(old)) or not self._dir_exists(self.parent(new)):
            return err(errno.ENOENT)
        src = self.view(m, old)
        if src is None:
            return err(errno.ENOENT)
        dst = self.view(m, new)
        if src == DIR:
            if new == old:
                return ok()
            if new.startswith(old + "/"):
                return err(errno.EINVAL)
            if dst is not None and dst != DIR:
                return err(errno.ENOTDIR)
            if dst == DIR and (self.listing(new) or self._staging_in(new, m)):
                return err(errno.ENOTEMPTY)
        elif dst == DIR:
            return err(errno.EISDIR)
        if old == new:
            return ok()
        w = self.writers[m].get(old)
        if w is not None:
            try:
                self.publish(w, closing=False)   # the open file's writes so far move with it
            except _Fail as f:
                return err(f.code)
        if src != DIR and old not in self.store:
            return err(errno.ENOENT)
        self._detach(m, new, self.writers[m].get(new))
        moved = {p: e for p, e in self.store.items() if p == old or p.startswith(old + "/")}
        for p in moved:
            del self.store[p]
        if src == DIR and dst == DIR:
            del self.store[new]
        for p, e in moved.items():
            if not self.local_store and isinstance(e, Ino):
                e.moves += 1      # (a copy and a delete: the object's version may be new)
            self.store[new + p[len(old):]] = e
        # This mount's writers follow the rename (the other mounts' do not know of it).
        ws = self.writers[m]
        if new in ws and new != old:
            replaced = ws.pop(new)     # a file being written, renamed over: its writes go nowhere
            replaced.unlinked = True
        if src != DIR:
            self._end_still_named(m, new)
        for p in [p for p in ws if p == old or p.startswith(old + "/")]:
            moved_w = ws.pop(p)
            moved_w.path = new + p[len(old):]
            ws[moved_w.path] = moved_w
        for ofd in self.ofds.values():
            if ofd.mount == m and (ofd.path == old or ofd.path.startswith(old + "/")):
                ofd.path = new + ofd.path[len(old):]
        return ok()

    def crash(self, m: int) -> list[int]:
        """Mount `m`'s daemon was killed: its open files are gone (their writes never published,
        unless published in place before, which the store keeps), its writers too. The handles
        that died, for the harness to forget."""
        dead = [h for h, o in self.ofds.items() if o.mount == m]
        for h in dead:
            del self.ofds[h]
        for w in self.writers[m].values():
            w.unlinked = True          # nothing more is published from it
        self.writers[m].clear()
        return dead

    def tree(self) -> list[tuple[str, str, object]]:
        """The store as the harness reads it directly: (path, kind, content or target)."""
        out = []
        for p, e in sorted(self.store.items()):
            if e == DIR:
                out.append((p, "dir", None))
            elif isinstance(e, Symlink):
                out.append((p, "symlink", e.target))
            else:
                out.append((p, "file", bytes(e.data)))
        return out


__all__ = ["Model", "Ino", "Writer", "OFD", "Divergence", "DIR", "Symlink"]
