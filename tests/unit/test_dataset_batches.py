"""hintfs.dataset.read_batch and prefetch: a step's `.tensor` files read into one buffer (shared
memory inside a DataLoader worker), the same tensors `load_sample` gives, and a read-ahead in
threads that keeps order, bounds its depth and stops when closed. Files on a plain folder; the
mount's `.tensor` view is tested in tests/system."""
from __future__ import annotations

import errno
import json
import struct
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hintfs.dataset import PlanDataset, _read_into, prefetch, read_batch  # noqa: E402
from hintfs.plan import build_plan  # noqa: E402
from hintfs.transforms import TransformError, apply  # noqa: E402
from hintfs.transforms import container as tc  # noqa: E402
from tests.helpers.media import make_image  # noqa: E402


def _meta(kind="image", params=None, seed=3, source="d/x.jpg", size=0):
    return tc.make_meta(kind, params or {"size": 16}, seed, source, size, 1)


def _files(tmp_path):
    """Three tensor-mode files (padding between tensors, several dtypes) and one raw-mode JPEG."""
    arrays = [{"a": np.arange(7, dtype=np.uint8), "b": np.linspace(0, 1, 15, dtype=np.float32).reshape(3, 5)},
              {"frames": np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)},
              {"idx": np.arange(5, dtype=np.int64), "m": np.array([True, False, True])}]
    paths = []
    for i, arr in enumerate(arrays):
        p = tmp_path / f"t{i}.jpg.tensor"
        p.write_bytes(tc.encode_tensor(arr, _meta()))
        paths.append(str(p))
    raw = make_image("jpeg", 40, 30, seed=1)
    params = {"size": 16, "crop": [12, 12]}
    p = tmp_path / "r.jpg.tensor"
    p.write_bytes(tc.encode_raw(raw, _meta(params=params, seed=9, size=len(raw))))
    paths.append(str(p))
    return paths, arrays, apply("image", raw, params, 9)


def test_a_batch_is_one_buffer_with_the_tensors_load_sample_gives(tmp_path):
    paths, arrays, from_raw = _files(tmp_path)
    got = read_batch(paths, with_meta=True)
    assert [m.mode for m, _, _ in got] == ["tensor", "tensor", "tensor", "raw"]
    assert [size for _, _, size in got] == [len(open(p, "rb").read()) for p in paths]
    for (_, tensors, _), want in zip(got, arrays + [from_raw]):
        assert tensors.keys() == want.keys()
        for k in want:
            assert tensors[k].dtype == torch.from_numpy(want[k]).dtype
            assert np.array_equal(tensors[k].numpy(), want[k]), k
    # the tensor-mode files' tensors are views of one storage; the raw one's are its own
    storages = {t.untyped_storage().data_ptr() for _, ts, _ in got[:3] for t in ts.values()}
    assert len(storages) == 1
    assert got[3][1]["pixels"].untyped_storage().data_ptr() not in storages
    assert read_batch(paths[1:2])[0]["frames"].shape == (2, 4, 4, 3)   # without meta: the dicts
    assert read_batch([]) == []


