"""The soak bench's code for seconds (issue 37, item 4; bench/soak.py runs it for hours):
checkpoints, evals, a restart storm, restarts and SIGKILLs of an agent and of the eval mount,
with every read checked. Errors and lost files, not drift (a short run has no quarters to trust)."""
from tests.conftest import needs_fuse
from tests.helpers.soak import Soak, SoakPlan, drift, drift_by_role, Sample

pytestmark = needs_fuse


class VirtualClock:
    """The plan's time: it moves only when the soak waits for its next event, so the same events
    happen however long each takes on this machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_short_soak_loses_nothing_and_shows_no_error_it_did_not_inject(tmp_path):
    clock = VirtualClock()
    plan = SoakPlan(duration_s=12.0, checkpoint_every_s=2.0, files_per_checkpoint=6, max_file_bytes=256 << 10,
                    keep_last=2, eval_every_s=1.5, storm_every_s=6.0, storm_readers=6, restart_every_s=4.0,
                    kill_every_s=5.0, sample_every_s=1.0, seed=1)
    lines: list[str] = []
    result = Soak(tmp_path, plan, clock=clock, sleep=clock.sleep, log=lines.append).run()
    assert result["errors"] == [] and result["lost_files"] == 0, (result["errors"], lines)
    # the plan's events, at their times (kills at 5, 10 s; restarts at 4, 8 s; a storm at 6 s;
    # checkpoints at 0, 2, ... 10 s)
    assert (result["kills"], result["restarts"], result["storms"], result["checkpoints"]) == (2, 2, 1, 6), result
    assert result["samples"] > 0 and result["tensor_files"] == plan.media_files == 4   # `.tensor` reads checked
    assert any("SIGKILL agent" in x for x in lines) and any("SIGKILL the eval mount" in x for x in lines)


def test_drift_is_the_last_quarter_over_the_second():
    s = [Sample(t, "agent0", 7, rss, 10, 4, cpu, ops) for t, rss, cpu, ops in
         [(30, 100, 1.0, 10), (40, 100, 2.0, 20), (80, 150, 5.0, 40), (90, 150, 7.0, 50)]]
    d = drift(s, 100.0)
    assert d["rss"] == 1.5 and d["fds"] == 1.0
    assert d["cpu_per_op"] == (2.0 / 10) / (1.0 / 10)
    assert drift([], 100.0) == {"rss": None, "fds": None, "cpu_per_op": None}


def test_drift_is_reported_per_role_and_the_largest_over_roles():
    rows = [(30, 100, 1.0, 10), (40, 100, 2.0, 20), (80, 150, 5.0, 40), (90, 150, 7.0, 50)]
    s = [Sample(t, "agent0", 7, rss, 10, 4, cpu, ops) for t, rss, cpu, ops in rows]
    s += [Sample(t, "mount-eval", 8, 200, 12 if t < 50 else 6, 4, cpu / 2, ops) for t, _, cpu, ops in rows]
    s.append(Sample(95, "mount-train", 9, 50, 3, 4, 1.0, 55))   # never sampled in the second quarter
    by_role = drift_by_role(s, 100.0)
    assert set(by_role) == {"agent0", "mount-eval"}
    assert by_role["agent0"] == {"rss": 1.5, "fds": 1.0, "cpu_per_op": 2.0}
    assert by_role["mount-eval"] == {"rss": 1.0, "fds": 0.5, "cpu_per_op": 2.0}
    assert drift(s, 100.0) == {"rss": 1.5, "fds": 1.0, "cpu_per_op": 2.0}
