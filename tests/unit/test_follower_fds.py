"""A tier agent out of open files (its replicas' fds take at most half the limit,
tests/unit/test_replica_fds.py; copies, streams and connections the rest): its predictive copies
fail with EMFILE and are retried; the log says so in one error line a minute, with what to set, not one
warning a copy (16,384-file checkpoints: 4,830 warnings and no word of the limit)."""
from __future__ import annotations

import errno
import logging
import types

from hintfs.agent.follower import Follower
from hintfs.stores.local import LocalStore
from mountconfig import parse_config


class _NoFds:
    def __init__(self):
        self.calls = 0

    def replicate(self, path, *args, **kwargs):
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files", f"/tier/{self.calls}.part")


def test_copies_out_of_open_files_say_so_once_a_minute(tmp_path, caplog):
    cfg = parse_config({"store": {"uri": f"file://{tmp_path}"}, "follow": {"prefixes": ["ckpt"]}}).follow
    copier = _NoFds()
    f = Follower(cfg, LocalStore(str(tmp_path)), types.SimpleNamespace(), copier)   # type: ignore[arg-type]
    now = [0.0]
    f.fd_refusals.clock = lambda: now[0]
    with caplog.at_level(logging.WARNING, logger="hintfs"):
        assert [f._copy(f"ckpt/job/step_1/f{i}") for i in range(5)] == [False] * 5
        now[0] = 61.0
        assert f._copy("ckpt/job/step_1/f9") is False
    lines = [r for r in caplog.records if "open files" in r.getMessage()]
    assert copier.calls == 6 and len(lines) == 2 and all(r.levelno == logging.ERROR for r in lines)
    assert "LimitNOFILE" in lines[0].getMessage() and "replicas read lately" in lines[0].getMessage()
    assert "4 more refused" in lines[1].getMessage()
    assert not [r for r in caplog.records if "will retry" in r.getMessage() and "open files" not in r.getMessage()]
    assert set(f.errors) == {f"ckpt/job/step_1/f{i}" for i in (0, 1, 2, 3, 4, 9)}      # retried next rounds
