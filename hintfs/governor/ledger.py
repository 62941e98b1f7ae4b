"""Per-GPU ledger: who holds how many bytes of which kind. Pure bookkeeping, no I/O, no torch.

Inference clients hold *reservations* (bytes granted by kind). Training clients hold a *quota*:
the most bytes they may keep on the GPU; they size micro-batches to stay under it and report
their actual use by kind. A shrink lowers the quota only once the client acknowledged, so
`free_bytes()` never counts memory that is still in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class MemoryKind(str, Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    ACTIVATIONS = "activations"
    OPTIMIZER_STATE = "optimizer_state"  # includes gradients and their accumulator
    WORKSPACE = "workspace"


class Role(str, Enum):
    TRAINING = "training"
    INFERENCE = "inference"
    OBSERVER = "observer"     # holds nothing: sees the BUSY count (a trainer outside the ledger)


class LedgerError(ValueError):
    pass


@dataclass
class ClientEntry:
    client_id: int
    role: Role
    pid: int
    name: str
    slot: int
    quota: int = 0  # training: bytes it may hold; inference: unused
    reserved: dict[MemoryKind, int] = field(default_factory=dict)  # inference grants
    reported: dict[MemoryKind, int] = field(default_factory=dict)  # what the client says it uses
    uid: int = -1

    def held(self) -> int:
        """Bytes this client holds in the ledger's eyes."""
        if self.role is Role.TRAINING:
            return self.quota
        return sum(self.reserved.values())


@dataclass
class HeldBack:
    """Memory a client of a previous daemon instance may still hold: counted as used until the
    client registers again (and says what it holds) or its process is gone."""
    client_id: int
    role: Role
    pid: int
    start: int        # the process's start time (/proc/PID/stat field 22): pid reuse is not it
    uid: int
    name: str
    nbytes: int


