"""`x.ext.tensor` through a real mount: agent-side transforms, fallback, plans (issue 4)."""
import errno
import json
import os

import numpy as np
import pytest

from tests.conftest import needs_fuse

pytestmark = needs_fuse
av = pytest.importorskip("av")

RULES = '''
[[transforms]]
glob = "imgs/*.jpg"
kind = "image"
params = { size = 64, crop = [48, 48], normalize = true }

[[transforms]]
glob = "vids/*.mp4"
kind = "video"
params = { frames = 4, size = 32 }
'''


from tests.helpers.media import jpeg_file as _jpeg  # noqa: E402,F401


def _mp4(path, frames=24):
    with av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"x264-params": "mbtree=0"}
        for i in range(frames):
            img = np.full((48, 64, 3), (i * 9) % 256, dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)


@pytest.fixture
def media_mount(mount_factory, tmp_path):
    def make(extra=""):
        m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{extra}{RULES}')
        (m.store / "imgs").mkdir()
        (m.store / "vids").mkdir()
        for i in range(3):
            _jpeg(m.store / "imgs" / f"{i}.jpg", seed=i)
        _mp4(m.store / "vids" / "v.mp4")
        (m.store / "imgs" / "broken.jpg").write_bytes((m.store / "imgs" / "0.jpg").read_bytes()[:300])
        return m
    return make


def _local(m, rel, kind, params, seed=None):
    from hintfs import transforms
    from hintfs.transforms.params import default_seed
    return transforms.apply(kind, (m.store / rel).read_bytes(), params, default_seed(rel) if seed is None else seed)


def test_tensor_files_match_local_transforms(media_mount):
    from hintfs.transforms.container import decode, load_sample
    # Fallback off: a busy test machine must not turn these samples into raw ones.
    m = media_mount('\n[transform_load]\nfallback = false\n')
    p = m.mnt / "imgs" / "1.jpg.tensor"
    assert p.exists() and not (m.store / "imgs" / "1.jpg.tensor").exists()
    assert "1.jpg.tensor" not in os.listdir(m.mnt / "imgs")     # listings stay the store's
    data = p.read_bytes()
    meta, arrays = decode(data)
    assert meta.mode == "tensor" and meta.source == "imgs/1.jpg"
    ref = _local(m, "imgs/1.jpg", "image", {"size": 64, "crop": [48, 48], "normalize": True})
    assert np.array_equal(arrays["pixels"], ref["pixels"]) and arrays["pixels"].shape == (3, 48, 48)
    assert np.array_equal(load_sample(str(p))["pixels"], ref["pixels"])
    video = load_sample(str(m.mnt / "vids" / "v.mp4.tensor"))
    assert np.array_equal(video["frames"], _local(m, "vids/v.mp4", "video", {"frames": 4, "size": 32})["frames"])
    # A step read into one buffer (hintfs.dataset.read_batch): the size of each `.tensor` is exact
    # once open, so the buffer is laid out from fstat; the same tensors, views of one storage.
    pytest.importorskip("torch")
    from hintfs.dataset import read_batch
    batch = read_batch([str(p), str(m.mnt / "vids" / "v.mp4.tensor")])
    assert np.array_equal(batch[0]["pixels"].numpy(), ref["pixels"])
    assert np.array_equal(batch[1]["frames"].numpy(), video["frames"])
    assert batch[0]["pixels"].untyped_storage().data_ptr() == batch[1]["frames"].untyped_storage().data_ptr()
    # Size exact once open; concurrent handles agree.
    with open(p, "rb") as a, open(p, "rb") as b:
        assert os.fstat(a.fileno()).st_size == len(data)
        assert a.read() == b.read() == data
    with pytest.raises(OSError):
        open(p, "wb")
    assert not (m.mnt / "imgs" / "missing.jpg.tensor").exists()
    assert not (m.mnt / "other.txt.tensor").exists()


def test_fallback_gives_raw_bytes_and_the_same_tensor(media_mount):
    from hintfs.transforms.container import decode, load_sample
    m = media_mount('\n[transform_load]\ndeadline_ms = 0.001\n')   # every sample misses its deadline
    with open(m.mnt / "imgs" / "2.jpg.tensor", "rb") as held:
        data = held.read()
        meta, arrays = decode(data)
        assert meta.mode == "raw" and bytes(arrays["raw"]) == (m.store / "imgs" / "2.jpg").read_bytes()
        ref = _local(m, "imgs/2.jpg", "image", {"size": 64, "crop": [48, 48], "normalize": True})
        assert np.array_equal(load_sample(data)["pixels"], ref["pixels"])    # bit for bit
        pytest.importorskip("torch")
        # a step read into one buffer transforms raw files the same way (opened while `held` is:
        # the content is fixed at the first open and shared by every handle open at the time;
        # the next open after all closed may get the tensor the agent made meanwhile)
        from hintfs.dataset import read_batch
        (meta2, tensors, size), = read_batch([str(m.mnt / "imgs" / "2.jpg.tensor")], with_meta=True)
    assert meta2.mode == "raw" and size == len(data) and np.array_equal(tensors["pixels"].numpy(), ref["pixels"])


def test_corrupt_media_is_eio_and_the_raw_file_stays_readable(media_mount):
    m = media_mount()
    with pytest.raises(OSError) as exc:
        (m.mnt / "imgs" / "broken.jpg.tensor").read_bytes()
    assert exc.value.errno == errno.EIO
    assert "broken.jpg" in m.log.read_text()
    assert (m.mnt / "imgs" / "broken.jpg").read_bytes() == (m.store / "imgs" / "broken.jpg").read_bytes()
    assert (m.mnt / "imgs" / "0.jpg.tensor").read_bytes()     # the mount and the agent keep serving


