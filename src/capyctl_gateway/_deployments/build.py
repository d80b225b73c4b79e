"""Building the routes from the configuration: one `Route` per deployment, each instance with
the headers the gateway sends its engine and the runner chosen for it; the engine keys read
from the environment, refused when one is not set.

Never imports the HTTP surface or the relay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._config import ConfigError, GatewayConfig, Instance
from .._engines import facts
from .prefixes import PrefixIndex
from .queue import Admission, DeploymentQueue
from .routes import EngineInstance, Route
from .runner import Runner
from .settle import Settlement
from .waiters import Waiters

__all__ = ["ENGINE_HEADERS", "build_routes", "check_engine_keys"]

ENGINE_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "text/event-stream",
    # The stream is parsed as it comes: the engine must not compress it.
    "Accept-Encoding": "identity",
    # Ours, so that aiohttp adds none of its own (and skips work doing so).
    "User-Agent": "capyctl-gateway",
}


def _engine_key(instance: Instance, env: Mapping[str, str]) -> str | None:
    if instance.api_key_env is None:
        return None
    key = env.get(instance.api_key_env)
    if not key:
        where = instance.url or "launched"
        raise ConfigError(f"instance {where}: api_key_env {instance.api_key_env} is not set")
    return key


def build_routes(
    config: GatewayConfig,
    env: Mapping[str, str],
    settlement: Settlement,
    runner_for: Callable[[Instance], Callable[[EngineInstance], Runner]],
    ids: Mapping[str, str],
) -> dict[str, Route]:
    """One route per deployment, each instance with the runner that what ``runner_for`` gives
    for its configuration makes as the instance is built, and the deployment's short ID from
    ``ids``; raises ConfigError for an engine key that is not set."""
    admission = Admission(config.queue.max_waiting_total)
    routes: dict[str, Route] = {}
    for d in config.deployments:
        waiters = Waiters()
        instances = []
        for i, inst in enumerate(d.instances):
            key = _engine_key(inst, env) if inst.host is None else None  # read on the host
            headers = dict(ENGINE_HEADERS)
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            if facts(d.engine).closes_after_stream:
                headers["Connection"] = "close"  # so the connection is never reused
            ledger = settlement.ledger(f"{d.name}/{i}")
            url = inst.url if inst.host is None else None  # one on a host: at its ingress
            built = EngineInstance(
                deployment=d.name,
                index=i,
                url=url,
                headers=headers,
                engine_key=key,
                ledger=ledger,
                waiters=waiters,
                runner_of=runner_for(inst),
                launch=inst.launch,
                timed=inst.launch is not None and d.lifecycle.spare_idle_timeout is not None,
            )
            instances.append(built)
        queue = DeploymentQueue(
            admission,
            max_running=config.queue.max_running_per_deployment,
            max_waiting=config.queue.max_waiting_per_deployment,
            gated=d.launched,
            holdup=_holdup(instances),
        )
        route = routes[d.name] = Route(d, instances, queue, waiters, ids[d.name])
        if d.routing.policy == "prefix" and len(instances) > 1:
            route.prefixes = PrefixIndex(d.routing.prefix_entries)
    return routes


def _holdup(instances: list[EngineInstance]) -> Callable[[], str | None]:
    def why() -> str | None:
        return next((w for i in instances if (w := i.runner.holdup()) is not None), None)

    return why


def check_engine_keys(config: GatewayConfig, env: Mapping[str, str]) -> None:
    """Raise ConfigError for an engine key that is not set (before anything is opened)."""
    for d in config.deployments:
        for inst in d.instances:
            if inst.host is None:
                _engine_key(inst, env)
