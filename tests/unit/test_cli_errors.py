"""The `hintfs` console script: every mistake is one line on stderr and a non-zero exit, never a
traceback (unless --debug); --version; each verb's --help has a description and examples.

These run the installed console script (`.venv/bin/hintfs`) as a user would, in subprocesses;
nothing here needs a mount (tests/mount/test_cli_errors_mount.py has the cases that do)."""
from __future__ import annotations

import argparse
import os
import socket
from importlib.metadata import version

import pytest

from hintfs.cli import build_parser
from hintfs.cli.errors import one_line
from tests.helpers.cli import hintfs, one_clean_line
from tests.helpers.ports import free_port as closed_port   # a loopback port nobody listens on



# --- hints -------------------------------------------------------------------------------------

def test_hints_set_missing_file(tmp_path):
    line = one_clean_line(hintfs("hints", "set", tmp_path, "job", "--file", tmp_path / "nope.json"))
    assert line.startswith("hintfs hints: --file ") and "No such file" in line


def test_hints_set_bad_json_file(tmp_path):
    (tmp_path / "bad.json").write_text("{'not': json")
    line = one_clean_line(hintfs("hints", "set", tmp_path, "job", "--file", tmp_path / "bad.json"))
    assert "invalid JSON" in line and "line 1" in line


def test_hints_set_file_not_an_object(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    line = one_clean_line(hintfs("hints", "set", tmp_path, "job", "--file", tmp_path / "list.json"))
    assert "expected a JSON object" in line


@pytest.mark.parametrize("action", ["set", "wait", "status"])
def test_hints_on_a_plain_directory(tmp_path, action):
    (tmp_path / "f.json").write_text('{"a": 2}')
    extra = ["--file", tmp_path / "f.json"] if action == "set" else []
    line = one_clean_line(hintfs("hints", action, tmp_path, "job", *extra))
    assert "is not a hintfs mount" in line and "hintfs mount" in line


def test_hints_on_a_missing_directory(tmp_path):
    line = one_clean_line(hintfs("hints", "status", tmp_path / "absent", "job"))
    assert "no such directory" in line


# --- calibrate ---------------------------------------------------------------------------------

def test_calibrate_unreachable_agent():
    line = one_clean_line(hintfs("calibrate", "--agent", f"grpc://127.0.0.1:{closed_port()}", "--path", "x"))
    assert "cannot reach the agent" in line and "hintfs agent" in line


def test_calibrate_unreachable_agent_with_size():
    # --size skips the first read of the whole file: the agent is still probed, not measured as 0 reads/s.
    r = hintfs("calibrate", "--agent", f"grpc://127.0.0.1:{closed_port()}", "--path", "x", "--size", "10",
               "--seconds", "0.1", "--max-readers", "2")
    assert "cannot reach the agent" in one_clean_line(r)
    assert "safe_readers_per_replica" not in r.stdout


def test_calibrate_location_without_scheme():
    line = one_clean_line(hintfs("calibrate", "--agent", "127.0.0.1:8815", "--path", "x"))
    assert "grpc://127.0.0.1:8815" in line


def test_calibrate_missing_token_file(tmp_path):
    line = one_clean_line(hintfs("calibrate", "--agent", f"grpc://127.0.0.1:{closed_port()}", "--path", "x",
                                 "--token-file", tmp_path / "token"))
    assert "token file" in line and "No such file" in line


def test_calibrate_without_options():
    assert "--agent" in one_clean_line(hintfs("calibrate"))


# --- agent -------------------------------------------------------------------------------------

def test_agent_port_in_use(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "agent.toml"
        cfg.write_text(f'[store]\nuri = "file://{store}"\n\n[agent]\nlocation = "grpc://127.0.0.1:{port}"\n'
                       f'auth = "none"\ndata_dir = "{tmp_path}/replicas"\n\n[logging]\nfile = "{tmp_path}/log"\n')
        line = one_clean_line(hintfs("agent", cfg))
    assert f"port {port} is in use" in line and "choose another port" in line


def test_agent_missing_config(tmp_path):
    line = one_clean_line(hintfs("agent", tmp_path / "none.toml"))
    assert "none.toml" in line


# --- the handler itself --------------------------------------------------------------------------

def test_usage_error_is_one_line():
    line = one_clean_line(hintfs("hints", "set"))
    assert line.startswith("hintfs hints set: ") and "--help" in line
    assert hintfs("hints", "set").returncode == 2


def test_unknown_verb_is_one_line():
    assert "invalid choice" in one_clean_line(hintfs("frobnicate"))


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["hints", "status", tmp_path, "job"]
    r = hintfs(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert r.returncode != 0 and "Traceback" in r.stderr and "UserError" in r.stderr


def test_debug_from_the_environment(tmp_path):
    r = hintfs("hints", "status", tmp_path, "job", env={**os.environ, "HINTFS_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_unexpected_exceptions_are_one_line_pointing_at_debug():
    line = one_line(ZeroDivisionError("division by zero"))
    assert "\n" not in line and "ZeroDivisionError" in line and "--debug" in line
    assert "\n" not in one_line(OSError(5, "Input/output error\nsecond line"))


# --- version and help ----------------------------------------------------------------------------

def test_version_is_the_package_metadata():
    r = hintfs("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hintfs {version('hintfs')}"


def _verbs(parser, prefix=()):
    """(name path, parser) of every verb and sub-verb (`plan build`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _verbs(sub, (*prefix, name))


VERBS = dict(_verbs(build_parser()))


def test_every_verb_is_listed():
    assert {"mount", "umount", "status", "agent", "hints", "calibrate", "plan", "governor"} <= {v[0] for v in VERBS}
    assert ("plan", "build") in VERBS


@pytest.mark.parametrize("verb", list(VERBS), ids=" ".join)
def test_help_has_a_description_and_an_example(verb):
    text = VERBS[verb].format_help()
    assert "\nexamples:\n  hintfs " + " ".join(verb) in text, text
    # the description is a paragraph of its own, between the usage and the arguments
    description = text.split("\n\n")[1].strip()
    assert description and not description.startswith(("positional", "options")), text


def test_help_of_the_console_script():
    r = hintfs("hints", "--help")
    assert r.returncode == 0 and "examples:\n  hintfs hints set " in r.stdout and "--debug" in r.stdout
