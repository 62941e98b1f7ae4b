"""The README and the deployment guide, tried as typed (issue 38): every shell block (```sh,
```bash, ```console, ```shell) of README.md and docs/deploy.md runs, in order, in a temporary root,
and must exit 0. A change that breaks a documented command fails the suite.

How a block is run, so that it touches nothing of this machine:

- Absolute host paths (`/etc/...`, `/srv/...`, `/mnt/...`, `/run/...`, `/var/lib/...`,
  `/usr/local/...`, ...; also inside `file:///...`) are rewritten to the same path under a
  temporary root R, in the block's text and, before every `hintfs` command, in the TOML configs
  under R/etc and in the working folder (a config copied from `examples/` names host paths).
- `make` is this checkout's Makefile with `DESTDIR=R`, its set-up taken as done (`-o
  .venv/.setup-done`, as tests/unit/test_install.py does): `make install` installs into R.
  Before a document's first block the test runs `make install` itself, as a reader has done.
- PATH starts with R/usr/local/bin (what `make install` put there), not the .venv; the working
  folder is a fresh one whose entries link the checkout's (`examples/`, `systemd/`, ...).
- `bash -e -o pipefail`; blocks of one document share R, in order; each has a time limit. At the
  end every mount left under R is detached and what a block left running under R is ended.

Blocks that cannot run here go to EXCLUDED_BLOCKS, single commands to EXCLUDED_LINES, each with why
(an entry that no longer matches anything fails, so the list stays true). Console blocks run only
their prompt lines (`$ ` or `# `)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/deploy.md")
BLOCK_TIMEOUT_S = 180   # a hang, not a slow machine: blocks take seconds

# (document, regex searched in the block's text) -> why the whole block is not run.
EXCLUDED_BLOCKS: dict[tuple[str, str], str] = {
}

# (document, regex matched against one command line) -> why that command is not run (it is
# replaced by `true`, so the rest of its block still runs).
EXCLUDED_LINES: dict[tuple[str, str], str] = {
    ("README.md", r"^make test\b"): "runs the whole suite, this test included (and takes minutes)",
    ("README.md", r"^pip install \./client\b"): "installs into a job image's Python, not this host's: "
    "tests/deploy/test_client_package.py builds the wheel and installs it in a clean venv",
    ("docs/deploy.md", r"^systemctl "): "needs a running systemd; the units are checked by "
    "tests/deploy/test_units.py and tests/unit/test_install.py",
    ("docs/deploy.md", r"^journalctl "): "reads systemd's journal of a unit started above",
    ("docs/deploy.md", r"\bgroupadd\b"): "adds a group to this host's /etc/group",
    ("docs/deploy.md", r"^hintfs status /mnt/ckpt\b"): "the mount is the unit's (systemctl, above), and its "
    "store and agents are other hosts (s3.train.example, tier-01.eval.example)",
}

# Host folders a documented command may name; each is moved under the temporary root.
HOST_DIRS = ("etc", "srv", "mnt", "data", "opt", "home", "run", "var/lib", "var/log", "var/cache",
             "usr/local")
# `/etc`, `/srv/x`, `file:///srv/x`; not `.venv/bin`, `a/etc`, `/dev/fuse`, `/proc`, `/tmp`.
_HOST_PATH = re.compile(r"(?:(?<=://)|(?<![\w.~$/:-]))/(" + "|".join(map(re.escape, HOST_DIRS))
                        + r")(?=/|\b)(?!-)")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>sh|bash|console|shell)[ \t]*\n(?P<body>.*?)"
                    r"^(?P=indent)```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    doc: str
    line: int        # of the opening fence, 1-based
    lang: str
    text: str        # the commands, as a shell reads them

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def relocate(text: str, root: str) -> str:
    """Every absolute host path of HOST_DIRS in `text`, moved under `root`."""
    return _HOST_PATH.sub(lambda m: f"{root}/{m.group(1)}", text)


def _console_commands(body: str) -> str:
    """A console block's prompt lines (`$ ` or `# `) and their continuations; output is dropped."""
    out: list[str] = []
    cont = False
    for line in body.splitlines():
        if cont:
            out.append(line)
        elif line.startswith(("$ ", "# ")):
            out.append(line[2:])
        else:
            continue
        cont = line.endswith("\\")
    return "\n".join(out) + "\n"


def blocks(doc: str, text: str) -> list[Block]:
    found = []
    for m in _FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "".join("\n" if not line.strip() else line[indent:] if not line[:indent].strip() else line.lstrip()
                       for line in m.group("body").splitlines(keepends=True))
        if m.group("lang") == "console":
            body = _console_commands(body)
        found.append(Block(doc, text.count("\n", 0, m.start()) + 1, m.group("lang"), body))
    return found


def _excluded_lines(doc: str, body: str, used: set) -> str:
    lines = []
    for line in body.splitlines():
        why = next((key for key in EXCLUDED_LINES if key[0] == doc and re.search(key[1], line.strip())),
                   None)
        if why is not None:
            used.add(why)
            line = "true  # not run here: " + EXCLUDED_LINES[why]
        lines.append(line)
    return "\n".join(lines) + "\n"


_RELOCATE = """\
import pathlib, re, sys
root, work = sys.argv[1], pathlib.Path(sys.argv[2])
pat = re.compile(sys.argv[3])
paths = [*pathlib.Path(root, "etc").rglob("*.toml"), *pathlib.Path(root, "opt").rglob("*.toml"),
         *work.glob("*.toml")]
for p in paths:
    if p.is_file() and not p.is_symlink():
        t = p.read_text()
        n = pat.sub(lambda m: root + "/" + m.group(1), t)
        if n != t:
            p.write_text(n)
"""


