"""The mount daemon (`python -m fusefs`), a map:

- `mount.py`        assembles everything (the one place) and runs pyfuse3's loop.
- `fuse.py`         the pyfuse3 adapter: one line per operation over `Filesystem`.
- `filesystem.py`   the semantics (namespace, opens, staging and publish, control files), no
                    pyfuse3: `tests/fs/test_filesystem_api.py` drives it with no kernel mount.
- `attrs.py`        the plain types it answers with (attributes, open file, statfs) and `Refused`.
- `handles.py`      one class per kind of open handle, chosen at open (store, staging, replica,
                    write, control, tensor, directory).
- `inodes.py`       inode numbers <-> store paths, with the kernel's lookup counts.
- `interfaces.py`   what the filesystem calls its collaborators through:
  `replicaread.py` (reads of hinted files from agents), `tensorfile.py` (`x.tensor` files and
  plans), `routes.py` (cross-DC routes: tier routing at open, `RoutedStore`),
  `journal_writer.py` (a journal record per published file).
- `control.py`      `.hintfs/` control files; `hints.py` (replication hints), `signals.py`.
- `stats.py`, `metrics.py`  counters and latencies, the Prometheus endpoint.
"""
