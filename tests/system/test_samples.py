"""The agent's sample service: cache, prefetch, single-flight, load-aware fallback."""
import time

import numpy as np
import pytest

from stores.local import LocalStore
from agent.samples import LoadMonitor, SampleService
from mountconfig import parse_config

av = pytest.importorskip("av")
PARAMS = {"size": 32, "crop": [24, 24]}


def test_hysteresis():
    m = LoadMonitor(0.8, 0.7, interval_s=3600)
    try:
        for share, busy in [(0.5, False), (0.79, False), (0.8, True), (0.75, True), (0.7, True), (0.69, False)]:
            m.update(share)
            assert m.busy is busy, share
    finally:
        m.stop()


@pytest.fixture(params=[False])
def service(tmp_path, request):
    from tests.helpers.media import jpeg_file as _jpeg
    (tmp_path / "s").mkdir()
    for i in range(3):
        _jpeg(tmp_path / "s" / f"{i}.jpg", seed=i, w=64, h=48)
    cfg = parse_config({"transform_load": {"workers": 1, "deadline_ms": 60000, "fallback": request.param}})
    svc = SampleService(LocalStore(str(tmp_path / "s")), cfg.transform_load)
    svc.monitor.stop()   # the tests set the CPU share themselves; the machine's own load must not count
    svc.monitor.update(0.0)
    yield svc
    svc.close()


def test_prefetch_then_cache_hit_and_forget(service):
    from transforms.container import decode
    assert service.prefetch([(f"{i}.jpg", "image", PARAMS, 7) for i in range(3)]) == 3
    deadline = time.monotonic() + 60
    while service.status()["cached"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    data, how = service.get("1.jpg", "image", PARAMS, 7)
    assert how == "cache" and decode(data)[0].mode == "tensor"
    assert service.prefetch([("1.jpg", "image", PARAMS, 7)]) == 0     # nothing to redo
    service.forget({("0.jpg", 7)})
    assert service.status()["cached"] == 1
    data2, how2 = service.get("1.jpg", "image", PARAMS, 7)
    assert how2 == "tensor" and data2 == data                           # deterministic


@pytest.mark.parametrize("service", [True], indirect=True)
def test_busy_storage_serves_raw(service):
    from transforms.container import decode, load_sample
    service.monitor.update(0.99)          # as if the CPU were saturated
    data, how = service.get("2.jpg", "image", PARAMS, 3)
    assert how == "raw_busy" and decode(data)[0].mode == "raw"
    service.monitor.update(0.1)
    tensor, how = service.get("2.jpg", "image", PARAMS, 3)
    assert how == "tensor"
    assert np.array_equal(load_sample(data)["pixels"], load_sample(tensor)["pixels"])
    assert service.status()["raw_busy"] == 1


def test_demand_reads_go_ahead_of_the_lookahead(service):
    # One worker, three prefetches: only one runs, two wait in the backlog ...
    service.prefetch([(f"{i}.jpg", "image", PARAMS, 100 + i) for i in range(3)])
    assert service.status()["backlog"] == 2 and service.status()["running"] == 1
    # ... and a sample a reader waits for is made before them.
    data, how = service.get("2.jpg", "image", PARAMS, 999)
    assert how == "tensor"
    assert service.status()["backlog"] >= 1 or service.status()["cached"] >= 1
