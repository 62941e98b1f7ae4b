"""A `.tensor` whose transform fails is one log line naming the file and the limit or the decoder's
error, in the agent's log and in the mount's (issue 38, item 7), not ~400 characters of gRPC
client context; the whole error stays at DEBUG. A source that failed is named once while it is
remembered; an agent that does not answer is one line per agent a minute."""
from __future__ import annotations

import errno
import re

import pyarrow.flight as fl
import pytest
import trio
import trio.testing

from fusefs.tensorfile import UNREACHABLE_LOG_S, TensorFiles, agent_reason
from hintfs.agent.client import AgentError
from hintfs.agent.rpc import rpc_error
from mountconfig.schema import TransformLoadConfig
from tests.conftest import needs_fuse
from tests.helpers.media import jpeg_file

RULES = '''
[[transforms]]
glob = "imgs/*"
kind = "image"
params = { size = 32, max_pixels = 10000 }
'''
GRPC = re.compile(r"gRPC|Detail:|debug context|Client context")


def _agent_error(flight: Exception) -> AgentError:
    """An AgentError as hintfs.agent.client raises it: its text holds the Flight error's."""
    try:
        try:
            raise flight
        except fl.FlightError as err:
            raise AgentError(errno.EIO, f"agent grpc://h:1: sample a.jpg failed: {err}") from None
    except AgentError as err:
        return err


def test_agent_reason_is_the_agents_one_line():
    sent = rpc_error(errno.EIO, "transform of a.jpg failed: picture of 200x200 = 40000 pixels is over "
                                "max_pixels=10000")
    err = _agent_error(sent)
    assert GRPC.search(str(err)) or len(str(err)) > len(agent_reason(err))
    assert agent_reason(err) == ("transform of a.jpg failed: picture of 200x200 = 40000 pixels is over "
                                 "max_pixels=10000")
    # a call the agent never answered: the client's text, cut before gRPC's context
    gone = _agent_error(fl.FlightUnavailableError(
        "Flight returned unavailable error, with message: failed to connect to all addresses. "
        "Detail: Unavailable. gRPC client debug context: UNKNOWN:Error received from peer {x:y}"))
    assert agent_reason(gone) == ("agent grpc://h:1: sample a.jpg failed: Flight returned unavailable "
                                  "error, with message: failed to connect to all addresses")
    assert len(agent_reason(_agent_error(rpc_error(errno.EIO, "x" * 5000)))) <= 303


class _Agent:
    def __init__(self, err: Exception):
        self.err, self.calls = err, 0

    def sample(self, *args):
        self.calls += 1
        raise self.err


class _Stats:
    def add(self, *a):
        pass


def test_an_agent_that_does_not_answer_is_one_line_a_minute(caplog):
    from hintfs.transforms.params import TransformRule
    rule = TransformRule.model_validate({"glob": "imgs/*", "kind": "image", "params": {"size": 32}})
    down = _Agent(_agent_error(fl.FlightUnavailableError("Flight returned unavailable error. Detail: x")))
    tf = TensorFiles([rule], TransformLoadConfig(), None, ["grpc://h:1"], {"grpc://h:1": down}, _Stats())

    async def main():
        for name in ("a", "b", "c"):
            with pytest.raises(OSError) as info:
                await tf.fetch(f"imgs/{name}.jpg", rule)
            assert info.value.errno == errno.EIO and "gRPC" not in str(info.value)
        await trio.sleep(UNREACHABLE_LOG_S + 1)
        with pytest.raises(OSError):
            await tf.fetch("imgs/d.jpg", rule)

    with caplog.at_level("DEBUG", logger="hintfs.tensorfile"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and down.calls == 4, warnings
    assert warnings[0].startswith("imgs/a.jpg.tensor: agent grpc://h:1 failed: ") and "gRPC" not in warnings[0]
    assert warnings[1].startswith("imgs/d.jpg.tensor: ")
    assert sum("Detail: x" in r.getMessage() for r in caplog.records if r.levelname == "DEBUG") == 4


@needs_fuse
def test_a_failed_transform_is_one_line_in_the_agents_and_the_mounts_log(mount_factory, tmp_path):
    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULES}')
    (m.store / "imgs").mkdir()
    jpeg_file(m.store / "imgs" / "big.jpg", w=200, h=200)              # over max_pixels
    jpeg_file(m.store / "imgs" / "good.jpg", w=64, h=64)
    good = (m.store / "imgs" / "good.jpg").read_bytes()
    (m.store / "imgs" / "cut.jpg").write_bytes(good[:300])              # truncated
    for _ in range(2):
        for name in ("big.jpg", "cut.jpg"):
            with pytest.raises(OSError) as info:
                (m.mnt / "imgs" / f"{name}.tensor").read_bytes()
            assert info.value.errno == errno.EIO
    assert len((m.mnt / "imgs" / "good.jpg.tensor").read_bytes()) > 0
    lines = m.log.read_text().splitlines()
    loud = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln]
    assert not [ln for ln in loud if GRPC.search(ln)], loud

    def named(logger: str, name: str) -> list[str]:
        return [ln for ln in loud if f" {logger}: " in ln and f"imgs/{name}" in ln]
    # the agent (in the mount's process here): once per source, the file and the reason
    assert len(named("hintfs.samples", "big.jpg")) == 1
    assert "over max_pixels=10000" in named("hintfs.samples", "big.jpg")[0]
    assert "truncated JPEG" in named("hintfs.samples", "cut.jpg")[0]
    # the mount: once per source (the second open is remembered), the file and the agent's reason
    big, cut = named("hintfs.tensorfile", "big.jpg"), named("hintfs.tensorfile", "cut.jpg")
    assert len(big) == 1 and len(cut) == 1, loud
    assert "imgs/big.jpg.tensor: " in big[0] and "pixels is over max_pixels=10000" in big[0] and "EIO" in big[0]
    assert "imgs/cut.jpg.tensor: " in cut[0] and "truncated JPEG" in cut[0]
    assert max(len(ln) for ln in big + cut) < 400
    # the whole error, gRPC's context included, at DEBUG only
    assert any(" DEBUG hintfs.tensorfile: imgs/cut.jpg.tensor: " in ln and "sample imgs/cut.jpg failed" in ln
               for ln in lines)