def test_plan_seeds_and_inferred_progress(media_mount):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hintfs.transforms.container import decode
    m = media_mount('\n[transform_load]\nfallback = false\n')
    rows = {"step": [0, 0, 1, 1, 2], "rank": [0, 1, 0, 1, 0], "slot": [0] * 5,
            "sample": ["imgs/0.jpg", "imgs/1.jpg", "imgs/2.jpg", "imgs/0.jpg", "imgs/1.jpg"],
            "aug_seed": [11, 12, 13, 14, 15], "est_cost_ms": [1.0] * 5}
    pq.write_table(pa.table(rows), m.store / "plan.parquet")
    ctl = m.mnt / ".hintfs" / "plans" / "train"
    with pytest.raises(OSError) as exc:
        ctl.write_text(json.dumps({"plan": "../x.parquet", "step": 0}))
    assert exc.value.errno == errno.EINVAL
    ctl.write_text(json.dumps({"plan": "plan.parquet", "step": 0, "lookahead": 1}))
    assert json.loads(ctl.read_text())["step"] == 0
    assert decode((m.mnt / "imgs" / "1.jpg.tensor").read_bytes())[0].aug_seed == 12
    # Reading a sample of step 1 shows step 1 has started: imgs/0.jpg now has its step-1 seed.
    assert decode((m.mnt / "imgs" / "2.jpg.tensor").read_bytes())[0].aug_seed == 13
    assert json.loads(ctl.read_text())["step"] == 1
    assert decode((m.mnt / "imgs" / "0.jpg.tensor").read_bytes())[0].aug_seed == 14


def test_plan_steps_pulled_ahead_give_the_same_tensors(media_mount):
    """With a plan, the mount pulls the ready tensors of steps N and N+1 in one call per agent;
    what an open gets that way is the very tensor (seed and bytes) a direct fetch gives."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq
    from hintfs.transforms.container import decode, load_sample
    m = media_mount('\n[transform_load]\nfallback = false\nlookahead_steps = 3\n')
    imgs = ["imgs/0.jpg", "imgs/1.jpg", "imgs/2.jpg"]
    steps = 8
    rows = {"step": [], "rank": [], "slot": [], "sample": [], "aug_seed": [], "est_cost_ms": []}
    for s in range(steps):
        for r in range(2):
            rows["step"].append(s)
            rows["rank"].append(r)
            rows["slot"].append(0)
            rows["sample"].append(imgs[(s * 2 + r) % 3])
            rows["aug_seed"].append(1000 + s * 2 + r)
            rows["est_cost_ms"].append(1.0)
    pq.write_table(pa.table(rows), m.store / "plan.parquet")
    (m.mnt / ".hintfs" / "plans" / "job").write_text(json.dumps({"plan": "plan.parquet", "step": 0}))
    params = {"size": 64, "crop": [48, 48], "normalize": True}
    for s in range(steps):
        for r in range(2):
            rel = imgs[(s * 2 + r) % 3]
            blob = (m.mnt / (rel + ".tensor")).read_bytes()
            meta = decode(blob)[0]
            assert meta.aug_seed == 1000 + s * 2 + r
            want = _local(m, rel, "image", params, seed=meta.aug_seed)
            got = load_sample(blob)
            assert all(np.array_equal(got[k], want[k]) for k in want)
        time.sleep(0.3)      # the "GPU step": the agent makes the next steps meanwhile
    # 12 of the 16 opens on an idle machine; the first reads of the run cannot be pulled
    assert m.stats()["counters"].get("tensor_pulled_hits", 0) >= 6


def test_ranks_reading_at_different_paces_get_their_own_steps_seeds(media_mount):
    """Two ranks' loaders on one host, one far ahead of the other: each read gets the seed of the
    occurrence at its own rank's step, not of a later epoch's occurrence."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hintfs.transforms.container import decode
    m = media_mount('\n[transform_load]\nfallback = false\nlookahead_steps = 1\n')
    imgs = [f"imgs/e{i}.jpg" for i in range(8)]
    for i, rel in enumerate(imgs):
        _jpeg(m.store / rel, seed=10 + i, w=64, h=48)
    # 2 ranks x 1 sample per step, 4 steps per epoch, 2 epochs (another order in the second).
    order = [list(range(8)), [5, 2, 7, 0, 3, 6, 1, 4]]
    rows = {"step": [], "rank": [], "slot": [], "sample": [], "aug_seed": [], "est_cost_ms": []}
    for e in range(2):
        for k in range(4):
            for r in range(2):
                s = 4 * e + k
                rows["step"].append(s)
                rows["rank"].append(r)
                rows["slot"].append(0)
                rows["sample"].append(imgs[order[e][2 * k + r]])
                rows["aug_seed"].append(100 * s + r)
                rows["est_cost_ms"].append(1.0)
    pq.write_table(pa.table(rows), m.store / "plan.parquet")
    ctl = m.mnt / ".hintfs" / "plans" / "job"
    ctl.write_text(json.dumps({"plan": "plan.parquet", "step": 0}))

    def read(s, r):
        rel = imgs[order[s // 4][2 * (s % 4) + r]]
        return decode((m.mnt / (rel + ".tensor")).read_bytes())[0].aug_seed

    for s in range(6):                      # rank 0 runs into the second epoch
        assert read(s, 0) == 100 * s
    for s in range(6):                      # rank 1 still gets its first-epoch seeds, then its own
        assert read(s, 1) == 100 * s + 1
    doc = json.loads(ctl.read_text())
    assert doc["step"] == 5 and doc["rank_steps"] == {"0": 5, "1": 5}
