"""Settings precedence: defaults < YAML file < TRM_* environment < options."""

from __future__ import annotations

from pathlib import Path

import pytest

from repo_manager.errors import ConfigError
from repo_manager.settings import Settings, load_settings


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
