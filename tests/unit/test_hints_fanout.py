"""The hint's fan-out of one file's replicas (fusefs.hints.HintsManager._fan_out), on trio's
virtual clock with copies that take a set time: every copy's source is complete before it starts,
and no copy waits for a slow one it does not need."""
from __future__ import annotations

import trio
import trio.testing

from fusefs.hints import FileState, HintsManager, Job
from fusefs.stats import Stats
from mountconfig import parse_config
from policy.replicas import ReplicaTarget


class Recorder(HintsManager):
    """`_copy` sleeps on the virtual clock (1 s a copy; 10 s into `slow`) and records it."""

    def __init__(self, agents: list[str], slow: str | None = None, fail: str | None = None):
        cfg = parse_config({"store": {"uri": "file:///nonexistent"}})
        super().__init__(cfg.replicas, agents, {}, Stats())
        self.slow, self.fail = slow, fail
        self.copies: list[tuple[float, str, str | None]] = []    # (start, dest, source)
        self.ready_at: dict[str, float] = {}

    async def _copy(self, job: Job, path: str, dest: str, source: str | None) -> None:
        state = job.files[path]
        assert source is None or source in state.ready, (dest, source)
        self.copies.append((trio.current_time(), dest, source))
        await trio.sleep(10.0 if dest == self.slow else 1.0)
        if dest == self.fail:
            state.error = "ENOSPC"
            return
        state.ready.append(dest)
        self.ready_at[dest] = trio.current_time()


def fan_out(agents: int, slow: int | None = None, fail: int | None = None) -> Recorder:
    names = [f"a{i}" for i in range(agents)]
    m = Recorder(names, slow=None if slow is None else names[slow], fail=None if fail is None else names[fail])
    target = ReplicaTarget("hot", 4096, agents, 1e9)
    places = m._agents_for("hot", agents)
    if slow is not None:
        m.slow = places[slow]
    if fail is not None:
        m.fail = places[fail]
    job = Job("j", None, {"hot": FileState(agents, 4096)}, 1e9, 1e9)  # type: ignore[arg-type]

    async def main() -> None:
        files = trio.CapacityLimiter(1)
        await files.acquire_on_behalf_of(target)
        await m._fan_out(job, target, files)
        assert files.borrowed_tokens == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return m


def test_replicas_double_with_each_copy_and_each_agent_gets_one():
    m = fan_out(128)
    assert sorted(d for _, d, _ in m.copies) == sorted(f"a{i}" for i in range(128))
    assert m.copies[0][2] is None and sum(s is None for _, _, s in m.copies) == 1   # one copy from the store
    assert max(m.ready_at.values()) == 8.0          # 1 from the store, then 1 -> 2 -> ... -> 128: 7 more


def test_a_slow_copy_holds_back_only_itself():
    """The slow agent is the sixth replica (third doubling): held to rounds, every later round
    would start after it (~4 + 10 + 4 s); here all the others are ready by 9 s."""
    m = fan_out(128, slow=5)
    slow = m.slow
    others = [t for d, t in m.ready_at.items() if d != slow]
    assert len(others) == 127 and max(others) <= 9.0
    assert m.ready_at[slow] >= 13.0


def test_a_failed_copy_leaves_its_slot_empty_and_the_rest_go_on():
    m = fan_out(16, fail=3)
    assert len(m.ready_at) == 15 and m.fail not in m.ready_at
    assert all(s != m.fail for _, _, s in m.copies)   # never a source
