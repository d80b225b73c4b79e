"""What would load and then do nothing, or never work, is refused at load with the key named;
and ``list`` and ``status`` say the same of an engine someone else runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from capyctl_gateway import ConfigError, GatewayConfig, load_config
from capyctl_gateway._lifecycle.operator import deployments_list
from capyctl_gateway._management.status import deployment_status
from tests.gateway.conftest import Gw, deployments
from tests.gateway.lifecycle.test_lifecycle import launched, refused

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "key",
    ["activation", "park", "ready_idle_timeout", "parked_idle_timeout", "drain_timeout"],
)
def test_a_lifecycle_key_on_url_instances_only_is_refused(tmp_path: Path, key: str) -> None:
    value = {"activation": "explicit", "park": "stop", "drain_timeout": "5s"}.get(key, "10m")
    dep = deployments("http://127.0.0.1:8000", lifecycle={key: value})
    said = refused(tmp_path, {"deployments": [dep]})
    assert "deployments.0: deployment 'my-model' has only url: instances" in said
    assert f"so lifecycle.{key} would do nothing" in said


def test_memory_on_url_instances_only_is_refused(tmp_path: Path) -> None:
    dep = deployments("http://127.0.0.1:8000", memory={"ready": "2GiB"})
    said = refused(tmp_path, {"deployments": [dep]})
    assert "deployment 'my-model' has only url: instances" in said
    assert "so memory would do nothing" in said


def test_lifecycle_and_memory_stay_allowed_where_an_instance_is_launched() -> None:
    dep = launched(memory={"ready": "2GiB"}, lifecycle={"park": "stop", "drain_timeout": "5s"})
    dep["instances"].append({"url": "http://127.0.0.1:8000"})
    GatewayConfig.model_validate({"deployments": [dep]})
    GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:8000")]})


def test_a_deployment_larger_than_the_whole_budget_is_refused(tmp_path: Path) -> None:
    one = launched(memory={"ready": "16GiB"})
    said = refused(tmp_path, {"resources": {"memory_budget": "15GiB"}, "deployments": [one]})
    assert "deployment 'my-model': memory.ready 16GiB is more than the whole" in said
    assert "resources.memory_budget 15GiB" in said
    two = launched(memory={"ready": "10GiB"})
    two["instances"] *= 2
    said = refused(tmp_path, {"resources": {"memory_budget": "15GiB"}, "deployments": [two]})
    assert "memory.ready 10GiB x 2 launched instances in one memory pool = 20GiB" in said
    assert "15GiB" in said


def test_deployments_kept_ready_that_cannot_all_fit_are_refused(tmp_path: Path) -> None:
    """Two deployments kept ready under a budget for one: one of them would try to start for
    ever."""
    memory, always = {"ready": "10GiB"}, {"activation": "always"}
    deps = [launched(n, memory=memory, lifecycle=always) for n in ("a", "b")]
    said = refused(tmp_path, {"resources": {"memory_budget": "15GiB"}, "deployments": deps})
    assert "lifecycle.activation: always hold 20GiB ready on this machine" in said
    deps[1]["lifecycle"] = {}  # one kept ready, one started by requests: it fits
    GatewayConfig.model_validate({"resources": {"memory_budget": "15GiB"}, "deployments": deps})


def test_a_deployment_that_fits_the_budget_on_each_machine_loads() -> None:
    fits = launched(memory={"ready": "15GiB"})
    GatewayConfig.model_validate({"resources": {"memory_budget": "15GiB"}, "deployments": [fits]})
    spread = launched(memory={"ready": "10GiB"})
    launch = spread["instances"][0]["launch"]
    spread["instances"] = [{"host": h, "launch": launch} for h in ("gpu-a", "gpu-b")]
    doc = {"resources": {"memory_budget": "15GiB"}, "deployments": [spread]}
    GatewayConfig.model_validate(doc)  # the budget is per machine


def test_every_configuration_in_the_docs_still_loads(tmp_path: Path) -> None:
    found = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
            doc = yaml.safe_load(block)
            if isinstance(doc, dict) and "deployments" in doc:
                (tmp_path / "g.yaml").write_text(block)
                load_config(tmp_path / "g.yaml")
                found += 1
    assert found >= 4


# -- list and status ----------------------------------------------------------------------------
def _said(gw: Gw, name: str) -> tuple[str, str, int]:
    fleet = gw.gateway.fleet
    doc = deployment_status(fleet, name)
    assert doc is not None
    (row,) = [
        r
        for r in deployments_list(fleet.lifecycle, fleet.routes, None)["deployments"]
        if r["name"] == name
    ]
    return doc["deployment"]["state"], row["state"], row["ready"]


@pytest.mark.anyio
async def test_list_and_status_agree_on_an_engine_someone_else_runs(
    make_gateway: Any, engine: Any, unresponsive: str
) -> None:
    gw = await make_gateway(
        {
            "deployments": [
                deployments(engine.url, name="up"),
                deployments(unresponsive, name="down"),
            ]
        }
    )
    collector = gw.gateway.fleet.collector
    await collector.refresh("up/0")  # one collection cycle each, now
    await collector.refresh("down/0")
    assert collector.status("down/0").state.value != "ready"
    assert _said(gw, "up") == ("ready", "ready", 1)
    assert _said(gw, "down") == ("unavailable", "unavailable", 0)


def test_a_section_written_with_nothing_under_it_means_its_defaults(tmp_path: Path) -> None:
    """``resources:`` alone (YAML's null) and its kind were a library's "Input should be a
    valid dictionary"; they mean what leaving them out means."""
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "queue:\nlimits:\nresources:\ndeployments:\n"
        "  - name: m\n    engine: vllm\n    engine_version: '0.31.0'\n"
        "    lifecycle:\n    routing:\n"
        "    instances:\n      - launch:\n          command: [vllm, serve, m]\n"
        "          env:\n          logs:\n",
        encoding="utf-8",
    )
    config = load_config(path)
    launch = {"command": ["vllm", "serve", "m"]}
    dep = {"name": "m", "engine": "vllm", "engine_version": "0.31.0"}
    plain = GatewayConfig.model_validate(
        {"deployments": [{**dep, "instances": [{"launch": launch}]}]}
    )
    assert config == plain
    path.write_text("resources: 7\ndeployments: []\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="resources"):  # a wrong value is still refused
        load_config(path)


def test_memory_is_shown_in_the_units_it_is_configured_in() -> None:
    """``list`` and ``status`` printed raw bytes (4294967296) for a ``4GiB`` deployment."""
    from rich.console import Console

    from capyctl_gateway._management.render import print_list, size

    assert [size(n) for n in (0, 512, 2048, 3 * 2**29, 4 * 2**30, 2**40 + 2**39)] == [
        "0 B",
        "512 B",
        "2 KiB",
        "1.5 GiB",
        "4 GiB",
        "1.5 TiB",
    ]
    row = {
        "name": "m",
        "id": "01ABCDEFGHJK",
        "api": "chat",
        "engine": "vllm",
        "run_by": "the gateway (launch)",
        "state": "ready",
        "ready": 1,
        "instances": 1,
        "memory_held": 4 * 2**30,
    }
    text = Console(width=120, record=True)
    print_list(text, {"deployments": [row], "memory_held": 4 * 2**30, "memory_budget": 6 * 2**30})
    out = text.export_text()
    assert "4 GiB" in out and "of a budget of 6 GiB" in out and "bytes" not in out


def test_list_keeps_the_engine_name_whole_in_80_columns() -> None:
    """In a terminal of 80 columns ``list`` printed the engine as ``tensorf…``."""
    from rich.console import Console

    from capyctl_gateway._management.render import print_list

    row: dict[str, Any] = {
        "name": "Qwen/Qwen3-4B-Instruct",
        "id": "01ABCDEFGHJK",
        "api": "decisions",
    }
    row |= {"run_by": "the gateway (launch)", "state": "stopped by an operator", "ready": 0}
    row |= {"instances": 2, "memory_held": 4 * 2**30}
    rows = [{**row, "engine": engine} for engine in ("tensorfold", "llamacpp")]
    text = Console(width=80, record=True)
    print_list(text, {"deployments": rows, "memory_held": 0, "memory_budget": None})
    out = text.export_text()
    assert "tensorfold" in out and "llamacpp" in out and "Qwen/Qwen3-4B-Instruct" in out
    # Nor anything else: the table did not fit, so each deployment is two whole lines (the
    # columns left to "run by" and "state" cut them to "the gate…", then to "t…").
    assert "…" not in out
    assert out.count("run by the gateway (launch)") == 2
    assert out.count("stopped by an operator; 0/2 instances ready; memory held 4 GiB") == 2
    wide = Console(width=160, record=True)
    print_list(wide, {"deployments": rows, "memory_held": 0, "memory_budget": None})
    assert "┃ run by" in wide.export_text()  # a terminal wide enough gets the table