def test_unaligned_tensors_of_a_foreign_writer_are_copied(tmp_path):
    meta = {k: v for k, v in tc._meta_strings(_meta(), "tensor").items()}
    header = {"__metadata__": meta, "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % 64)
    p = tmp_path / "u.tensor"
    p.write_bytes(struct.pack("<Q", len(h)) + h + bytes([1, 2, 3]) + np.array([1.5, -2], np.float32).tobytes())
    t = read_batch([str(p)])[0]
    assert t["a"].tolist() == [1, 2, 3] and t["b"].tolist() == [1.5, -2.0]


def test_bad_files_raise_as_load_sample_does(tmp_path):
    good = tmp_path / "g.tensor"
    good.write_bytes(tc.encode_tensor({"x": np.zeros(100, np.uint8)}, _meta()))
    cut = tmp_path / "c.tensor"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(TransformError):
        read_batch([str(good), str(cut)])
    with pytest.raises(FileNotFoundError):
        read_batch([str(good), str(tmp_path / "missing.tensor")])

    class Short:   # a file that ends before its size at open said
        def readinto(self, mv):
            return 0
    with pytest.raises(OSError) as e:
        _read_into("f", Short(), memoryview(bytearray(4)))
    assert e.value.errno == errno.EIO


def test_in_a_dataloader_worker_the_batch_arrives_as_one_shared_storage(tmp_path):
    paths, arrays, from_raw = _files(tmp_path)

    class DS:
        def __len__(self):
            return 4

        def __getitems__(self, idx):
            return read_batch([paths[i] for i in idx])

    (batch,) = list(torch.utils.data.DataLoader(DS(), batch_sampler=[[0, 1, 2, 3]], num_workers=1,
                                                collate_fn=lambda x: x, multiprocessing_context="fork"))
    views = [t for ts in batch[:3] for t in ts.values()]
    assert all(t.is_shared() for t in views)
    assert len({t.untyped_storage().data_ptr() for t in views}) == 1
    for ts, want in zip(batch, arrays + [from_raw]):
        assert all(np.array_equal(ts[k].numpy(), want[k]) for k in want)


def test_prefetch_keeps_order_reads_at_most_depth_ahead_and_stops_when_closed():
    drawn, loaded, gate = [], [], threading.Event()

    def source():
        for i in range(10):
            drawn.append(i)
            yield [i]

    def load(batch):
        gate.wait(5)
        loaded.append(batch[0])
        return batch[0] * 10

    it = prefetch(source(), depth=3, threads=2, load=load)
    gate.set()
    assert next(it) == 0 and len(drawn) <= 4   # 3 in flight, then one more drawn after the first
    assert [next(it) for _ in range(4)] == [10, 20, 30, 40]
    it.close()
    assert len(drawn) <= 8 and max(loaded) < 8
    assert list(prefetch(iter([[1], [2]]), load=lambda b: b)) == [[1], [2]]
    with pytest.raises(ValueError):
        next(prefetch(iter([]), depth=0))

    def boom(batch):
        raise TransformError("bad sample")
    with pytest.raises(TransformError):
        next(prefetch(iter([[1]]), load=boom))


def test_plan_dataset_batches_read_the_plan_in_order_and_report_steps(tmp_path):
    mount = tmp_path / "mnt"
    (mount / ".hintfs" / "plans").mkdir(parents=True)
    samples = [f"s{i}.jpg" for i in range(8)]
    for i, s in enumerate(samples):
        (mount / (s + ".tensor")).write_bytes(tc.encode_tensor({"v": np.full(3, i, np.int64)}, _meta()))
    build_plan(samples, str(mount / "plan.parquet"), seed=5, world_size=2, batch_per_rank=2, steps=6)
    ds = PlanDataset(str(mount), "plan.parquet", rank=1, start_step=2)
    want = [[int(ds.samples[i][1:-4]) for i in range(b, b + 2)] for b in range(0, len(ds), 2)]
    reported = []
    for batch in ds.batches(job="j", depth=2):
        reported.append(json.loads((mount / ".hintfs/plans/j").read_text())["step"])
        assert all(isinstance(t["v"], torch.Tensor) for t in batch)
    assert reported[0] >= 2 and reported[-1] == 5
    assert [[int(t["v"][0]) for t in b] for b in ds.batches()] == want
    # through a DataLoader, with metadata: __getitems__ reads each step as one batch
    dsm = PlanDataset(str(mount), "plan.parquet", rank=1, start_step=2, with_meta=True)
    got = list(dsm.dataloader(num_workers=0, collate_fn=lambda x: x))
    assert [[int(x["data"]["v"][0]) for x in b] for b in got] == want
    assert all([x["step"] for x in b] == [b[0]["step"]] * 2 for b in got)
    assert [int(x["sample"][1:-4]) for b in got for x in b] == [v for b in want for v in b]
