import pytest
from pydantic import ValidationError

from hintfs.governor.cli import main as cli_main
from mountconfig.governor import GovernorConfig, GovernorConfigError, load_governor_config


def test_every_field_has_default_and_description():
    cfg = GovernorConfig()
    for name, f in GovernorConfig.model_fields.items():
        assert f.description, name
    assert cfg.deadline_miss_action == "reject"
    assert cfg.page_bytes == 32 << 20


def test_extra_keys_are_forbidden():
    with pytest.raises(ValidationError):
        GovernorConfig(socket_pth="/x")


def test_loader_reads_only_governor_table(tmp_path):
    p = tmp_path / "hintfs.toml"
    p.write_text('[store]\nuri = "file:///data"\n[[routes]]\nprefix = "a"\n'
                 '[governor]\nreclaim_deadline_ms = 7.5\ndeadline_miss_action = "stop_training"\n'
                 '[[governor.gpus]]\nindex = 1\ntotal_bytes = 1000\nreserve_bytes = 10\n')
    cfg = load_governor_config(p)
    assert cfg.reclaim_deadline_ms == 7.5
    assert cfg.deadline_miss_action == "stop_training"
    assert cfg.gpus[0].index == 1 and cfg.gpu(1).total_bytes == 1000


def test_missing_table_gives_defaults(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[store]\nuri = "x"\n')
    assert load_governor_config(p) == GovernorConfig()


@pytest.mark.parametrize("body, needle", [
    ('[governor]\ndeadline_miss_action = "panic"\n', "governor.deadline_miss_action"),
    ('[governor]\nreclaim_deadline_ms = -1\n', "governor.reclaim_deadline_ms"),
    ('[governor]\nbogus = 1\n', "governor.bogus"),
    ('[[governor.gpus]]\ntotal_bytes = 10\nreserve_bytes = 20\n', "reserve_bytes"),
    ('[governor\n', "invalid TOML"),
])
def test_errors_are_one_line_naming_the_key(tmp_path, body, needle):
    p = tmp_path / "c.toml"
    p.write_text(body)
    with pytest.raises(GovernorConfigError) as ei:
        load_governor_config(p)
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg


def test_cli_bad_config_is_one_stderr_line(tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text('[governor]\nmax_clients = 0\n')
    assert cli_main(str(p)) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "governor.max_clients" in err and "Traceback" not in err
    assert cli_main(str(tmp_path / "missing.toml")) != 0
    assert "cannot read config" in capsys.readouterr().err


def test_cli_socket_in_use(tmp_path, capsys, make_daemon, keep_logging):
    d = make_daemon()
    p = tmp_path / "c.toml"
    p.write_text(f'[governor]\nsocket_path = "{d.cfg.socket_path}"\nshm_name = "other-x"\n'
                 '[[governor.gpus]]\ntotal_bytes = 17179869184\n')
    assert cli_main(str(p)) == 1
    err = capsys.readouterr().err
    assert "in use" in err and err.count("\n") == 1


def test_an_unknown_key_names_the_nearest_one(tmp_path):
    p = tmp_path / "g.toml"
    p.write_text("[governor]\nsocket_pth = '/run/x.sock'\n")
    with pytest.raises(GovernorConfigError) as exc:
        load_governor_config(str(p))
    assert "governor.socket_pth: unknown key (did you mean socket_path?)" in str(exc.value)
