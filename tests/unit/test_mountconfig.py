"""The mount config: typed, validated by pydantic, errors naming the key, docs generated."""

import pytest

from mountconfig import ConfigError, MountConfig, load_config, parse_config
from mountconfig.docs import render_config_doc
from tests.conftest import REPO, run_hintfs


def test_minimal_config_works_as_is(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[store]\nuri = "file:///srv/data"\n')
    cfg = load_config(p)
    assert cfg.store.uri == "file:///srv/data"
    assert cfg.mount.io_threads == MountConfig().mount.io_threads
    assert cfg.metrics.enabled is False


def test_empty_config_is_all_defaults():
    assert parse_config({}) == MountConfig()


@pytest.mark.parametrize("data, key, words", [
    ({"store": {"uri": "file:///x", "urii": 1}}, "store.urii", "unknown key"),
    ({"stor": {}}, "stor", "unknown key"),
    ({"mount": {"io_threads": 0}}, "mount.io_threads", "greater than or equal to 1"),
    ({"mount": {"io_threads": "many"}}, "mount.io_threads", "integer"),
    ({"store": {"uri": "ftp://host/x"}}, "store.uri", "unsupported store scheme"),
    ({"store": {"uri": "file://relative/path"}}, "store.uri", "absolute path"),
    ({"logging": {"level": "LOUD"}}, "logging.level", "DEBUG"),
    ({"metrics": {"port": 70000}}, "metrics.port", "less than or equal"),
])
def test_errors_name_the_key_and_the_problem(data, key, words):
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "c.toml")
    msg = str(exc.value)
    assert msg.startswith("c.toml: ")
    assert key in msg and words in msg


def test_bad_toml_and_missing_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")


def test_cli_reports_bad_config_in_one_line(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[store]\nuri = "file:///x"\nbogus = 1\n')
    (tmp_path / "mnt").mkdir()
    r = run_hintfs("mount", p, tmp_path / "mnt")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert "store.bogus: unknown key" in r.stderr


def test_config_doc_is_current():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == render_config_doc(), "run `hintfs config-doc > docs/config.md`"


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from walk(ann)
            yield f"{model.__name__}.{name}", field.description
    missing = [n for n, d in walk(MountConfig) if not d]
    assert not missing, missing


def test_one_file_configures_mount_and_governor(tmp_path):
    from mountconfig.governor import load_governor_config
    p = tmp_path / "hintfs.toml"
    p.write_text('[store]\nuri = "file:///srv/data"\n\n[governor]\n')
    assert load_config(p).governor == load_governor_config(p)


def test_governor_cli_bad_config_is_one_line(tmp_path):
    p = tmp_path / "g.toml"
    p.write_text('[governor]\nnot_a_key = 1\n')
    r = run_hintfs("governor", p)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "not_a_key" in r.stderr
