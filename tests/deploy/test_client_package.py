"""The job-side distribution `hintfs-client` (client/pyproject.toml, docs/client.md): its wheel is
built from the checkout's own modules and holds the job API and what it imports, nothing else; it
installs into a clean venv (no system site packages) without pyfuse3, trio, a compiler or torch,
and the job API from that venv drives a real mount: hints and replicas, a read, a plan, `.tensor`
loads in tensor and raw mode.

The venv's dependencies come from a wheelhouse that `pip download` fills from the configured index
(pip's cache makes it quick after the first run), then install with `--no-index`: the same two
steps an image build without network at install time uses (docs/client.md). The file takes about
10 s here (the venv about 6 s of it), up to about 30 s on a busy 2-core machine."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import needs_fuse
from tests.unit.test_import_rule import imports_of, modules

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "client" / "pyproject.toml"
# What a job imports; the wheel holds these and every module of ours they import (anywhere).
JOB_API = ("hintfs.client", "hintfs.hintsource", "hintfs.plan", "hintfs.dataset", "hintfs.transforms.container")
# import name -> distribution, for the third-party imports of the wheel's modules
DISTS = {"numpy": "numpy", "pydantic": "pydantic", "pyarrow": "pyarrow", "av": "av",
         "safetensors": "safetensors", "torch": "torch"}
# modules of ours that only the daemons and the command use
DAEMON_ROOMS = ("fusefs", "mountconfig", "hintfs.agent", "hintfs.governor", "hintfs.cli", "hintfs.stores")


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")


def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                       env=_clean_env())
    assert r.returncode == 0, f"pip {' '.join(args)}:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    return r


def _clean_env() -> dict[str, str]:
    # nothing of this checkout's interpreter leaks into the venv's
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def closure() -> set[str]:
    """The job API's modules, every module of ours they import, and their packages."""
    known = modules()
    todo, seen = list(JOB_API), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(imports_of(m, known[m], known))
    parents = {".".join(m.split(".")[:i]) for m in seen for i in range(1, m.count(".") + 1)}
    return seen | parents


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel client/` on a copy of client/ and the packages the wheel's modules come from
    (the build writes build/ and an egg-info beside its sources)."""
    tmp = tmp_path_factory.mktemp("client")
    src = tmp / "src"
    for top in ("client", "hintfs", "policy"):
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src / "client"))
    (found,) = (tmp / "dist").glob("hintfs_client-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A clean venv with the wheel installed from a wheelhouse, offline; its python."""
    tmp = tmp_path_factory.mktemp("venv")
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")],
                       capture_output=True, text=True, timeout=120, env=_clean_env())
    assert r.returncode == 0, r.stderr
    python = tmp / "venv" / "bin" / "python"
    cfg = (tmp / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    house = tmp / "wheelhouse"
    # (this pip works for the venv's interpreter: the venv needs no pip of its own)
    _pip("--python", str(python), "download", "-q", "-d", str(house), str(wheel))
    _pip("--python", str(python), "install", "-q", "--no-index", "--find-links", str(house), "hintfs-client")
    return python


def run_in(python: Path, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # -I: no cwd, no PYTHONPATH, no user site: only what the venv has installed
    return subprocess.run([str(python), "-I", "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=_clean_env(), cwd="/")


def test_the_wheel_holds_the_job_api_and_what_it_imports(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    ours = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names if n.endswith(".py")}
    assert ours == closure(), (sorted(ours - closure()), sorted(closure() - ours))
    # two top-level names in a job's environment (docs/architecture.md, "Installed names")
    assert {n.split("/")[0] for n in names if ".dist-info" not in n} == {"hintfs", "policy"}
    assert not [m for m in ours if any(m == r or m.startswith(r + ".") for r in DAEMON_ROOMS)]
    # Every third-party import (at any place in a module) is a declared dependency or extra.
    meta = tomllib.loads(CLIENT.read_text())["project"]
    declared = {_name(r) for r in meta["dependencies"]} | {_name(r) for rs in meta["optional-dependencies"].values()
                                                          for r in rs}
    z = zipfile.ZipFile(wheel)
    third = set()
    for n in names:
        if not n.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(z.read(n))):
            if isinstance(node, ast.Import):
                third |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                third.add(node.module.split(".")[0])
    third -= set(sys.stdlib_module_names) | {"hintfs", "policy"}
    assert third <= set(DISTS), sorted(third - set(DISTS))
    assert {DISTS[t] for t in third} <= declared
    assert "pyfuse3" not in declared and "trio" not in declared


def test_an_sdist_is_refused_in_one_line_and_copies_nothing(wheel, tmp_path):
    """The sources are `..`: setuptools' sdist would copy them into client/ and pack a tree that
    does not build, so the backend refuses it."""
    src = wheel.parents[1] / "src" / "client"
    before = sorted(p.name for p in src.iterdir())
    r = subprocess.run([sys.executable, "-c", "import sys, wheel_only_backend as b; b.build_sdist(sys.argv[1])",
                        str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=src, env=_clean_env())
    assert r.returncode != 0
    assert "hintfs-client has no sdist" in r.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in src.iterdir()) == before and not list(tmp_path.iterdir())


def test_the_client_pyproject_agrees_with_the_root_one():
    """One version and one set of pins: the client's are the root pyproject's."""
    root = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = tomllib.loads(CLIENT.read_text())["project"]
    assert client["name"] == "hintfs-client" and client["version"] == root["version"]
    assert client["requires-python"] == root["requires-python"]
    pins = {_name(r): r for r in root["dependencies"] + root["optional-dependencies"]["test"]}
    for req in client["dependencies"] + client["optional-dependencies"]["torch"]:
        assert pins.get(_name(req)) == req, f"{req} != the root pyproject's {pins.get(_name(req))}"


def test_the_clean_venv_has_no_fuse_trio_or_torch(venv):
    code = r"""
import importlib.util, json, sys
import hintfs, hintfs.client, hintfs.plan, hintfs.hintsource, hintfs.transforms.container
out = {"file": hintfs.__file__, "prefix": sys.prefix,
       "missing": [n for n in ("pyfuse3", "trio", "torch", "fusefs", "mountconfig", "hintfs.agent", "hintfs.cli")
                   if importlib.util.find_spec(n) is None],
       "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("pyfuse3", "trio", "torch"))}
try:
    import hintfs.dataset
except ImportError as err:
    out["dataset"] = str(err)
try:
    hintfs.client.hints_from_dcp("/nonexistent", 2)
except ImportError as err:
    out["dcp"] = str(err)
print(json.dumps(out))
"""
    r = run_in(venv, code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["file"].startswith(out["prefix"]) and "site-packages" in out["file"]
    assert out["missing"] == ["pyfuse3", "trio", "torch", "fusefs", "mountconfig", "hintfs.agent", "hintfs.cli"]
    assert out["loaded"] == []
    # What needs torch says so in one line, naming the extra.
    assert "hintfs-client[torch]" in out["dataset"] and "hintfs-client[torch]" in out["dcp"]


RULE = '''
[[transforms]]
glob = "imgs/*.jpg"
kind = "image"
params = { size = 64, crop = [48, 48], normalize = true }

[transform_load]
fallback = false
'''

JOB = r"""
import hashlib, json, os, sys
from hintfs import client, plan
from hintfs.transforms.container import decode, encode_raw, load_sample

mnt = sys.argv[1]
out = {}
client.set_replication_hints(mnt, "restart", {"ckpt/shard0.distcp": 4}, ttl_s=60, deadline_s=30)
out["status"] = client.wait_for_replicas(mnt, "restart", timeout_s=30)
with open(os.path.join(mnt, "ckpt/shard0.distcp"), "rb") as f:
    out["shard"] = hashlib.sha256(f.read()).hexdigest()
try:
    client.set_replication_hints(mnt, "bad", {"../outside": 4})
except ValueError as err:
    out["refused"] = str(err)
# a .tensor file the mount transformed, and the same sample in raw mode transformed here (av)
with open(os.path.join(mnt, "imgs/0.jpg.tensor"), "rb") as f:
    meta, arrays = decode(f.read())
with open(os.path.join(mnt, "imgs/0.jpg"), "rb") as f:
    raw = encode_raw(f.read(), meta.model_dump())
pixels = load_sample(os.path.join(mnt, "imgs/0.jpg.tensor"))["pixels"]
out["tensor"] = [list(pixels.shape), hashlib.sha256(pixels.tobytes()).hexdigest()]
out["raw_equal"] = bool((load_sample(raw)["pixels"] == pixels).all())
# a plan written through the mount (pyarrow) and registered with it
plan.build_plan(["imgs/0.jpg", "imgs/1.jpg"], os.path.join(mnt, "plan.parquet"), seed=1, world_size=1,
                batch_per_rank=1, steps=2)
plan.register_plan(mnt, "train", "plan.parquet", 0, lookahead=1)
with open(os.path.join(mnt, ".hintfs/plans/train")) as f:
    out["plan"] = json.loads(f.read())
print(json.dumps(out))
"""


@needs_fuse
def test_the_installed_client_drives_a_real_mount(venv, mount_factory, tmp_path):
    pytest.importorskip("av")   # (the test's side makes the jpegs)
    from hintfs import transforms
    from hintfs.transforms.params import default_seed
    from tests.helpers.media import jpeg_file

    m = mount_factory(extra=f'\n[agent]\ndata_dir = "{tmp_path / "rep"}"\n{RULE}')
    (m.store / "ckpt").mkdir()
    shard = os.urandom(1 << 20)
    (m.store / "ckpt" / "shard0.distcp").write_bytes(shard)
    (m.store / "imgs").mkdir()
    for i in range(2):
        jpeg_file(m.store / "imgs" / f"{i}.jpg", seed=i)
    (m.store / "step_1000").mkdir()   # docs/client.md's example reads these
    (m.store / "step_1000" / ".metadata").write_bytes(os.urandom(3000))
    (m.store / "step_1000" / "shard0.distcp").write_bytes(shard)

    r = run_in(venv, JOB, str(m.mnt))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["status"]["ready"] and out["status"]["files"]["ckpt/shard0.distcp"]["ready"] >= 1
    assert m.stats()["counters"].get("replicas_made", 0) >= 1
    assert out["shard"] == hashlib.sha256(shard).hexdigest()
    assert out["refused"].startswith("bad: ") and "\n" not in out["refused"]
    # The venv's load of the mount's .tensor (before the plan: the sample's default seed) is this
    # checkout's transform of the source, and raw mode transformed in the venv gives the same pixels.
    ours = transforms.apply("image", (m.store / "imgs" / "0.jpg").read_bytes(),
                            {"size": 64, "crop": [48, 48], "normalize": True}, default_seed("imgs/0.jpg"))["pixels"]
    assert out["tensor"] == [list(ours.shape), hashlib.sha256(ours.tobytes()).hexdigest()]
    assert out["raw_equal"]
    assert out["plan"]["plan"] == "plan.parquet" and out["plan"]["step"] == 0
    assert (m.store / "plan.parquet").is_file()

    # docs/client.md's example, as printed there (and in the README), on this mount.
    example = documented_example()
    assert 'mnt = "/mnt/ckpt"' in example
    code = example.replace('"/mnt/ckpt"', repr(str(m.mnt))) + "print(len(shard), list(pixels.shape))\n"
    r = run_in(venv, code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(len(shard)), "[3,", "48,", "48]"]
    assert client_status(m.mnt, "restart-42")["ready"]


def client_status(mnt: Path, job: str) -> dict:
    return json.loads((mnt / ".hintfs" / "hints" / f"{job}.status").read_text())


def documented_example() -> str:
    (example,) = re.findall(r"^```python\n(.*?)^```$", (REPO / "docs" / "client.md").read_text(), re.M | re.S)
    return example


def test_the_readme_shows_the_example_that_runs():
    """A job-API example in the README (hints and a `.tensor` load) is docs/client.md's, which the
    test above runs, word for word."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(), re.M | re.S)
    shown = [b for b in blocks if "load_sample" in b and "set_replication_hints" in b]
    assert all(b == documented_example() for b in shown), shown
