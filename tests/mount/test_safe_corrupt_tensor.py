"""A corrupt source is EIO whichever mode serves its `.tensor` (issue 12, safe operations): under
load-aware fallback (here every transform misses its deadline, so the agent would hand out raw
containers) a truncated or foreign file is refused by the container checks that need no decoder,
exactly as the tensor path refuses it; a good file still falls back to a raw container."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tests.conftest import needs_fuse
from tests.helpers.media import has_encoder, jpeg_file, make_video

pytestmark = needs_fuse
pytest.importorskip("av")

RULES = '''
[transform_load]
fallback = true
deadline_ms = 0.001

[[transforms]]
glob = "vids/*"
kind = "video"
params = { frames = 4, size = 32 }

[[transforms]]
glob = "imgs/*"
kind = "image"
params = { size = 32 }
'''


def _eio(path) -> None:
    with pytest.raises(OSError) as info:
        path.read_bytes()
    assert info.value.errno == errno.EIO, info.value


def test_corrupt_sources_are_eio_also_when_served_raw(mount_factory, tmp_path):
    from hintfs.transforms.container import decode, load_sample
    if not has_encoder("libx264"):
        pytest.skip("PyAV has no libx264 encoder")
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULES}')
    (m.store / "vids").mkdir()
    (m.store / "imgs").mkdir()
    mp4, mkv = make_video("libx264", "mp4"), make_video("libx264", "matroska")
    (m.store / "vids" / "good.mp4").write_bytes(mp4)
    (m.store / "vids" / "cut.mp4").write_bytes(mp4[: len(mp4) // 2])
    (m.store / "vids" / "cut.mkv").write_bytes(mkv[: len(mkv) - 100])
    (m.store / "vids" / "junk.mp4").write_bytes(os.urandom(20_000))
    jpeg_file(m.store / "imgs" / "good.jpg")
    (m.store / "imgs" / "cut.jpg").write_bytes((m.store / "imgs" / "good.jpg").read_bytes()[:300])
    for name in ("vids/cut.mp4", "vids/cut.mkv", "vids/junk.mp4", "imgs/cut.jpg"):
        _eio(m.mnt / f"{name}.tensor")
        _eio(m.mnt / f"{name}.tensor")            # remembered: again EIO, in every mode
        assert (m.mnt / name).read_bytes() == (m.store / name).read_bytes()   # the raw file stays readable
    data = (m.mnt / "vids" / "good.mp4.tensor").read_bytes()
    meta, _ = decode(data)
    assert meta.mode in ("raw", "tensor")
    frames = load_sample(str(m.mnt / "vids" / "good.mp4.tensor"))["frames"]
    assert frames.shape[0] == 4 and frames.dtype in (np.uint8, np.float32)
    log = m.log.read_text()
    assert "cut.mp4" in log and "truncated MP4" in log and "junk.mp4" in log
