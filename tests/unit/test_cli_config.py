"""Config and store errors that say what to do: did-you-mean for unknown keys, a config that names
no store refused (never a silent mount of the schema's file:///srv/data), a missing store folder
called missing, and one `hintfs VERB:` prefix per line. Nothing here mounts."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from hintfs.common.errors import HintfsError, validation_message
from hintfs.stores import check_store
from hintfs.stores.local import LocalStore
from mountconfig import ConfigError, load_config, parse_config
from mountconfig.schema import StoreConfig
from tests.helpers.cli import hintfs, one_clean_line


def _refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.toml")
    return str(info.value)


# --- did you mean ------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "expected"), [
    ({"store": {"urii": "file:///x"}}, "store.urii: unknown key (did you mean uri?)"),
    ({"stroe": {"uri": "file:///x"}}, "stroe: unknown key (did you mean store?)"),
    ({"agent": {"locaton": "grpc://h:1"}}, "agent.locaton: unknown key (did you mean location?)"),
    ({"mount": {"nonemtpy": True}}, "mount.nonemtpy: unknown key (did you mean nonempty?)"),
    ({"routes": [{"prefix": "a", "local_agent": "grpc://h:1"}, {"prefx": "b", "local_agent": "grpc://h:1"}]},
     "routes.1.prefx: unknown key (did you mean prefix?)"),
    ({"governor": {"socket_pth": "/run/g.sock"}}, "governor.socket_pth: unknown key (did you mean socket_path?)"),
    ({"governor": {"gpus": [{"indx": 0}]}}, "governor.gpus.0.indx: unknown key (did you mean index?)"),
])
def test_unknown_keys_name_the_nearest_known_one(data, expected):
    assert expected in _refusal(data)


def test_a_key_like_no_known_one_gets_no_guess():
    msg = _refusal({"store": {"zzzzzz": 1}})
    assert "store.zzzzzz: unknown key" in msg and "did you mean" not in msg


def test_without_a_model_there_is_no_guess():
    # the formatter of agent requests and control documents: they pass no model, and say no more
    class Doc(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: str = ""

    with pytest.raises(ValidationError) as info:
        Doc.model_validate({"paht": "x"})
    assert validation_message(info.value) == "paht: unknown key"
    assert validation_message(info.value, model=Doc) == "paht: unknown key (did you mean path?)"


def test_the_console_script_says_did_you_mean(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[store]\nuri = "file:///x"\n\n[agent]\nlocaton = "grpc://127.0.0.1:1"\n')
    line = one_clean_line(hintfs("agent", cfg))
    assert line == f"hintfs agent: {cfg}: agent.locaton: unknown key (did you mean location?)"


# --- a config that names no store ----------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "# nothing yet\n", '[logging]\nlevel = "DEBUG"\n', "[store]\n",
                                  '[store]\nstartup_check = false\n'])
def test_a_config_without_store_uri_is_refused(tmp_path, text):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    msg = str(info.value)
    assert msg.startswith(f"{cfg}: store.uri is not set") and "[store]" in msg and "uri = " in msg


def test_a_config_with_store_uri_loads(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[store]\nuri = "file:///srv/data"\n')     # the default's value, written out: fine
    assert load_config(cfg).store.uri == "file:///srv/data"


@pytest.mark.parametrize("verb", ["mount", "agent"])
def test_the_console_script_refuses_an_empty_config(tmp_path, verb):
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    (tmp_path / "mnt").mkdir()
    line = one_clean_line(hintfs(verb, cfg, *([tmp_path / "mnt"] if verb == "mount" else [])))
    assert line.startswith(f"hintfs {verb}: {cfg}: store.uri is not set"), line


def test_a_typo_in_store_is_reported_before_the_missing_uri(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[store]\nurl = "file:///x"\n')
    with pytest.raises(ConfigError, match=r"store\.url: unknown key \(did you mean uri\?\)"):
        load_config(cfg)


# --- store errors ------------------------------------------------------------------------------

def _store_error(root: str) -> str:
    with pytest.raises(HintfsError) as info:
        check_store(LocalStore(root), StoreConfig(uri=f"file://{root}"))
    return info.value.strerror


def test_a_missing_store_folder_is_called_missing(tmp_path):
    root = tmp_path / "absent"
    msg = _store_error(str(root))
    assert msg.startswith(f"store file://{root}: ") and "does not exist" in msg and "not a directory" not in msg
    assert "[store] uri" in msg


def test_a_file_as_store_root_is_not_a_folder(tmp_path):
    root = tmp_path / "file"
    root.write_text("x")
    msg = _store_error(str(root))
    assert "is not a folder" in msg and "does not exist" not in msg


def test_agent_store_error_has_one_prefix(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[store]\nuri = "file://{tmp_path}/absent"\n\n[agent]\nauth = "none"\n'
                   f'data_dir = "{tmp_path}/replicas"\nlocation = "grpc://127.0.0.1:1"\n\n'
                   f'[logging]\nfile = "{tmp_path}/log"\n')
    line = one_clean_line(hintfs("agent", cfg))
    assert line == (f"hintfs agent: store file://{tmp_path}/absent: the folder {tmp_path}/absent does not "
                    "exist (create it, or fix [store] uri)"), line
