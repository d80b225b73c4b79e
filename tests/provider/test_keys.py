from __future__ import annotations

from pathlib import Path

import pytest

from canopyx_provider import ConfigError, engine_api_key


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CANOPYX_ENGINE_API_KEY", raising=False)
    monkeypatch.delenv("CANOPYX_ENGINE_API_KEY_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_environment_variable_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CANOPYX_ENGINE_API_KEY", " sk-env \n")
    assert engine_api_key(file=tmp_path / "absent") == "sk-env"


def test_owner_only_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-file\nignored\n")
    key.chmod(0o600)
    assert engine_api_key(file=key) == "sk-file"


def test_file_named_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-named")
    key.chmod(0o400)
    monkeypatch.setenv("CANOPYX_ENGINE_API_KEY_FILE", str(key))
    assert engine_api_key() == "sk-named"


def test_default_file_under_home(tmp_path: Path) -> None:
    key = tmp_path / "home" / ".config" / "canopyx" / "engine-api-key"
    key.parent.mkdir(parents=True)
    key.write_text("sk-home")
    key.chmod(0o600)
    assert engine_api_key() == "sk-home"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_others_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "key"
    key.write_text("sk-file")
    key.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        engine_api_key(file=key)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("\n")
    key.chmod(0o600)
    with pytest.raises(ConfigError, match="empty"):
        engine_api_key(file=key)


def test_nothing_configured_means_no_key(tmp_path: Path) -> None:
    assert engine_api_key(file=tmp_path / "absent") is None
    assert engine_api_key() is None
