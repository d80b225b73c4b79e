"""The gateway's configuration file, its API key, and ``capyctl-gateway serve`` refusing to
start on either going wrong."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from capyctl_gateway._config import ConfigError, load_config
from capyctl_gateway._identity import CredentialsError, credentials_path, load_or_create_api_key
from capyctl_gateway.cli import app

WriteConfig = Callable[[str], Path]
KEY_LINE = re.compile(r"api_key: ([A-Za-z0-9_-]{43,})")


def config(**over: Any) -> dict[str, Any]:
    """A valid configuration, with top-level keys replaced by ``over``."""
    doc: dict[str, Any] = {
        "deployments": [
            {
                "name": "my-model",
                "engine": "vllm",
                "engine_version": "0.31.0",
                "served_model": "tiny",
                "instances": [{"url": "http://127.0.0.1:8000"}],
            }
        ]
    }
    doc.update(over)
    return doc


def dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def refused(write: WriteConfig, doc: dict[str, Any] | str) -> str:
    path = write(doc if isinstance(doc, str) else dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    return message


def deployment(**over: Any) -> dict[str, Any]:
    dep: dict[str, Any] = dict(config()["deployments"][0])
    dep.update(over)
    return dep


# -- configuration ----------------------------------------------------------------------------
def test_a_minimal_configuration_takes_the_defaults(tmp_config: WriteConfig) -> None:
    doc = config()
    del doc["deployments"][0]["served_model"]
    cfg = load_config(tmp_config(dump(doc)))
    (dep,) = cfg.deployments
    assert dep.served_model is None
    assert dep.engine_model == "my-model"  # served_model defaults to the name
    assert dep.api.value == "chat"
    assert cfg.queue.request_deadline == 600.0
    assert cfg.queue.stream_idle_timeout == 120.0
    assert cfg.limits.max_body_bytes == 64 * 1024 * 1024


def test_a_full_configuration_is_read(tmp_config: WriteConfig) -> None:
    text = """
queue:
  request_deadline: 2m
  stream_idle_timeout: 500ms
  max_running_per_deployment: 4
limits:
  max_body_bytes: 4096
deployments:
  - name: my-model
    engine: sglang
    engine_version: 0.5.20
    served_model: Qwen/Qwen3-4B
    instances:
      - url: http://10.0.0.5:30000/
      - url: https://gpu-box:8443
        api_key_env: ENGINE_KEY
  - name: decider
    api: decisions
    engine: tensorfold
    engine_version: 0.6.1
    instances: [{url: "http://127.0.0.1:9000"}]
