"""What the server and a host say to each other on the control session, and the host's view of
the configuration.

The session is a WebSocket over mutual TLS (``GET /v1/session`` on the server's control
listener). Every message is one JSON object with a type ``t``:

* host to server: ``hello`` (once), ``report`` (every `REPORT_EVERY_S`: each instance's state,
  gate, engine load with its age, the ingress's in-flight count), ``done`` (an order's answer),
  ``pong``;
* server to host: ``setup`` (the deployments placed on the host), ``order`` (start, park, wake
  or stop one instance), ``ping`` (every `REPORT_EVERY_S`; the round trip bounds how old a
  report can be).

Either side that hears nothing for `LOST_AFTER_S` takes the session as lost: the server skips
the host's instances and ends the streams through it; the host closes its ingress connections
(which closes their engine connections) and connects again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from .._config import REMOTE_MAX_BODY_BYTES, Deployment, GatewayConfig
from .._deployments.runner import CacheCounts

__all__ = [
    "INGRESS_MAX_BODY_BYTES",
    "LOST_AFTER_S",
    "MAX_MESSAGE_BYTES",
    "NOT_FORWARDED",
    "REPORT_EVERY_S",
    "STALE_AFTER_S",
    "InstanceReport",
    "host_view",
    "deployment_tag",
    "ingress_path",
]

REPORT_EVERY_S = 1.0
LOST_AFTER_S = 3.0
"""A session silent this long is lost (a killed host, a cut network)."""
STALE_AFTER_S = 3.0
"""A host's engine sample older than this is not load (routing falls back to the server's own
in-flight count)."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
REWRITE_ROOM_BYTES = 64 * 1024
"""What the server's rewrite of a request (the engine's model id, ``stream`` and
``stream_options``) may add to a client's body at the limit and still be forwarded."""
INGRESS_MAX_BODY_BYTES = REMOTE_MAX_BODY_BYTES + REWRITE_ROOM_BYTES
"""The largest body a host's ingress takes (413 past it): the client's 8 MiB and the room for
the server's rewrite. The server checks the body it rebuilt against it before sending."""
NOT_FORWARDED = "X-CapyCTL-Not-Forwarded"
"""Set by a host's ingress on every answer it gives without forwarding the request: the engine
never saw it, so the server may offer it to another instance (the relay reads it)."""


def ingress_path(deployment: str, index: int) -> str:
    """Where a host's ingress serves one instance (followed by ``/v1/chat/completions``): the
    deployment by a digest of its name, which may hold any character."""
    return f"/i/{deployment_tag(deployment)}/{index}"


def deployment_tag(deployment: str) -> str:
    return hashlib.sha256(deployment.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """One instance as its host last reported it."""

    deployment: str
    instance: int
    """The server's index of the instance in its deployment."""
    state: str
    """A lifecycle state, or ``external`` for an engine someone else runs on the host."""
    gate: str | None = field(repr=False)
    """The key the ingress wants for it (64 hex characters) while it takes requests."""
    generation: int
    """Counts the engine processes the host started for it (a new one: a restart)."""
    running: int | None
    waiting: int | None
    usage: float | None
    """KV cache or slot usage, 0..1."""
    age_s: float | None
    """Age of the engine sample when the report left the host (None: no sample)."""
    ingress_in_flight: int
    quiet_ping: int | None = None
    """Set when the engine sample was taken after the host received this ping and after its
    ingress's last forward to the instance ended, with nothing in flight there: the evidence
    that settles a cut request (see `Machines`)."""
    prefix_queried: int | None = None
    """The engine's own prefix-cache counts in its latest sample (`CacheCounts`), however old;
    None where it publishes none."""
    prefix_hits: int | None = None
    pid: int | None = None
    port: int | None = None
    command: list[str] | None = None
    failure: str | None = None

    def cache_counts(self) -> CacheCounts | None:
        """The engine's prefix-cache counts, where it reported both."""
        if self.prefix_queried is None or self.prefix_hits is None:
            return None
        return CacheCounts(self.prefix_queried, self.prefix_hits)

    def to_json(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "instance": self.instance,
            "state": self.state,
            "gate": self.gate,
            "generation": self.generation,
            "running": self.running,
            "waiting": self.waiting,
            "usage": self.usage,
            "age_s": self.age_s,
            "ingress_in_flight": self.ingress_in_flight,
            "quiet_ping": self.quiet_ping,
            "prefix_queried": self.prefix_queried,
            "prefix_hits": self.prefix_hits,
            "pid": self.pid,
            "port": self.port,
            "command": self.command,
            "failure": self.failure,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> InstanceReport:
        def opt_int(key: str) -> int | None:
            v = doc.get(key)
            return int(v) if v is not None else None

        def opt_float(key: str) -> float | None:
            v = doc.get(key)
            return float(v) if v is not None else None

        gate = doc.get("gate")
        command = doc.get("command")
        failure = doc.get("failure")
        return cls(
            deployment=str(doc["deployment"]),
            instance=int(doc["instance"]),
            state=str(doc["state"]),
            gate=str(gate) if gate is not None else None,
            generation=int(doc["generation"]),
            running=opt_int("running"),
            waiting=opt_int("waiting"),
            usage=opt_float("usage"),
            age_s=opt_float("age_s"),
            ingress_in_flight=int(doc["ingress_in_flight"]),
            quiet_ping=opt_int("quiet_ping"),
            prefix_queried=opt_int("prefix_queried"),
            prefix_hits=opt_int("prefix_hits"),
            pid=opt_int("pid"),
            port=opt_int("port"),
            command=[str(a) for a in command] if isinstance(command, list) else None,
            failure=str(failure) if failure is not None else None,
        )


def host_view(config: GatewayConfig, host: str) -> list[dict[str, Any]]:
    """The deployments with instances on ``host``, as the ``setup`` message carries them: each
    with only that host's instances (their server index in ``index``), and without what the
    server decides itself (idle timeouts, activation, the memory budget)."""
    out = []
    for d in config.deployments:
        mine = [(n, i) for n, i in enumerate(d.instances) if i.host == host]
        if not mine:
            continue
        doc = d.model_dump(mode="json", exclude_none=True)
        doc["instances"] = [
            {**i.model_dump(mode="json", exclude_none=True, exclude={"host"}), "index": n}
            for n, i in mine
        ]
        doc["lifecycle"] = {"park": d.lifecycle.park, "drain_timeout": d.lifecycle.drain_timeout}
        doc.pop("memory", None)
        out.append(doc)
    return out


def host_config(view: list[dict[str, Any]]) -> tuple[GatewayConfig, dict[tuple[str, int], int]]:
    """The host's own configuration from a ``setup`` message, and the server index of each of
    its (deployment, local index). Raises pydantic's ValidationError on a bad message."""
    indexes: dict[tuple[str, int], int] = {}
    deployments = []
    for doc in view:
        instances = []
        for local, inst in enumerate(doc["instances"]):
            inst = dict(inst)
            indexes[(str(doc["name"]), local)] = int(inst.pop("index"))
            instances.append(inst)
        deployments.append(Deployment.model_validate({**doc, "instances": instances}))
    return GatewayConfig(deployments=deployments), indexes
