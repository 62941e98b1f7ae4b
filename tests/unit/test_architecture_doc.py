"""docs/architecture.md matches the code: every module, attribute, path, command and process it
names in backquotes exists, and every module of ours that runs as a program is in its table of
processes. The test knows no names of its own beyond the kinds of process the page must have: it
reads the page, so a module moved or renamed fails here until the page follows it."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
# the installed top-level packages (the other rooms are hintfs.common, hintfs.agent, ...)
ROOMS = ("hintfs", "policy", "mountconfig", "fusefs")
TOP = ROOMS + ("docs", "tests", "bench", "systemd", "examples")   # folders a named path may start with
# the processes the page must name (issue 36): a row of its table whose first cell says each
KINDS = ("mount", "sender", "agent", "transform", "governor")

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?")


def text() -> str:
    return DOC.read_text()


def spans(md: str) -> list[str]:
    """The backquoted names of the page, outside code blocks (the drawings)."""
    prose = re.sub(r"^\s*```.*?^\s*```", "", md, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def section(md: str, title: str) -> str:
    m = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", md, flags=re.S | re.M)
    assert m, f"docs/architecture.md has no section '## {title}'"
    return m.group(1)


def process_rows(md: str) -> list[list[str]]:
    """The table of processes: one list of cells per row."""
    rows = [line for line in section(md, "Processes").splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]   # (after the header and |---|)


def resolve(name: str) -> object:
    """The object `name` (a.b.c, a.b:attr) names: its longest importable module prefix, imported,
    then attributes. Raises when any part is missing."""
    name = name.replace(":", ".")
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj: object = importlib.import_module(module)
        for attr in parts[i:]:
            obj = getattr(obj, attr)   # AttributeError names what is missing
        return obj
    raise ModuleNotFoundError(name)


def runnable(module: str) -> bool:
    """`python -m module` runs something: a package with `__main__`, or a module with a main guard."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations:          # a package
        return importlib.util.find_spec(f"{module}.__main__") is not None
    assert spec.origin is not None
    return has_main_guard(Path(spec.origin))


def has_main_guard(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return True
    return False


def ours(name: str) -> bool:
    return name.split(".")[0].split(":")[0] in ROOMS


def check(span: str) -> str | None:
    """What is wrong with one backquoted name (None: it exists, or it names nothing of ours)."""
    words = span.split()
    if "-m" in words[:-1]:                        # a command: python [-I] -m MODULE ARGS...
        module = words[words.index("-m") + 1]
        if ours(module) and not runnable(module):
            return f"`{span}`: {module} is not a module that runs with -m"
        return None
    if words[0] == "hintfs" and len(words) > 1 and re.fullmatch(r"[a-z]+", words[1]):   # a verb
        if not (REPO / "hintfs" / "cli" / f"{words[1]}.py").exists():
            return f"`{span}`: no verb {words[1]} in hintfs/cli/"
        return None
    if len(words) != 1:
        return None
    if "/" in span:                               # a path in the repository
        if span.split("/")[0] in TOP and not any(c in span for c in "<>*"):
            if not (REPO / span).exists():
                return f"`{span}`: no such file or folder"
        return None
    if DOTTED.fullmatch(span) and ours(span):
        try:
            resolve(span)
        except Exception as err:                  # (an import error is a finding too)
            return f"`{span}`: {type(err).__name__}: {err}"
    return None


def test_every_module_path_and_command_the_page_names_exists():
    bad = [problem for span in dict.fromkeys(spans(text())) if (problem := check(span))]
    assert not bad, "docs/architecture.md names what the code lacks:\n" + "\n".join(bad)


def test_it_names_modules_at_all():
    """(the checks above look at something: the page still names its modules in backquotes)"""
    named = [s for s in spans(text()) if DOTTED.fullmatch(s) and ours(s) and "." in s]
    assert len(named) >= 20, named


def test_every_process_has_an_entry_point_that_exists():
    rows = process_rows(text())
    for kind in KINDS:
        assert any(kind in row[0] for row in rows), f"no process '{kind}' in the table of docs/architecture.md"
    for row in rows:
        entry = row[2]
        names = re.findall(r"`([^`]+)`", entry)
        found = [n for n in names if check(n) is None and (
            ("-m" in n.split() and ours(n.split()[n.split().index("-m") + 1]))
            or (DOTTED.fullmatch(n) and ours(n) and callable(resolve(n))))]
        assert found, f"process {row[0]!r}: no entry point of ours that exists among {names}"


def program_modules() -> set[str]:
    """Modules of ours that run as a program: `__main__.py` (as its package) or a main guard."""
    out = set()
    for room in ROOMS:
        for path in (REPO / room).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__main__":
                out.add(".".join(parts[:-1]))
            elif has_main_guard(path):
                out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_program_of_ours_is_a_process_of_the_table():
    table = " ".join(row[2] for row in process_rows(text()))
    names = set()
    for span in re.findall(r"`([^`]+)`", table):
        words = span.split()
        if "-m" in words[:-1]:
            names.add(words[words.index("-m") + 1])
        for n in words:
            if DOTTED.fullmatch(n):
                n = n.split(":")[0]
                names.update(".".join(n.split(".")[:i]) for i in range(1, n.count(".") + 2))
    missing = sorted(m for m in program_modules() if m not in names)
    assert not missing, f"programs not in the table of processes of docs/architecture.md: {missing}"


@pytest.mark.parametrize("span, wrong", [
    ("fusefs.no_such_module", True),
    ("fusefs.stream.hooks.NoSuchName", True),
    ("python -I -m fusefs.stream.hooks FD", True),     # a module, but no program
    ("hintfs frobnicate", True),
    ("fusefs/no_such.py", True),
    ("fusefs/stream/hooks.py", False),
    ("hintfs.cli:main", False),
    (".hintfs/hints/<job>", False),                    # a path inside a mount, not the repository
    ("[stream] agents", False),
])
def test_the_checker_itself(span, wrong):
    assert (check(span) is not None) is wrong
