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
    ({"stream": {"sender_cpus": []}}, "stream.sender_cpus", "is empty"),
    ({"stream": {"sender_cpus": [0, 0]}}, "stream.sender_cpus", "names a CPU twice"),
    ({"stream": {"sender_cpus": [-1]}}, "stream.sender_cpus", "no CPU -1"),
    ({"stream": {"sender_cpus": [4096]}}, "stream.sender_cpus", "no CPU 4096 on this host"),
    ({"stream": {"sender_cpus": ["one"]}}, "stream.sender_cpus", "integer"),
    ({"stream": {"sender_cpus": [0], "sender": "threads"}}, "stream", 'sender_cpus needs sender = "process"'),
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


def test_request_checksum_defaults_to_when_required_for_endpoint_override_stores(monkeypatch):
    """`[store] request_checksum`: explicit wins; unset, S3-compatible servers (endpoint_override)
    get "when_required" unless the environment already says; AWS itself keeps the SDK default."""
    from mountconfig.schema import StoreConfig
    from hintfs.stores.arrow import CHECKSUM_ENV, request_checksum_of
    monkeypatch.delenv(CHECKSUM_ENV, raising=False)
    assert StoreConfig().request_checksum is None
    other = StoreConfig(uri="s3://b", endpoint_override="127.0.0.1:9")
    aws = StoreConfig(uri="s3://b")
    assert request_checksum_of(other) == "when_required"
    assert request_checksum_of(aws) is None
    assert request_checksum_of(StoreConfig(uri="s3://b", request_checksum="when_supported")) == "when_supported"
    assert request_checksum_of(StoreConfig(uri="s3://b", endpoint_override="h:1",
                                           request_checksum="when_supported")) == "when_supported"
    monkeypatch.setenv(CHECKSUM_ENV, "when_supported")   # the operator's environment is kept
    assert request_checksum_of(other) is None
    with pytest.raises(ConfigError, match="store.request_checksum"):
        parse_config({"store": {"uri": "s3://b", "request_checksum": "always"}})


def test_request_checksum_is_set_for_the_s3_client_only_while_it_is_built(monkeypatch):
    from mountconfig.schema import StoreConfig
    from hintfs.stores.arrow import CHECKSUM_ENV, filesystem_from_config
    import os
    monkeypatch.delenv(CHECKSUM_ENV, raising=False)
    fs, root = filesystem_from_config(StoreConfig(uri="s3://bucket/pre", endpoint_override="127.0.0.1:9",
                                                  scheme="http", access_key="a", secret_key="b",
                                                  region="us-east-1"))
    assert root == "bucket/pre" and CHECKSUM_ENV not in os.environ
    monkeypatch.setenv(CHECKSUM_ENV, "when_supported")
    filesystem_from_config(StoreConfig(uri="s3://bucket", endpoint_override="127.0.0.1:9", scheme="http",
                                       request_checksum="when_required", region="us-east-1"))
    assert os.environ[CHECKSUM_ENV] == "when_supported"
