"""The stream sender's calls to the eval tier agents (`[stream] agents`): a streamer's
`Transport` over Flight (`hintfs.agent.client`), and one streamer per tier agent behind one link gate."""
from __future__ import annotations


from hintfs.agent.client import AgentClient
from hintfs.agent.linkgate import LinkGate
from fusefs.stream.streamer import PublishAnswer, PutAnswer, Streamer
from mountconfig.schema import StreamConfig


class FlightTransport:
    """`fusefs.stream.streamer.Transport` over an eval tier agent's Flight calls (`hintfs.agent.client`)."""

    SMALL = 256 << 10    # a publish carrying at most this many bytes goes by the control connection

    def __init__(self, client, ttl_s: float = 86400.0, control=None, urgent=None, compress: bool = False):
        self.client = client
        self.compress = compress      # `[stream] compress`: chunks compressed where that pays
        # Opens, publishes and aborts on a connection of their own: on a long link, a publish
        # sent behind the chunks in flight on the bulk connection waits for all of them (the
        # eval side then waits for the file's version, or copies it a second time).
        self.control = control if control is not None else client
        # Chunks eval reads want first on a third: they share the link with the bulk at once.
        self.urgent = urgent if urgent is not None else client
        self.ttl_s = ttl_s

    def open(self, sid, gen, path, chunk, job=None):
        return self.control.stream_open(sid, gen, path, chunk, job)

    def put(self, sid, gen, chunks, opening=None, seen=None, urgent=False):
        doc = (self.urgent if urgent else self.client).stream_put(
            sid, gen, list(chunks),
            opening=None if opening is None else {"path": opening[0], "chunk": opening[1], "job": opening[2]},
            seen=seen, compress=self.compress)
        return PutAnswer(doc.get("first", []) if opening is not None else None, doc.get("state") == "ready")

    def publish(self, sid, gen, path, size, mtime_ns, crcs, record=None, chunks=(), opening=None):
        small = sum(len(c[1]) for c in chunks) <= self.SMALL
        doc = (self.control if small else self.client).stream_put(
            sid, gen, list(chunks),
            opening=None if opening is None else {"path": opening[0], "chunk": opening[1], "job": opening[2]},
            publish={"path": path, "size": size, "mtime_ns": mtime_ns, "crcs": list(crcs), "record": record,
                     "ttl_s": self.ttl_s}, compress=self.compress)
        return PublishAnswer(doc.get("state", "fill"), tuple(int(i) for i in doc.get("fetch", ())),
                             doc.get("first", []) if opening is not None else None)

    def abort(self, sid):
        self.control.stream_abort(sid)


def build_streamers(sc: StreamConfig, token: str | None, tls_root: bytes | None) -> list[Streamer]:
    """`[stream]`: one streamer per eval tier agent, behind one link gate for this mount."""
    link = LinkGate(sc.link_bytes_s, sc.chunk_bytes) if sc.link_bytes_s else None

    def transport(loc: str) -> FlightTransport:
        def own() -> AgentClient:
            return AgentClient(loc, token=token, tls_root=tls_root, timeout_s=sc.timeout_s, own_connection=True)
        return FlightTransport(AgentClient(loc, token=token, tls_root=tls_root, timeout_s=sc.timeout_s),
                               control=own(), urgent=own() if sc.first_by_reads else None, compress=sc.compress)
    return [Streamer(transport(loc), sc.chunk_bytes, parallel=sc.parallel, link=link, call_bytes=sc.call_bytes,
                     first_by_reads=sc.first_by_reads, others_in_flight=sc.others_in_flight, nice=sc.sender_nice,
                     others_while_writing=sc.others_while_writing)
            for loc in sc.agents]


__all__ = ["FlightTransport", "build_streamers"]
