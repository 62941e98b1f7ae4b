"""Blocking client of a storage agent (Arrow Flight). Used from worker threads of the mount,
from other agents (tree fan-out) and from the benchmarks."""
from __future__ import annotations

import json
from typing import Optional

import pyarrow.flight as fl

from agent.rpc import errno_of_flight_error


class AgentError(OSError):
    pass


def _errno_of(err: Exception) -> int:
    return errno_of_flight_error(err)


class AgentClient:
    def __init__(self, location: str, token: Optional[str] = None, tls_root: Optional[bytes] = None,
                 timeout_s: float = 30.0):
        self.location = location
        kwargs = {}
        if tls_root:
            kwargs["tls_root_certs"] = tls_root
        self._client = fl.FlightClient(location, **kwargs)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._opts = fl.FlightCallOptions(headers=headers, timeout=timeout_s)

    def _call(self, kind: str, body: dict) -> dict:
        try:
            results = list(self._client.do_action(fl.Action(kind, json.dumps(body).encode()), self._opts))
        except fl.FlightError as err:
            raise AgentError(_errno_of(err), f"agent {self.location}: {kind} failed: {err}") from None
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def _get(self, doc: dict, what: str):
        """One do_get stream, read whole; Flight errors become AgentError naming `what`."""
        try:
            return self._client.do_get(fl.Ticket(json.dumps(doc).encode()), self._opts).read_all()
        except fl.FlightError as err:
            raise AgentError(_errno_of(err), f"agent {self.location}: {what} failed: {err}") from None

    def read(self, path: str, offset: int, length: int, replica_only: bool = False,
             expect: Optional[tuple[int, int]] = None) -> bytes:
        """Bytes of `path`; with `expect` = (size, mtime_ns), never from a replica of another version."""
        req = {"path": path, "offset": offset, "length": length, "replica_only": replica_only}
        if expect is not None:
            req["expect"] = list(expect)
        table = self._get(req, f"read {path}")
        col = table.column(0)
        return col[0].as_py() if len(col) else b""

    def sample(self, path: str, kind: str, params_json: str, aug_seed: int, allow_raw: bool = True) -> bytes:
        """The bytes of `path`'s `.tensor` file, transformed on the agent (or raw, see samples.py)."""
        table = self._get({"op": "sample", "path": path, "kind": kind, "params": params_json,
                           "aug_seed": aug_seed, "allow_raw": allow_raw}, f"sample {path}")
        return table.column(0)[0].as_py()

    def samples_ready(self, samples: list) -> list[tuple[str, int, bytes]]:
        """Of [path, kind, params_json, aug_seed] items, the `.tensor` bytes the agent has ready,
        as (path, aug_seed, bytes), in one call; samples not ready are left out."""
        table = self._get({"op": "samples_ready", "samples": samples}, "samples_ready")
        return list(zip(table.column("path").to_pylist(), table.column("seed").to_pylist(),
                        table.column("data").to_pylist()))

    def plan_window(self, keep: list, want: list) -> dict:
        """Free transformed samples not in `keep`, start making `want` (one call per plan step)."""
        return self._call("plan_window", {"keep": keep, "want": want})

    def replicate(self, path: str, ttl_s: float, source: Optional[str] = None, priority: str = "background",
                  job: Optional[str] = None, importance: float = 1.0,
                  expect: Optional[tuple[int, int]] = None) -> dict:
        return self._call("replicate", {"path": path, "ttl_s": ttl_s, "source": source, "priority": priority,
                                        "job": job, "importance": importance,
                                        "expect": list(expect) if expect is not None else None})

    def tier_stat(self, path: str) -> dict:
        """{"state": "ready"|"copying", "size", "mtime_ns"} | {"state": "dir"} | {"state": "absent"}"""
        return self._call("tier_stat", {"path": path})

    def signal(self, job: str, severity: float = 1.0, clear: bool = False) -> dict:
        return self._call("signal", {"job": job, "severity": severity, "clear": clear})

    def has(self, path: str, size: int, mtime_ns: int) -> bool:
        return bool(self._call("has", {"path": path, "size": size, "mtime_ns": mtime_ns}).get("has"))

    def drop(self, path: str) -> dict:
        return self._call("drop", {"path": path})

    def status(self) -> dict:
        return self._call("status", {})

    def ping(self) -> bool:
        return bool(self._call("ping", {}).get("ok"))

    def close(self) -> None:
        self._client.close()