def _prelude(root: Path, work: Path) -> str:
    relocate_py = root.parent / "relocate.py"
    relocate_py.write_text(_RELOCATE)
    q = subprocess.list2cmdline
    return (
        f"make() {{ command make -s -C {q([str(REPO)])} -o .venv/.setup-done DESTDIR={root} \"$@\"; }}\n"
        f"hintfs() {{ {q([sys.executable])} -I {relocate_py} {root} {work} "
        f"'{_HOST_PATH.pattern}' && command hintfs \"$@\"; }}\n"
    )


def _cleanup(top: Path) -> None:
    """Detach every mount left under `top`, then end what still runs from it (its daemons)."""
    prefix = str(top) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in reversed([p for p in points if p.startswith(prefix)]):
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
        subprocess.run(["umount", "-l", point], capture_output=True)
    deadline = time.monotonic() + 5
    while True:
        left = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if prefix.encode() in cmd:
                left.append(int(pid))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:   # only processes whose command line names this test's own temporary root
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_blocks(doc: str, found: list[Block]) -> None:
    top = Path(tempfile.mkdtemp(prefix="hd-", dir="/tmp"))   # short: unix socket paths live here
    root, work = top / "r", top / "w"
    for d in (root, work, top / "tmp"):
        d.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git",):
            (work / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HINTFS_"))}
    env.update(PATH=f"{root}/usr/local/bin:{env.get('PATH', '/usr/bin:/bin')}", TMPDIR=str(top / "tmp"),
               HOME=str(top / "tmp"))
    prelude = _prelude(root, work)
    used: set = set()
    try:
        steps = [Block(doc, 0, "sh", "make install >/dev/null\n")]
        for b in found:
            key = next((k for k in EXCLUDED_BLOCKS if k[0] == doc and re.search(k[1], b.text)), None)
            if key is not None:
                used.add(key)
                continue
            steps.append(Block(b.doc, b.line, b.lang, relocate(_excluded_lines(doc, b.text, used), str(root))))
        for b in steps:
            try:
                r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", prelude + b.text], cwd=work, env=env,
                                   capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                                   start_new_session=True)
            except subprocess.TimeoutExpired as e:
                pytest.fail(f"{b.where}: still running after {BLOCK_TIMEOUT_S} s\n{b.text}\n"
                            f"--- stdout\n{e.stdout!s:.3000}\n--- stderr\n{e.stderr!s:.3000}")
            assert r.returncode == 0, (f"{b.where}: exit status {r.returncode}\n{b.text}\n"
                                       f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    finally:
        _cleanup(top)
        shutil.rmtree(top, ignore_errors=True)
    stale = [k for k in (*EXCLUDED_BLOCKS, *EXCLUDED_LINES) if k[0] == doc and k not in used]
    assert not stale, f"exclusions that match nothing in {doc} any more (remove them): {stale}"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("make") is None,
                    reason="needs root, /dev/fuse and make")
@pytest.mark.parametrize("doc", DOCS)
def test_every_shell_block_runs_as_typed(doc):
    path = REPO / doc
    if not path.exists():
        pytest.skip(f"{doc} does not exist yet")
    found = blocks(doc, path.read_text())
    assert found, f"{doc} has no shell block: is the extractor still right?"
    _run_blocks(doc, found)


def test_paths_are_moved_under_the_root_and_nothing_else():
    r = "/tmp/hd-x/r"
    assert relocate("mkdir -p /srv/data /etc/hintfs && cat /etc/hintfs/a.toml", r) == \
        f"mkdir -p {r}/srv/data {r}/etc/hintfs && cat {r}/etc/hintfs/a.toml"
    assert relocate('uri = "file:///srv/data"', r) == f'uri = "file://{r}/srv/data"'
    assert relocate('local_socket = "/run/hintfs/tier.sock"', r) == f'local_socket = "{r}/run/hintfs/tier.sock"'
    assert relocate("/usr/local/bin/hintfs --version", r) == f"{r}/usr/local/bin/hintfs --version"
    for same in ("ls /dev/fuse /proc/self /tmp/x", ".venv/bin/python", "docs/etc/x", "grpc://tier:8815",
                 "/usr/bin/env", "/srvx", "/etc-old", relocate("/etc/x", r)):
        assert relocate(same, r) == same


def test_blocks_are_found_with_their_commands():
    text = ("intro\n```sh\nmake install\n```\n\n- step\n\n  ```bash\n  echo a \\\n    b\n  ```\n"
            "```toml\n[store]\n```\n```console\n$ hintfs --version\nhintfs 1.0\n# ls /srv\n```\n")
    found = blocks("x.md", text)
    assert [(b.line, b.lang, b.text) for b in found] == [
        (2, "sh", "make install\n"), (8, "bash", "echo a \\\n  b\n"),
        (15, "console", "hintfs --version\nls /srv\n")]


def test_the_readme_is_a_page_that_names_every_doc():
    """Issue 38: the README is what a new user reads first, so it stays short (at most 250 lines;
    the rest is in docs/) and names every page of docs/ (docs/operations.md was linked from
    nowhere). bench/README.md, the benches' index, stays short too."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is over 250 lines: move detail into docs/"
    assert len((REPO / "bench/README.md").read_text().splitlines()) <= 250
    unnamed = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in readme]
    assert not unnamed, f"README.md names no docs/{{page}} for: {unnamed}"
