"""The stores hintfs is a view of: one interface (`stores.base.Store`), two implementations
(`local.LocalStore` for file://, `arrow.ArrowStore` for pyarrow.fs: S3, HDFS), chosen by the
URI's scheme in `open_store`."""
from __future__ import annotations

import errno
from urllib.parse import urlparse

from common.errors import HintfsError
from stores.base import Store


def open_store(store_cfg, spool_dir: str) -> Store:
    """The store of a `[store]` config table (`mountconfig.StoreConfig`); HintfsError(EINVAL)
    with one line when its URI cannot be used."""
    uri = store_cfg.uri
    if urlparse(uri).scheme == "file":
        from stores.local import LocalStore
        return LocalStore(urlparse(uri).path)
    from stores.arrow import ArrowStore, filesystem_from_config
    try:
        fs, root = filesystem_from_config(store_cfg)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for bad URIs or missing HDFS libs
        raise HintfsError(errno.EINVAL, f"store {uri}: {err}") from None
    return ArrowStore(fs, root, spool_dir, uri)


def check_store(store: Store, store_cfg) -> None:
    """Fail at once when the store root cannot be listed (`[store] startup_check`)."""
    if not store_cfg.startup_check:
        return
    try:
        store.check()
    except Exception as err:
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise HintfsError(getattr(err, "errno", None) or errno.EIO,
                          f"store {store_cfg.uri} is not reachable: {reason}") from None
