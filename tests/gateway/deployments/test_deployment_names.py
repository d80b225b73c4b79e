"""Every name the configuration accepts launches, is named by every command and the console's
API, and keeps its files inside the state directory (issue 34, item 2). Before: a model ID with
a ``/`` (``Qwen/Qwen3-4B``, the usual kind) answered 500 ``activation_failed`` on every request
(its engine log's path had the ``/``), the CLI's ``status``, ``start``, ``stop`` and ``park``
answered 404 (the name went into the URL unescaped), and a name with ``..`` wrote its engine log
outside ``logs/``. The engines are real processes: the log files are the local runner's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import pytest
import yaml
from typer.testing import CliRunner

from capyctl_gateway import ConfigError, load_config
from capyctl_gateway.cli import app as cli
from tests.gateway.conftest import Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched, management

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("name", ["Qwen/Qwen3-4B", "../escape", "a b/é ?#%"])
async def test_a_name_with_any_characters_launches_and_keeps_its_log_inside(
    make_gateway: MakeGateway, tmp_path: Path, name: str
) -> None:
    logs = tmp_path / "state" / "logs"
    gw = await make_gateway({"deployments": [launched(name)]}, engine_logs=logs)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat(name))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == name
    written = files_under(tmp_path)
    assert written and all(p.parent == logs for p in written), written


async def test_every_command_names_a_model_id_with_a_slash(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    name = "Qwen/Qwen3-4B"
    gw = await make_gateway({"deployments": [launched(name)]})
    runner, base = await management(gw)
    state = tmp_path / "state"
    (state / "identity").mkdir(parents=True)
    (state / "identity" / "credentials").write_text(f"api_key: {gw.key}\n")
    (state / "identity" / "credentials").chmod(0o600)
    where = ["--state-dir", str(state), "--management", base.split("/")[2]]

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, [*args, *where])
        assert result.exit_code == 0, result.output
        return result.output

    try:
        said = {}
        for command in (["start", name], ["status", "deployment", name], ["park", name]):
            said[command[0]] = await anyio.to_thread.run_sync(partial(run, *command))
        said["stop"] = await anyio.to_thread.run_sync(partial(run, "stop", name))
    finally:
        await runner.cleanup()
    assert said["start"].startswith(f"{name}: ready")
    assert f"{name} (" in said["status"] and "ready" in said["status"]
    assert said["park"].startswith(f"{name}: ")
    assert said["stop"].startswith(f"{name}: stopped")
    assert gw.gateway.fleet.lifecycle.lives[name].state == "stopped"


@pytest.mark.parametrize("name", [".", "..", "a\nb", "tab\there"])
def test_a_name_no_url_can_carry_is_refused_at_load(tmp_path: Path, name: str) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({"deployments": [launched(name)]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "name" in str(info.value)