"""
    cfg = load_config(tmp_config(text))
    assert cfg.queue.request_deadline == 120.0
    assert cfg.queue.stream_idle_timeout == 0.5
    assert cfg.queue.max_running_per_deployment == 4
    assert cfg.limits.max_body_bytes == 4096
    first, second = cfg.deployments
    assert first.engine_model == "Qwen/Qwen3-4B"
    assert first.engine_version == "0.5.20"
    assert [i.url for i in first.instances] == ["http://10.0.0.5:30000", "https://gpu-box:8443"]
    assert [i.api_key_env for i in first.instances] == [None, "ENGINE_KEY"]
    assert (second.api.value, second.engine.value, second.engine_model) == (
        "decisions",
        "tensorfold",
        "decider",
    )
    assert cfg.deployment("decider") is second
    assert cfg.deployment("nope") is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("600s", 600.0),
        ("2m", 120.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("45", 45.0),
        (30, 30.0),
        (0.25, 0.25),
    ],
)
def test_durations(tmp_config: WriteConfig, value: object, seconds: float) -> None:
    cfg = load_config(tmp_config(dump(config(queue={"stream_idle_timeout": value}))))
    assert cfg.queue.stream_idle_timeout == seconds


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        pytest.param(config(bogus=1), "bogus", id="top-level"),
        pytest.param(config(queue={"max_wait": "5s"}), "queue.max_wait", id="queue"),
        pytest.param(config(limits={"max_bytes": 1}), "limits.max_bytes", id="limits"),
        pytest.param(
            config(deployments=[deployment(replicas=2)]), "deployments.0.replicas", id="deployment"
        ),
        pytest.param(
            config(deployments=[deployment(), deployment(name="b", gpu=0)]),
            "deployments.1.gpu",
            id="second-deployment",
        ),
        pytest.param(
            config(deployments=[deployment(instances=[{"url": "http://h:1", "weight": 2}])]),
            "deployments.0.instances.0.weight",
            id="instance",
        ),
    ],
)
def test_an_unknown_key_is_named(tmp_config: WriteConfig, doc: dict[str, Any], where: str) -> None:
    assert f"{where}: unknown key" in refused(tmp_config, doc)


def test_every_unknown_key_is_named_at_once(tmp_config: WriteConfig) -> None:
    doc = config(queue={"x": 1}, deployments=[deployment(y=2)])
    message = refused(tmp_config, doc)
    assert "queue.x: unknown key" in message
    assert "deployments.0.y: unknown key" in message


@pytest.mark.parametrize(
    ("doc", "where", "says"),
    [
        pytest.param(
            config(queue={"request_deadline": "10 parsecs"}),
            "queue.request_deadline",
            "10 parsecs",
            id="duration-unit",
        ),
        pytest.param(
            config(queue={"stream_idle_timeout": "soon"}),
            "queue.stream_idle_timeout",
            "soon",
            id="duration-word",
        ),
        pytest.param(
            config(queue={"request_deadline": "0s"}), "queue.request_deadline", "", id="zero"
        ),
        pytest.param(
            config(queue={"request_deadline": -5}), "queue.request_deadline", "", id="negative"
        ),
        pytest.param(
            config(queue={"request_deadline": [1]}), "queue.request_deadline", "", id="list"
        ),
        pytest.param(
            config(deployments=[deployment(api="chat2")]), "deployments.0.api", "chat", id="api"
        ),
        pytest.param(
            config(deployments=[deployment(engine="ollama")]),
            "deployments.0.engine",
            "vllm",
            id="engine",
        ),
        pytest.param(
            config(deployments=[deployment(instances=[{"url": "http://127.0.0.1:8000/v1"}])]),
            "deployments.0.instances.0.url",
            "http://127.0.0.1:8000/v1",
            id="url-with-path",
        ),
        pytest.param(
            config(deployments=[deployment(instances=[{"url": "127.0.0.1:8000"}])]),
            "deployments.0.instances.0.url",
            "127.0.0.1:8000",
            id="url-without-scheme",
        ),
        pytest.param(
            config(deployments=[deployment(instances=[{"url": "http://h:1?x=1"}])]),
            "deployments.0.instances.0.url",
            "",
            id="url-with-query",
        ),
        pytest.param(
            config(deployments=[deployment(instances=[])]),
            "deployments.0.instances",
            "",
            id="no-instances",
        ),
        pytest.param(
            config(deployments=[{k: v for k, v in deployment().items() if k != "engine"}]),
            "deployments.0.engine",
            "required key missing",
            id="engine-missing",
        ),
        pytest.param(
            config(deployments=[deployment(name="")]), "deployments.0.name", "", id="empty-name"
        ),
        pytest.param(config(deployments=[]), "deployments", "", id="no-deployments"),
        pytest.param(
            {"queue": {}}, "deployments", "required key missing", id="deployments-missing"
        ),
        pytest.param(
            config(limits={"max_body_bytes": 100}), "limits.max_body_bytes", "", id="limit-tiny"
        ),
        pytest.param(
            config(queue={"max_running_per_deployment": 0}),
            "queue.max_running_per_deployment",
            "",
            id="max-running-0",
        ),
    ],
)
def test_a_bad_value_is_named(
    tmp_config: WriteConfig, doc: dict[str, Any], where: str, says: str
) -> None:
    message = refused(tmp_config, doc)
    assert f"{where}: " in message
    assert says in message


@pytest.mark.parametrize("value", [True, ".inf", float("inf")])
def test_a_boolean_or_infinity_is_not_a_duration(tmp_config: WriteConfig, value: object) -> None:
    assert "queue.request_deadline: " in refused(
        tmp_config, config(queue={"request_deadline": value})
    )


def test_duplicate_deployment_names_are_refused(tmp_config: WriteConfig) -> None:
    doc = config(deployments=[deployment(), deployment(engine="sglang", engine_version="0.5.20")])
    assert "two deployments are named 'my-model'" in refused(tmp_config, doc)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param("deployments: [", "not valid YAML", id="not-yaml"),
        pytest.param("- a\n- b\n", "must hold a mapping", id="a-list"),
        pytest.param("", "must hold a mapping", id="empty"),
    ],
)
def test_a_file_that_is_not_a_mapping_is_refused(
    tmp_config: WriteConfig, text: str, says: str
) -> None:
    assert says in refused(tmp_config, text)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match="cannot read the configuration"):
        load_config(path)


# -- the API key ------------------------------------------------------------------------------
def test_the_first_start_writes_an_owner_only_key(tmp_path: Path) -> None:
    key = load_or_create_api_key(tmp_path / "state")
    path = tmp_path / "state" / "identity" / "credentials"
    assert credentials_path(tmp_path / "state") == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    match = KEY_LINE.fullmatch(text.rstrip("\n"))
    assert match is not None, text
    assert match.group(1) == key
    assert len(base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))) >= 32  # 256 bits


def test_the_key_is_read_back_unchanged(tmp_path: Path) -> None:
    first = load_or_create_api_key(tmp_path)
    before = credentials_path(tmp_path).read_bytes()
    assert load_or_create_api_key(tmp_path) == first
    assert load_or_create_api_key(tmp_path) == first
    assert credentials_path(tmp_path).read_bytes() == before


def test_two_state_dirs_get_different_keys(tmp_path: Path) -> None:
    keys = {load_or_create_api_key(tmp_path / name) for name in ("a", "b", "c")}
    assert len(keys) == 3


def test_a_hand_written_key_is_used(tmp_path: Path) -> None:
    path = credentials_path(tmp_path)
    path.parent.mkdir(parents=True)
    key = "H" * 40
    content = f"# written by hand\r\nother: value\r\napi_key: {key}  \r\n".encode()
    path.write_bytes(content)
    path.chmod(0o600)
    assert load_or_create_api_key(tmp_path) == key
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    ("content", "says"),
    [
        pytest.param(b"", "no 'api_key: ' line", id="empty"),
        pytest.param(b"key: " + b"k" * 43 + b"\n", "no 'api_key: ' line", id="other-name"),
        pytest.param(b"api_key:" + b"k" * 43 + b"\n", "no 'api_key: ' line", id="no-space"),
        pytest.param(b"  api_key: " + b"k" * 43 + b"\n", "no 'api_key: ' line", id="indented"),
        pytest.param(b"api_key: short\n", "too short", id="short-key"),
        pytest.param(b"api_key: \n", "too short", id="blank-key"),
        pytest.param(b"api_key: \xff\xfe" + b"k" * 43 + b"\n", "cannot read", id="not-utf8"),
    ],
)
def test_an_unusable_credentials_file_stops_the_gateway(
    tmp_path: Path, content: bytes, says: str
) -> None:
    path = credentials_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(CredentialsError) as info:
        load_or_create_api_key(tmp_path)
    assert says in str(info.value)
    assert str(path) in str(info.value)
    assert path.read_bytes() == content  # never replaced by a fallback key


def test_credentials_that_cannot_be_read_stop_the_gateway(tmp_path: Path) -> None:
    # Tests may run as root, where chmod 000 does not stop a read: a directory does.
    path = credentials_path(tmp_path)
    path.mkdir(parents=True)
    with pytest.raises(CredentialsError, match="cannot read the credentials file"):
        load_or_create_api_key(tmp_path)
    assert path.is_dir()
    assert list(path.iterdir()) == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666])
def test_a_key_file_open_to_others_stops_the_gateway(tmp_path: Path, mode: int) -> None:
    key = load_or_create_api_key(tmp_path)
    path = credentials_path(tmp_path)
    path.chmod(mode)
    with pytest.raises(CredentialsError) as info:
        load_or_create_api_key(tmp_path)
    message = str(info.value)
    assert f"chmod 600 {path}" in message and f"{mode:04o}" in message
    assert key not in message
    assert path.read_text() == f"api_key: {key}\n"  # left as it was: the owner decides
    path.chmod(0o600)
    assert load_or_create_api_key(tmp_path) == key


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_an_identity_directory_others_can_write_stops_the_gateway(
    tmp_path: Path, mode: int
) -> None:
    load_or_create_api_key(tmp_path)
    directory = credentials_path(tmp_path).parent
    directory.chmod(mode)
    with pytest.raises(CredentialsError, match=f"chmod 700 {directory}"):
        load_or_create_api_key(tmp_path)


def test_a_first_start_into_an_identity_directory_others_can_write_is_refused(
    tmp_path: Path,
) -> None:
    directory = credentials_path(tmp_path).parent
    directory.mkdir(parents=True)
    directory.chmod(0o777)
    with pytest.raises(CredentialsError, match="can be written by other users"):
        load_or_create_api_key(tmp_path)
    assert list(directory.iterdir()) == []


# -- capyctl-gateway serve ----------------------------------------------------------------------
runner = CliRunner()


@pytest.fixture
def isolated_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Undo what ``serve`` does to the process (logging, the loop policy), and hold a port so
    that a ``serve`` which wrongly got past its checks fails to bind instead of serving."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    access = logging.getLogger("aiohttp.access")
    access_level = access.level
    monkeypatch.setattr(asyncio, "set_event_loop_policy", lambda policy: None)
    monkeypatch.delenv("CAPYCTL_STATE_DIR", raising=False)
    monkeypatch.delenv("CAPYCTL_INFERENCE_ADDR", raising=False)
    monkeypatch.delenv("CAPYCTL_MANAGEMENT_ADDR", raising=False)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        yield f"127.0.0.1:{held.getsockname()[1]}"
    finally:
        held.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        access.setLevel(access_level)


def serve(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["serve", "--log-format", "text", *args])
    assert result.stdout == ""
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        pytest.param(config(queue={"bogus": 1}), "queue.bogus: unknown key", id="unknown-key"),
        pytest.param(
            config(deployments=[deployment(instances=[{"url": "http://h:1", "zz": 1}])]),
            "deployments.0.instances.0.zz: unknown key",
            id="unknown-instance-key",
        ),
        pytest.param(
            config(queue={"request_deadline": "10 parsecs"}),
            "queue.request_deadline: '10 parsecs' is not a duration",
            id="bad-duration",
        ),
        pytest.param(
            config(deployments=[deployment(), deployment()]),
            "two deployments are named 'my-model'",
            id="duplicate",
        ),
    ],
)
def test_serve_stops_on_a_bad_configuration(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str, doc: dict[str, Any], says: str
) -> None:
    path = tmp_config(dump(doc))
    code, err = serve("--config", str(path), "--state-dir", str(tmp_path), "--listen", isolated_cli)
    assert code == 2, err
    assert err.startswith("capyctl-gateway: ")
    assert says in err
    assert not credentials_path(tmp_path).exists()  # stopped before writing a key


def test_serve_stops_on_a_missing_configuration(tmp_path: Path, isolated_cli: str) -> None:
    missing = tmp_path / "absent.yaml"
    code, err = serve(
        "--config", str(missing), "--state-dir", str(tmp_path), "--listen", isolated_cli
    )
    assert code == 2, err
    assert "cannot read the configuration" in err


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000"])
def test_serve_stops_on_a_bad_listen_address(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str, listen: str
) -> None:
    path = tmp_config(dump(config()))
    credentials_path(tmp_path).mkdir(parents=True)  # a second reason to stop, should this pass
    code, err = serve("--config", str(path), "--state-dir", str(tmp_path), "--listen", listen)
    assert code == 2, err
    assert f"--listen takes HOST:PORT, got {listen!r}" in err


def test_serve_stops_on_unreadable_credentials(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str
) -> None:
    path = tmp_config(dump(config()))
    credentials_path(tmp_path).mkdir(parents=True)
    code, err = serve("--config", str(path), "--state-dir", str(tmp_path), "--listen", isolated_cli)
    assert code == 2, err
    assert "cannot read the credentials file" in err
    assert str(credentials_path(tmp_path)) in err


def test_serve_stops_on_credentials_without_a_key(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str
) -> None:
    path = tmp_config(dump(config()))
    creds = credentials_path(tmp_path)
    creds.parent.mkdir(parents=True)
    creds.write_text("token: abc\n")
    code, err = serve("--config", str(path), "--state-dir", str(tmp_path), "--listen", isolated_cli)
    assert code == 2, err
    assert "no 'api_key: ' line" in err
    assert creds.read_text() == "token: abc\n"


def test_serve_stops_when_an_engine_key_variable_is_unset(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CAPYCTL_TEST_UNSET_ENGINE_KEY", raising=False)
    doc = config(
        deployments=[
            deployment(
                instances=[{"url": "http://h:1", "api_key_env": "CAPYCTL_TEST_UNSET_ENGINE_KEY"}]
            )
        ]
    )
    path = tmp_config(dump(doc))
    code, err = serve("--config", str(path), "--state-dir", str(tmp_path), "--listen", isolated_cli)
    assert code == 2, err
    assert "CAPYCTL_TEST_UNSET_ENGINE_KEY is not set" in err


def test_serve_refuses_an_unknown_log_format(
    tmp_path: Path, tmp_config: WriteConfig, isolated_cli: str
) -> None:
    path = tmp_config(dump(config()))
    result = runner.invoke(
        app,
        ["serve", "--config", str(path), "--state-dir", str(tmp_path), "--log-format", "xml"]
        + ["--listen", isolated_cli],
    )
    assert result.exit_code == 2, result.output
    assert "--log-format takes text or json" in result.stderr


def test_two_gateways_starting_at_once_agree_on_one_key(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from capyctl_gateway._identity import load_or_create_api_key

    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: load_or_create_api_key(tmp_path), range(32)))
    assert len(keys) == 1
    assert not [p for p in (tmp_path / "identity").iterdir() if p.name != "credentials"]
