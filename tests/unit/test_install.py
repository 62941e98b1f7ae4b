"""`make install` / `make uninstall` into temporary directories (the Makefile's DESTDIR, PREFIX,
CONFDIR, UNITDIR): the console script on the PATH, the example config never overwritten, and the
systemd units as installed, verified with `systemd-analyze verify` where it exists and by their
structure everywhere."""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = ("hintfs-mount@", "hintfs-agent@", "hintfs-governor@")
INSTANCE = {"hintfs-mount@": "srv-ckpt", "hintfs-agent@": "node", "hintfs-governor@": "hintfs"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def make(*args: str) -> subprocess.CompletedProcess:
    # -o: the .venv this test runs in is set up; do not redo `make setup` (pip) from a test.
    r = subprocess.run(["make", "-s", "-C", str(REPO), "-o", ".venv/.setup-done", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def unit_file(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str   # keys are case-sensitive
    cp.read_string(path.read_text())
    return cp


def test_destdir_install_puts_everything_where_the_units_look(tmp_path):
    dest = tmp_path / "root"
    make("install", f"DESTDIR={dest}")
    script = dest / "usr/local/bin/hintfs"
    assert script.is_symlink() and script.resolve() == (REPO / ".venv/bin/hintfs").resolve()
    assert os.access(script, os.X_OK)
    config = dest / "etc/hintfs/srv-ckpt.toml"
    assert config.read_text() == (REPO / "examples/srv-ckpt.toml").read_text()
    for name in UNITS:
        unit = unit_file(dest / f"etc/systemd/system/{name}.service")
        exec_start = unit["Service"]["ExecStart"].split()
        # What the unit runs is what `make install` installed (the path inside DESTDIR's root).
        assert exec_start[0] == "/usr/local/bin/hintfs"
        assert (dest / exec_start[0].lstrip("/")).exists()
        assert any(a.startswith("/etc/hintfs/%i.toml") for a in exec_start)
        doc = unit["Unit"]["Documentation"].removeprefix("file://")
        assert (dest / doc.lstrip("/")).is_file(), doc
    assert (dest / "usr/local/share/doc/hintfs/config.md").is_file()


def test_install_keeps_an_existing_config_and_uninstall_keeps_a_changed_one(tmp_path):
    dest = tmp_path / "root"
    make("install", f"DESTDIR={dest}")
    config = dest / "etc/hintfs/srv-ckpt.toml"
    config.write_text('[store]\nuri = "file:///data/mine"\n')
    (dest / "etc/hintfs/other.toml").write_text("[store]\n")
    r = make("install", f"DESTDIR={dest}")
    assert "left as it is" in r.stdout
    assert config.read_text() == '[store]\nuri = "file:///data/mine"\n'
    make("uninstall", f"DESTDIR={dest}")
    assert not (dest / "usr/local/bin/hintfs").exists() and not (dest / "usr/local/bin/hintfs").is_symlink()
    assert not list((dest / "etc/systemd/system").iterdir())
    assert config.exists() and (dest / "etc/hintfs/other.toml").exists()


def test_uninstall_removes_an_unchanged_example(tmp_path):
    dest = tmp_path / "root"
    make("install", f"DESTDIR={dest}")
    make("uninstall", f"DESTDIR={dest}")
    assert not (dest / "etc/hintfs").exists()
    assert not (dest / "usr/local/share/doc/hintfs").exists()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """An install under a temporary PREFIX, CONFDIR and UNITDIR (no DESTDIR): the units name
    paths that exist on this host, so systemd-analyze can check them."""
    base = tmp_path_factory.mktemp("prefix")
    dirs = {"PREFIX": base / "usr", "CONFDIR": base / "etc/hintfs", "UNITDIR": base / "units"}
    make("install", *(f"{k}={v}" for k, v in dirs.items()))
    return dirs


@pytest.mark.parametrize("name", UNITS)
def test_installed_unit_structure(installed, name):
    path = installed["UNITDIR"] / f"{name}.service"
    unit = unit_file(path)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    exec_start = unit["Service"]["ExecStart"].split()
    binary = Path(exec_start[0])
    assert binary == installed["PREFIX"] / "bin/hintfs"
    assert os.access(binary, os.X_OK)
    verb = name.removeprefix("hintfs-").removesuffix("@")
    assert exec_start[1] == verb and exec_start[2] == f"{installed['CONFDIR']}/%i.toml"
    assert unit["Service"]["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    if name in ("hintfs-mount@", "hintfs-agent@"):
        assert unit["Service"]["Type"] == "notify"
        assert unit["Unit"]["ConditionPathExists"] == f"{installed['CONFDIR']}/%i.toml"
    if name == "hintfs-mount@":
        assert "--foreground" in exec_start
        assert "fusermount3 -u" in unit["Service"]["ExecStopPost"]
    # What the unit runs answers (the symlink reaches the .venv's console script).
    r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("hintfs "), r.stderr


@pytest.mark.parametrize("name", UNITS)
def test_installed_unit_verifies(installed, name):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (the structure is checked above)")
    instance = installed["UNITDIR"] / f"{name}{INSTANCE[name]}.service"
    r = subprocess.run([analyze, "verify", str(instance)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if name in line]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_the_wheel_installs_only_names_of_our_own(tmp_path):
    """An installed hintfs adds to a job's environment only `hintfs` and the design card's
    `fusefs`, `policy` and `mountconfig` as top-level import names (issue 36): no `common`,
    `agent`, `stores`, `transforms` or `governor` to clash with a training image's packages."""
    import zipfile
    src = tmp_path / "src"
    # (a copy: the build writes build/ and *.egg-info beside the sources)
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info",
                                                              "__pycache__", "bench", "tests", "docs"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("hintfs-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"hintfs", "fusefs", "policy", "mountconfig"}, sorted(top)
    assert "hintfs/agent/server.py" in names and "hintfs/common/paths.py" in names
