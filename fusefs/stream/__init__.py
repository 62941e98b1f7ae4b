"""Write-time streaming, the training mount's side (`[stream]`, docs/cross_dc.md "Write-time
streaming"): each file under the streamed prefixes is sent to the eval DC's tier agents while the
job writes it. A map:

- `hooks.py`     `StreamFront`, the filesystem's `StreamHooks` (fusefs/interfaces.py): what is
                 streamed, where each inode's stream stands, what a release or a rename does
                 (follow the inode, send a small file again from the store, or leave it to the
                 follower), decided once; it hands a `Sink` one command per hook.
- `threads.py`   `ThreadSink`: the pump and its workers, which step each file's streams.
- `process.py`   `ProcessSink` (the default, `sender = "process"`): the mount's end of the
                 sender child; restarts it, and tells a new one every live stream.
- `sender.py`    the sender child, `python -I -m fusefs.stream.sender FD` in `/`: a `ThreadSink`
                 at `sender_nice` (in a session and autogroup of its own), on `sender_cpus`.
- `wire.py`      the messages between the two (SOCK_SEQPACKET, JSON, one fd beside).
- `streamer.py`  `Streamer`: one file's chunks, CRCs and publish against a `Transport`.
- `flight.py`    that `Transport` over the tier agents' Flight calls, one streamer per agent.

The part takes its config slice (`StreamConfig`), the tier credentials, the mount's counters and
a way to read a file back from the store; never the whole mount config.
"""
from __future__ import annotations

from fusefs.stream.flight import build_streamers
from fusefs.stream.hooks import Counters, Finished, ReadStore, Sink, StreamFront
from fusefs.stream.process import ProcessSink
from fusefs.stream.threads import ThreadSink
from mountconfig.schema import StreamConfig


def open_stream(sc: StreamConfig, stats: Counters, token: str | None, tls_root: bytes | None,
                read_store: ReadStore | None = None, log_level: str = "INFO",
                log_file: str | None = None) -> StreamFront:
    """The hooks over the sink `sc.sender` names: the sender child (`"process"`, logging as told)
    or threads of this process (`"threads"`)."""
    def make_sink(finished: Finished) -> Sink:
        if sc.sender == "process":
            return ProcessSink(sc, token, tls_root, stats, finished, log_level=log_level, log_file=log_file)
        return ThreadSink(sc, build_streamers(sc, token, tls_root), stats, on_finished=finished)
    return StreamFront(sc, make_sink, read_store)


__all__ = ["open_stream", "StreamFront", "ThreadSink", "ProcessSink"]
