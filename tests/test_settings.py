"""Settings precedence: defaults < YAML file < TRM_* environment < options."""

from __future__ import annotations

from pathlib import Path

import pytest

from repo_manager.core.errors import ConfigError
from repo_manager.core.settings import Settings, load_settings


def test_defaults_without_a_file(tmp_path):
    settings = load_settings(env={})
    assert settings.repository == Path("model_repository") and settings.source == "defaults"


def test_file_then_environment_then_options(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "trm.yaml").write_text("repository: repo_from_file\nhttp_port: 9000\ngrpc_port: 9001\n")
    settings = load_settings(configs / "trm.yaml", env={"TRM_GRPC_PORT": "9101"})
    assert settings.repository == tmp_path / "repo_from_file"  # relative to the project folder
    assert settings.http_port == 9000 and settings.grpc_port == 9101
    assert settings.replace(http_port=7000, grpc_port=None).http_port == 7000
    assert settings.replace(grpc_port=None).grpc_port == 9101  # an option not given changes nothing


def test_trm_config_variable_names_the_file(tmp_path):
    (tmp_path / "s.yaml").write_text("store: s3://bucket/prefix\n")
    assert load_settings(env={"TRM_CONFIG": str(tmp_path / "s.yaml")}).store == "s3://bucket/prefix"


@pytest.mark.parametrize("text, message", [("http_port: lots\n", "invalid value"),
                                           ("- a\n- b\n", "mapping"), ("nope: 1\n", "unknown setting")])
def test_bad_files_are_config_errors(tmp_path, text, message):
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(tmp_path / "s.yaml", env={})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.yaml", env={})


def test_settings_are_immutable():
    with pytest.raises(AttributeError):
        Settings().http_port = 1  # type: ignore[misc]


WRONG_TYPES = ["environments: 5", "environments: [a, b]", "environments: x", "store: [1]", "store: {a: 1}",
               "gates: 5", "gates: [1]", "rollout: 5", "http_port: -5", "http_port: 70000", "http_port: true",
               "server_start_timeout_s: .nan", "server_start_timeout_s: -1", "bind_address: [1]", "tritonserver: 5",
               "source: elsewhere", "environments: {prod: {store: [1]}}", "environments: {prod: 7}",
               "repository: {a: 1}", "triton_url: 8000", "sync_part_size: lots", "sync_part_size: 1000",
               "sync_part_size: 0", "sync_part_size: true"]


@pytest.mark.parametrize("text", WRONG_TYPES)
def test_a_setting_of_the_wrong_type_is_a_one_line_config_error_in_every_command(capsys, tmp_path, text):
    """A value YAML reads as another type than the setting's (a list for a path, a bool for a port, nan for a
    timeout): refused where the settings are read, exit 3 naming the setting, for any command."""
    from helpers import run_cli

    (tmp_path / "s.yaml").write_text(text + "\n")
    for command in (["specs"], ["list", "--repo", str(tmp_path / "repo")]):
        result = run_cli(capsys, "--config", tmp_path / "s.yaml", *command)
        assert result.code == 3, (text, command, result.err)
        assert text.split(":")[0] in result.err and "internal error" not in result.err


@pytest.mark.parametrize("name, value", [("TRM_ENVIRONMENTS", "x"), ("TRM_GATES", "[1]"), ("TRM_ROLLOUT", "5"),
                                         ("TRM_HTTP_PORT", "-1"), ("TRM_SERVER_START_TIMEOUT_S", "inf"),
                                         ("TRM_SYNC_PART_SIZE", "16M"), ("TRM_SYNC_PART_SIZE", "2147483648")])
def test_a_variable_of_the_wrong_type_is_a_config_error(name, value):
    with pytest.raises(ConfigError, match=name):
        load_settings(env={name: value})


def test_a_store_with_credentials_in_an_environment_entry_is_refused_without_printing_it(capsys, tmp_path):
    from helpers import run_cli

    (tmp_path / "s.yaml").write_text("environments: {staging: {store: \"s3://u:Zq9'pw@bucket/p\"}}\n")
    result = run_cli(capsys, "--config", tmp_path / "s.yaml", "specs")
    assert result.code == 2 and "environments.staging.store" in result.err
    assert "Zq9" not in result.out + result.err and "pw@" not in result.out + result.err


def test_a_settings_file_that_is_not_utf8_is_a_config_error(tmp_path):
    (tmp_path / "s.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(tmp_path / "s.yaml", env={})


def test_an_environment_without_a_value_uses_the_default_store(tmp_path):
    (tmp_path / "s.yaml").write_text("store: /srv/store\nhttp_port: 8000.0\nenvironments:\n  staging:\n")
    settings = load_settings(tmp_path / "s.yaml", env={})
    assert settings.environments == {"staging": None} and settings.http_port == 8000


def test_a_bad_sync_part_size_is_a_one_line_config_error_of_the_sync_command(tmp_path):
    """``TRM_SYNC_PART_SIZE`` is a setting like any other: a wrong value is exit 3 naming it when `trm sync`
    starts (it was read when the module was imported: exit 1 and a traceback), and a good one is used."""
    from store_helpers import finish, trm_process

    code, _, err = finish(trm_process("sync", str(tmp_path / "store"), "--repo", str(tmp_path / "repo"),
                                      env={"TRM_SYNC_PART_SIZE": "sixteen"}))
    assert code == 3 and "TRM_SYNC_PART_SIZE" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 2
    assert load_settings(env={"TRM_SYNC_PART_SIZE": str(4 * 1024 * 1024)}).sync_part_size == 4 * 1024 * 1024
