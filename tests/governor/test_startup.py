"""The governor run by hand (issue 38, item 5): it makes its socket folder (or says which option to
set), logs its start and stop with the socket and the GPUs, and takes a GPU's size from the card
when `total_bytes` is left out (NVML; without a GPU, one line saying to set it). No GPU needed:
the NVML probe runs against a stand-in library (fake_nvml.c, built here with the C compiler)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import wait_until
from hintfs.governor import cardmemory
from hintfs.governor.cardmemory import Card, CardMemoryError, read_cards, with_card_memory
from hintfs.governor.daemon import DaemonStartError, GovernorDaemon
from mountconfig.governor import GiB, GovernorConfig, GpuConfig, load_governor_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in NVML library")
    out = tmp_path_factory.mktemp("nvml") / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(HERE / "fake_nvml.c")], check=True,
                   capture_output=True, timeout=60)
    return str(out)


def config(tmp_path, sock: Path | None = None, **gpu) -> GovernorConfig:
    return GovernorConfig(socket_path=str(sock or tmp_path / "gov.sock"),
                          shm_name=f"hintfs-test-{uuid.uuid4().hex[:8]}", gpus=[GpuConfig(**gpu)])


def card_of(total: int, name: str = "Test GPU"):
    def probe(indexes):
        return {i: Card(i, name, total) for i in indexes}
    return probe


def no_driver(indexes):
    raise CardMemoryError(f"no NVIDIA driver here ({cardmemory.NVML_LIBRARY} not found)")


# --- the card's memory ---------------------------------------------------------------------------

def test_total_bytes_is_optional_and_read_from_the_card(tmp_path, caplog):
    cfg = config(tmp_path)
    assert cfg.gpus[0].total_bytes is None                  # the default: read at start, not 80 GiB
    d = GovernorDaemon(cfg, probe=card_of(141 * GiB, "NVIDIA H200"))
    d.open()
    try:
        assert d.gpus[0].ledger.total_bytes == 141 * GiB
        assert d.cfg.gpus[0].total_bytes == 141 * GiB
        assert "141.0 GiB (NVIDIA H200, read from the card)" in d.gpus_text()
    finally:
        d.close()


def test_a_total_in_the_config_is_not_probed(tmp_path):
    def probe(indexes):
        raise AssertionError("probed a GPU whose total_bytes is set")
    d = GovernorDaemon(config(tmp_path, total_bytes=16 * GiB, reserve_bytes=GiB), probe=probe)
    d.open()
    try:
        assert d.gpus[0].ledger.total_bytes == 16 * GiB
        assert "16.0 GiB (total_bytes of the config)" in d.gpus_text()
    finally:
        d.close()


def test_without_a_gpu_the_cli_says_total_bytes_is_needed(tmp_path, capsys, monkeypatch, keep_logging):
    from hintfs.governor.cli import main as cli_main
    monkeypatch.setattr(cardmemory, "read_cards", no_driver)
    sock = tmp_path / "run" / "gov.sock"
    p = tmp_path / "c.toml"
    p.write_text(f'[governor]\nsocket_path = "{sock}"\n')
    assert cli_main(str(p)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "no NVIDIA driver" in err and "set total_bytes of GPU 0" in err
    assert not sock.parent.exists()                         # nothing made before the refusal


def test_a_reserve_above_the_card_is_one_line(tmp_path):
    d = GovernorDaemon(config(tmp_path, reserve_bytes=8 * GiB), probe=card_of(4 * GiB))
    with pytest.raises(DaemonStartError, match="reserve_bytes .* is not below the card's"):
        d.open()


def test_the_config_rejects_a_reserve_above_a_given_total_only():
    GpuConfig(reserve_bytes=500 * GiB)                       # checked against the card at start
    with pytest.raises(ValueError, match="reserve_bytes"):
        GpuConfig(total_bytes=GiB, reserve_bytes=2 * GiB)


def test_nvml_probe_reads_each_card(fake_nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cards = read_cards([0, 1], library=fake_nvml)
    assert cards == {0: Card(0, "Fake H100", 80 * GiB), 1: Card(1, "Fake A100", 40 * GiB)}
    with pytest.raises(CardMemoryError, match="GPU 2 is in MIG mode"):
        read_cards([2], library=fake_nvml)
    with pytest.raises(CardMemoryError, match="GPU 7: NVML says Invalid Argument"):
        read_cards([7], library=fake_nvml)


def test_nvml_probe_follows_cuda_visible_devices(fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert read_cards([0], library=fake_nvml)[0].total_bytes == 40 * GiB      # CUDA's 0 is card 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1")
    assert read_cards([0], library=fake_nvml)[0].name == "Fake A100"
    with pytest.raises(CardMemoryError, match="shows 1 GPU"):
        read_cards([1], library=fake_nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    with pytest.raises(CardMemoryError, match="not an index or a GPU- UUID"):
        read_cards([0], library=fake_nvml)


def test_nvml_probe_without_the_library(tmp_path):
    with pytest.raises(CardMemoryError, match="no NVIDIA driver here"):
        read_cards([0], library=str(tmp_path / "libnvidia-ml.so.1"))
    cfg = config(tmp_path)
    with pytest.raises(CardMemoryError) as info:
        with_card_memory(cfg, lambda idx: read_cards(idx, library=str(tmp_path / "none.so")))
    msg = str(info.value)
    assert "\n" not in msg and "set total_bytes of GPU 0 in [[governor.gpus]]" in msg


def test_the_daemon_uses_the_nvml_probe_by_default(tmp_path, fake_nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(cardmemory, "NVML_LIBRARY", fake_nvml)
    d = GovernorDaemon(config(tmp_path, index=1))
    d.open()
    try:
        assert d.gpus[1].ledger.total_bytes == 40 * GiB and d.cards[1].name == "Fake A100"
    finally:
        d.close()


# --- the socket folder ---------------------------------------------------------------------------

def test_a_missing_socket_folder_is_made_by_the_daemon(tmp_path):
    sock = tmp_path / "run" / "hintfs" / "gov.sock"
    (tmp_path / "run").mkdir()
    old = os.umask(0o077)          # the folder's mode does not follow the caller's umask
    try:
        d = GovernorDaemon(config(tmp_path, sock, total_bytes=16 * GiB))
        d.open()
    finally:
        os.umask(old)
    try:
        st = os.stat(sock.parent)
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == os.geteuid()
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
    finally:
        d.close()


@pytest.mark.parametrize("case", ["no parent", "a file"])
def test_a_socket_folder_that_cannot_be_made_is_one_line(tmp_path, case):
    if case == "no parent":
        sock = tmp_path / "missing" / "hintfs" / "gov.sock"
        needle = "does not exist, nor its parent"
    else:
        (tmp_path / "afile").write_text("")
        sock = tmp_path / "afile" / "gov.sock"
        needle = "exists and is not a directory"
    d = GovernorDaemon(config(tmp_path, sock, total_bytes=16 * GiB))
    with pytest.raises(DaemonStartError) as info:
        d.open()
    msg = str(info.value)
    assert needle in msg and "governor.socket_path" in msg and "\n" not in msg
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_socket_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, 65534, 65534)
    d = GovernorDaemon(config(tmp_path, folder / "gov.sock", total_bytes=16 * GiB))
    with pytest.raises(DaemonStartError, match="belongs to uid 65534.*governor.socket_path"):
        d.open()
    assert os.listdir(folder) == []


def test_a_socket_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)                # not sticky: anyone could replace the socket or the locks
    d = GovernorDaemon(config(tmp_path, folder / "gov.sock", total_bytes=16 * GiB))
    with pytest.raises(DaemonStartError, match="writable by other users.*governor.socket_path"):
        d.open()
    assert os.listdir(folder) == []


# --- by hand, as docs/governor.md shows ----------------------------------------------------------

def test_by_hand_it_makes_its_folder_and_logs_start_and_stop(tmp_path):
    sock = tmp_path / "run" / "gov.sock"
    cfg = tmp_path / "hintfs.toml"
    cfg.write_text(f'[governor]\nsocket_path = "{sock}"\nshm_name = "hintfs-test-{uuid.uuid4().hex[:8]}"\n'
                   '[[governor.gpus]]\ntotal_bytes = 17179869184\n')
    assert load_governor_config(cfg).gpus[0].total_bytes == 16 * GiB
    # `hintfs governor CONFIG`: the verb sets up warning-only logging before the daemon's own
    p = subprocess.Popen([sys.executable, "-m", "hintfs.cli", "governor", str(cfg)], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    def serving() -> bool:          # (then its SIGTERM handler is in place too)
        assert p.poll() is None, p.stderr.read()
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(sock))
                s.sendall(b'{"op":"ping"}\n')
                return b'"ok"' in s.recv(4096)
        except OSError:
            return False
    try:
        assert wait_until(serving, 60, 0.05), "the governor did not come up"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
    assert p.returncode == 0, err
    lines = err.splitlines()
    start = [ln for ln in lines if " started: listening on " in ln]
    assert len(start) == 1, err
    assert f"listening on {sock} (mode 0600)" in start[0]
    assert "GPU 0: 16.0 GiB (total_bytes of the config), 2.0 GiB reserved" in start[0]
    assert any(f"created the socket folder {sock.parent}" in ln for ln in lines), err
    assert any(f"stopped: socket {sock} removed" in ln for ln in lines), err
    assert "SIGTERM: shutting down" in err
    assert not sock.exists()
