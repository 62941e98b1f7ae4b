"""The stores hintfs is a view of: one interface (`hintfs.stores.base.Store`), two implementations
(`local.LocalStore` for file://, `arrow.ArrowStore` for pyarrow.fs: S3, HDFS), chosen by the
URI's scheme in `open_store`; remote ones optionally behind the host cache (`hostcache`)."""
from __future__ import annotations

import errno
from urllib.parse import urlparse

from hintfs.common.errors import HintfsError
from hintfs.stores.base import Store


def open_store(store_cfg, spool_dir: str, cache_cfg=None) -> Store:
    """The store of a `[store]` config table (`mountconfig.StoreConfig`); HintfsError(EINVAL)
    with one line when its URI cannot be used. With `cache_cfg` (the `[cache]` table) whose `dir`
    is set, a remote store is wrapped in the host cache (`hintfs.stores.hostcache.HostCachedStore`: call
    its `close()` at unmount); file:// stores never are (their files are local already)."""
    uri = store_cfg.uri
    if urlparse(uri).scheme == "file":
        from hintfs.stores.local import LocalStore
        return LocalStore(urlparse(uri).path)
    from hintfs.stores.arrow import ArrowStore, filesystem_from_config
    try:
        fs, root = filesystem_from_config(store_cfg)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for bad URIs or missing HDFS libs
        raise HintfsError(errno.EINVAL, f"store {uri}: {err}") from None
    getter = None
    if urlparse(uri).scheme == "s3":   # small objects opened in one GET where it can sign (explicit keys)
        from hintfs.stores.s3get import S3Getter
        getter = S3Getter.of(store_cfg, root.split("/", 1)[0])
    store: Store = ArrowStore(fs, root, spool_dir, uri, whole_object_bytes=store_cfg.whole_object_bytes,
                              read_ahead_bytes=store_cfg.read_ahead_bytes,
                              read_buffer_bytes=store_cfg.read_buffer_bytes,
                              listing_ttl=listing_ttl(cache_cfg) if cache_cfg is not None else None,
                              getter=getter)
    if cache_cfg is not None and cache_cfg.dir:
        from hintfs.stores.hostcache import HostCachedStore
        try:
            # the endpoint too: one bucket name on two S3 servers is two stores
            store = HostCachedStore(store, cache_cfg, store_id=f"{uri} {store_cfg.endpoint_override or ''}")
        except HintfsError:
            raise
        except OSError as err:
            raise HintfsError(err.errno or errno.EIO, f"cache.dir {cache_cfg.dir}: {err.strerror or err}") from None
    return store


def listing_ttl(cache_cfg):
    """How long a listing's attributes of a path answer its stats (no request): as long as the
    kernel keeps attributes of that path (`[cache] attr_timeout_s`, `immutable_timeout_s` for
    `immutable_globs`), so a stat sees nothing older than the kernel's own cache could show."""
    import fnmatch
    import re
    globs = list(cache_cfg.immutable_globs)
    match = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs)).match if globs else None
    attr: float = float(cache_cfg.attr_timeout_s)
    immutable: float = float(cache_cfg.immutable_timeout_s)

    def ttl(path: str) -> float:
        return immutable if match is not None and match(path) else attr
    return ttl


def check_store(store: Store, store_cfg) -> None:
    """Fail at once when the store root cannot be listed (`[store] startup_check`)."""
    if not store_cfg.startup_check:
        return
    try:
        store.check()
    except HintfsError as err:      # the store's own check: it says what is wrong with its root
        raise HintfsError(err.errno or errno.EIO, f"store {store_cfg.uri}: {err.strerror}") from None
    except Exception as err:
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise HintfsError(getattr(err, "errno", None) or errno.EIO,
                          f"store {store_cfg.uri} is not reachable: {reason}") from None
