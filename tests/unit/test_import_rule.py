"""The import rule of docs/architecture.md, checked on the code (imports inside functions count):

    common  <-  stores, policy, transforms, mountconfig  <-  fusefs, agent, governor, hintfs  <-  hintfs.cli

and no import cycle between modules."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The installed top-level names (the design card's fusefs, policy, mountconfig, and hintfs); the
# other rooms live under hintfs. (tests/unit/test_install.py checks a built wheel's names.)
PACKAGES = ("hintfs", "policy", "mountconfig", "fusefs")
NESTED = ("common", "stores", "transforms", "agent", "governor")   # hintfs.<room>
BASE = {"common": set(), "stores": {"common"}, "policy": {"common"}, "transforms": {"common"},
        "mountconfig": {"common", "transforms"}}
DAEMON_BELOW = {"common", "stores", "policy", "transforms", "mountconfig"}
# What each room may import besides itself.
ALLOWED = {
    **BASE,
    "agent": DAEMON_BELOW,
    "governor": DAEMON_BELOW,
    # the mount uses the agent's client and starts its in-process agent through one entry point
    "fusefs": DAEMON_BELOW | {"agent"},
    # the job API talks to mounts through files, to agents through the client
    "hintfs": DAEMON_BELOW | {"agent"},
    "hintfs.cli": {"common", "stores", "policy", "transforms", "mountconfig", "fusefs", "agent", "governor", "hintfs"},
}
# (and the link gate: a training mount's streams share the link by class, as the agent's copies do)
# (and the fd client of a tier agent on the same host, for passthrough of its replicas)
MOUNT_MAY_USE = {"hintfs.agent.client", "hintfs.agent.server", "hintfs.agent.rpc", "hintfs.agent.linkgate", "hintfs.agent.fdserver"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours that `name` imports, anywhere in the file."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            # (`from hintfs import transforms` imports hintfs.transforms, not the job API)
            targets = subs if len(subs) == len(node.names) else [base] + subs
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "hintfs" and len(parts) > 1:
        if parts[1] == "cli":
            return "hintfs.cli"
        if parts[1] in NESTED:
            return parts[1]
    return parts[0]


def test_every_import_follows_the_rule():
    known = modules()
    bad = []
    for name, path in known.items():
        room = room_of(name)
        for target in imports_of(name, path, known):
            other = room_of(target)
            if other == room or room == "hintfs.cli":
                continue
            if other == "hintfs" and room == "hintfs.cli":
                continue
            if other not in ALLOWED[room]:
                bad.append(f"{name} imports {target}")
            elif room == "fusefs" and other == "agent" and target not in MOUNT_MAY_USE:
                bad.append(f"{name} imports {target} (the mount may use only {sorted(MOUNT_MAY_USE)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    known = modules()
    edges = {m: imports_of(m, p, known) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(edges):
        if m not in index:
            strong(m)
    assert not cycles, cycles
