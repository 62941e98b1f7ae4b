"""The handle an open gets, as a table (`fusefs.handles.choose_handle`: a pure function of what the
open sees; no kernel, no store). docs/semantics.md ("FUSE passthrough") says why each row is so."""
from __future__ import annotations

import pytest

from fusefs.handles import HandleKind, OpenFacts, choose_handle
from fusefs.interfaces import Source

K = HandleKind
PT = dict(passthrough=True, local_fd=True)          # passthrough granted, a local fd at hand
READ = OpenFacts()
WRITE = OpenFacts(writing=True, local_fd=True)      # (a staging file always has an fd)

# (what the open sees, the kind it gets)
TABLE = [
    # control and virtual files, whatever else is true
    (OpenFacts(control=True), K.CONTROL),
    (OpenFacts(control=True, writing=True, **PT), K.CONTROL),
    (OpenFacts(virtual=True), K.TENSOR),
    (OpenFacts(virtual=True, shared_backing=True, **PT), K.TENSOR),
    # reads of a store file
    (READ, K.STORE_READ),
    (OpenFacts(local_fd=True), K.STORE_READ),                              # passthrough off
    (OpenFacts(**PT), K.PASSTHROUGH_STORE),
    (OpenFacts(passthrough=True), K.STORE_READ),                           # an object store's reader: no fd
    (OpenFacts(other_opens=True, **PT), K.STORE_READ),                     # never mixed with open handles
    # a writer of this mount has it open: its staging, or the backing its passthrough opens share
    (OpenFacts(writer=True, **PT), K.STAGING_READ),
    (OpenFacts(writer=True, shared_backing=True, **PT), K.PASSTHROUGH_SHARED),
    (OpenFacts(shared_backing=True), K.PASSTHROUGH_SHARED),                # shared even if passthrough went off
    (OpenFacts(shared_backing=True, other_opens=True, source=Source.TIER), K.PASSTHROUGH_SHARED),
    # hinted files with replicas, routed files the tier holds
    (OpenFacts(source=Source.REPLICAS), K.REPLICA_READ),
    (OpenFacts(source=Source.REPLICAS, passthrough=True), K.REPLICA_READ),  # no replica on this host
    (OpenFacts(source=Source.REPLICAS, **PT), K.PASSTHROUGH_REPLICA),
    (OpenFacts(source=Source.REPLICAS, other_opens=True, **PT), K.REPLICA_READ),
    (OpenFacts(source=Source.TIER), K.REPLICA_READ),
    (OpenFacts(source=Source.TIER, **PT), K.PASSTHROUGH_REPLICA),          # the tier agent's fd socket
    (OpenFacts(source=Source.TIER, local_fd=True), K.REPLICA_READ),
    # a routed file the tier is still receiving: each read asks the tier, never passthrough
    (OpenFacts(source=Source.DEMAND), K.STORE_READ),
    (OpenFacts(source=Source.DEMAND, **PT), K.STORE_READ),
    # writes
    (WRITE, K.WRITE),
    (WRITE._replace(passthrough=True), K.PASSTHROUGH_WRITE),
    (WRITE._replace(passthrough=True, space_ok=False), K.WRITE),      # below passthrough_min_free_mb
    (WRITE._replace(passthrough=True, other_opens=True), K.WRITE),
    (WRITE._replace(shared_backing=True), K.PASSTHROUGH_WRITE),       # the writer's own backing
    (WRITE._replace(shared_backing=True, space_ok=False, other_opens=True), K.PASSTHROUGH_WRITE),
    (WRITE._replace(passthrough=True, local_fd=False), K.WRITE),      # a staging without an fd
    (WRITE._replace(passthrough=True, source=Source.TIER, writer=True), K.PASSTHROUGH_WRITE),
]


@pytest.mark.parametrize("facts, kind", TABLE, ids=[f"{i}-{k.name}" for i, (_f, k) in enumerate(TABLE)])
def test_the_handle_an_open_gets(facts, kind):
    assert choose_handle(facts) is kind


def test_every_kind_is_reachable():
    assert {kind for _facts, kind in TABLE} == set(HandleKind)


@pytest.mark.parametrize("kind, fallback", [
    (K.PASSTHROUGH_WRITE, K.WRITE), (K.PASSTHROUGH_REPLICA, K.REPLICA_READ), (K.PASSTHROUGH_STORE, K.STORE_READ),
    (K.PASSTHROUGH_SHARED, K.PASSTHROUGH_SHARED), (K.STORE_READ, K.STORE_READ), (K.WRITE, K.WRITE),
])
def test_a_refused_backing_falls_back_to_the_daemons_path(kind, fallback):
    assert kind.fallback is fallback


def test_the_choice_is_pure():
    facts = OpenFacts(source=Source.TIER, **PT)
    assert [choose_handle(facts) for _ in range(3)] == [K.PASSTHROUGH_REPLICA] * 3
    with pytest.raises(AttributeError):
        facts.passthrough = False   # type: ignore[misc]
