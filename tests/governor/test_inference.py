import torch

from mountconfig.governor import GiB
from hintfs.governor.inference import InferenceClient, KVCache, ModelCache
from governor_simdevice import SimulatedTrainer


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_reserve_blocks_until_training_shrank(make_daemon):
    d = make_daemon()
    trainer = SimulatedTrainer(d.cfg.socket_path, step_s=0.002)
    inf = InferenceClient(d.cfg.socket_path, name="vit")
    r = inf.reserve(5 * GiB, "weights")
    assert r["granted"] == 5 * GiB and r["reclaimed"] == 5 * GiB
    assert trainer.used <= 10 * GiB and inf.timings
    from conftest import wait_until
    with inf.busy():       # announced to the daemon, which counts it into the trainer's block
        assert wait_until(trainer.client.inference_busy, 5)
    assert wait_until(lambda: not trainer.client.inference_busy(), 5)
    trainer.close(); inf.close()


def test_model_cache_keepalive_from_idle_history(make_daemon):
    d = make_daemon()
    inf = InferenceClient(d.cfg.socket_path)
    clock = FakeClock()
    cache = ModelCache(inf, clock, keepalive={"min_s": 1.0, "max_s": 100.0, "quantile": 0.9})
    load = lambda: torch.zeros(4)
    # requests every 5 s: the keep-alive learns ~5.5 s
    for i in range(6):
        clock.t = i * 5.0
        with cache.use("resnet", load, GiB) as m:
            assert m.shape == (4,)
    assert cache.cold_starts == 1
    assert 5.0 <= cache.keepalive_of("resnet") <= 6.0
    assert d.call(lambda: d.ledger().by_kind()["weights"]) == GiB
    clock.t = 25.0 + 4.0
    assert cache.evict_expired() == []
    clock.t = 25.0 + 7.0
    assert cache.evict_expired() == ["resnet"]
    assert d.call(lambda: d.ledger().by_kind()["weights"]) == 0
    with cache.use("resnet", load, GiB):
        pass
    assert cache.cold_starts == 2
    inf.close()


def test_kv_cache_grows_and_shrinks_in_the_ledger(make_daemon):
    d = make_daemon()
    inf = InferenceClient(d.cfg.socket_path, name="llm")
    kv = KVCache(inf, bytes_per_token=1 << 20, chunk_bytes=256 << 20,
                 alloc=lambda n: torch.empty(16))
    kv.ensure(1000)  # ~1000 MiB → 4 chunks
    assert len(kv.chunks) == 4 and kv.capacity_tokens >= 1000
    assert d.call(lambda: d.ledger().by_kind()["kv_cache"]) == 1 << 30
    kv.shrink_to(100)
    assert len(kv.chunks) == 1
    assert d.call(lambda: d.ledger().by_kind()["kv_cache"]) == 256 << 20
    inf.close()
    # closing the connection returns the rest
    from conftest import wait_until
    assert wait_until(lambda: d.call(lambda: d.ledger().inference_bytes()) == 0)