class GpuLedger:
    def __init__(self, index: int, total_bytes: int, reserve_bytes: int) -> None:
        if reserve_bytes >= total_bytes:
            raise LedgerError("reserve must be below total")
        self.index = index
        self.total_bytes = total_bytes
        self.reserve_bytes = reserve_bytes
        self.clients: dict[int, ClientEntry] = {}
        self.held_back: dict[int, HeldBack] = {}

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - self.reserve_bytes

    # --- membership -----------------------------------------------------------------
    def add(self, entry: ClientEntry) -> None:
        if entry.client_id in self.clients:
            raise LedgerError(f"client {entry.client_id} already registered")
        if entry.quota and entry.quota > self.free_bytes():
            raise LedgerError("initial quota exceeds free memory")
        self.clients[entry.client_id] = entry

    def remove(self, client_id: int) -> int:
        """Forget a client (exited or died); returns the bytes that became free."""
        entry = self.clients.pop(client_id, None)
        return entry.held() if entry else 0

    def training(self) -> list[ClientEntry]:
        return [c for c in self.clients.values() if c.role is Role.TRAINING]

    def inference(self) -> list[ClientEntry]:
        return [c for c in self.clients.values() if c.role is Role.INFERENCE]

    # --- totals ---------------------------------------------------------------------
    def inference_bytes(self) -> int:
        return sum(c.held() for c in self.inference())

    def training_bytes(self) -> int:
        return sum(c.held() for c in self.training())

    def held_back_bytes(self) -> int:
        return sum(h.nbytes for h in self.held_back.values())

    def free_bytes(self) -> int:
        return self.usable_bytes - self.inference_bytes() - self.training_bytes() - self.held_back_bytes()

    # --- a previous instance's clients ------------------------------------------------------
    def hold_back(self, h: HeldBack) -> None:
        self.held_back[h.client_id] = h

    def release_held_back(self, client_id: int) -> HeldBack | None:
        return self.held_back.pop(client_id, None)

    def by_kind(self) -> dict[str, int]:
        """Bytes per kind: inference grants plus training's reported use."""
        out = {k.value: 0 for k in MemoryKind}
        for c in self.clients.values():
            src = c.reserved if c.role is Role.INFERENCE else c.reported
            for k, v in src.items():
                out[k.value] += v
        return out

    # --- inference ------------------------------------------------------------------
    def grant(self, client_id: int, kind: MemoryKind, nbytes: int) -> None:
        c = self._get(client_id, Role.INFERENCE)
        if nbytes < 0:
            raise LedgerError("negative reservation")
        if nbytes > self.free_bytes():
            raise LedgerError(f"grant of {nbytes} exceeds free {self.free_bytes()}")
        c.reserved[kind] = c.reserved.get(kind, 0) + nbytes

    def release(self, client_id: int, kind: MemoryKind, nbytes: int) -> int:
        """Return part of a reservation; clamps at what the client holds; returns bytes freed."""
        c = self._get(client_id, Role.INFERENCE)
        have = c.reserved.get(kind, 0)
        freed = min(max(nbytes, 0), have)
        c.reserved[kind] = have - freed
        return freed

    # --- training -------------------------------------------------------------------
    def set_quota(self, client_id: int, quota: int) -> None:
        c = self._get(client_id, Role.TRAINING)
        if quota < 0:
            raise LedgerError("negative quota")
        if quota > c.quota and quota - c.quota > self.free_bytes():
            raise LedgerError("quota increase exceeds free memory")
        c.quota = quota

    def report(self, client_id: int, usage: dict[MemoryKind, int]) -> None:
        c = self.clients.get(client_id)
        if c is None:
            raise LedgerError(f"unknown client {client_id}")
        reported = {k: min(max(0, int(v)), self.usable_bytes) for k, v in usage.items()}
        c.reported = reported
        self._cut_reported(c, self.usable_bytes)    # never more than the card in all

    def trim_reported(self, client_id: int, used: int) -> None:
        """A training client acknowledged a shrink holding `used` bytes: its last report (made
        at a step end, before the shrink) may say more. Take the excess off the elastic kinds
        first (activations, then workspace), so memory by kind never shows what was given back."""
        c = self.clients.get(client_id)
        if c is None:
            return
        self._cut_reported(c, min(max(0, int(used)), self.usable_bytes))

    @staticmethod
    def _cut_reported(c: ClientEntry, most: int) -> None:
        excess = sum(c.reported.values()) - most
        order = [MemoryKind.ACTIVATIONS, MemoryKind.WORKSPACE, MemoryKind.KV_CACHE,
                 MemoryKind.OPTIMIZER_STATE, MemoryKind.WEIGHTS]
        for k in order:
            if excess <= 0:
                break
            cut = min(excess, c.reported.get(k, 0))
            if cut:
                c.reported[k] -= cut
                excess -= cut

    def plan_shrink(self, needed: int, floor_total: int) -> dict[int, int]:
        """New quotas for training clients that free at least `needed` bytes, taking from the
        largest quota first and never taking training's total below `floor_total`.
        Returns {} when nothing is needed; may free less than needed if the floor binds."""
        if needed <= 0:
            return {}
        takeable = max(0, self.training_bytes() - floor_total)
        todo = min(needed, takeable)
        plan: dict[int, int] = {}
        for c in sorted(self.training(), key=lambda c: -c.quota):
            if todo <= 0:
                break
            take = min(c.quota, todo)
            if take > 0:
                plan[c.client_id] = c.quota - take
                todo -= take
        return plan

    def _get(self, client_id: int, role: Role) -> ClientEntry:
        c = self.clients.get(client_id)
        if c is None:
            raise LedgerError(f"unknown client {client_id}")
        if c.role is not role:
            raise LedgerError(f"client {client_id} is {c.role.value}, not {role.value}")
        return c

    def snapshot(self) -> dict:
        return {
            "gpu": self.index,
            "total_bytes": self.total_bytes,
            "usable_bytes": self.usable_bytes,
            "free_bytes": self.free_bytes(),
            "inference_bytes": self.inference_bytes(),
            "training_bytes": self.training_bytes(),
            "held_back_bytes": self.held_back_bytes(),
            "held_back": [{"client": h.client_id, "role": h.role.value, "pid": h.pid,
                           "name": h.name, "bytes": h.nbytes} for h in self.held_back.values()],
            "by_kind": self.by_kind(),
            "clients": [
                {"client": c.client_id, "role": c.role.value, "pid": c.pid, "name": c.name,
                 "held": c.held(), "quota": c.quota,
                 "reserved": {k.value: v for k, v in c.reserved.items()},
                 "reported": {k.value: v for k, v in c.reported.items()}}
                for c in self.clients.values()
            ],
        }
