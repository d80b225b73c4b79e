"""The public surface's own state: the key, the request bodies held, the models documents and
the gateway's telemetry, and the fleet it serves while it serves (``_fleet/``).

No module globals; the HTTP surface and management read it, the rooms below never import it.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

import orjson
from multidict import CIMultiDictProxy

from ._clock import wall
from ._config import GatewayConfig
from ._deployments.queue import BodyBudget
from ._fleet import Fleet
from ._telemetry import Telemetry

__all__ = ["Gateway"]


class Gateway:
    """What one gateway's listeners share."""

    def __init__(
        self,
        config: GatewayConfig,
        api_key: str,
        *,
        clock: Callable[[], float] = wall,
        started_at: int | None = None,
        prefix_seed: int | None = None,
    ) -> None:
        """``started_at``: the start a worker's models documents name (its authority's);
        ``prefix_seed``: the seed of its prefix fingerprints (its authority's)."""
        self.config = config
        self._key = api_key.encode()
        self.clock = clock
        self.telemetry = Telemetry()
        """The gateway's own counts and timings (read by the /metrics exposition)."""
        limits = config.limits
        self.bodies = BodyBudget(limits.max_body_bytes_in_flight, limits.client_share)
        """Request-body bytes read and held, over all requests."""
        self.started_at = int(clock()) if started_at is None else started_at
        self.prefix_seed = secrets.randbits(64) if prefix_seed is None else prefix_seed
        """The secret seed of the requests' prefix fingerprints (``_routing/prefix.py``):
        random per run, the same in every worker, never shown."""
        self._fleet: Fleet | None = None
        models = [
            {
                "id": d.name,
                "object": "model",
                "created": self.started_at,
                "owned_by": "capyctl",
                "capyctl": {"api": d.api.value},
            }
            for d in config.deployments
        ]
        self.models_document = orjson.dumps({"object": "list", "data": models})
        """``GET /v1/models``'s answer."""
        self.model_documents = {m["id"]: orjson.dumps(m) for m in models}
        """``GET /v1/models/{model}``'s answer, by deployment name (the list's entries)."""

    @property
    def fleet(self) -> Fleet:
        """The engines the gateway serves: open while its application runs, and readable (as
        they were left) after it stopped."""
        if self._fleet is None:
            raise RuntimeError("the gateway is not serving: start its application first")
        return self._fleet

    def serve(self, fleet: Fleet) -> None:
        """The application's startup hands the opened fleet over."""
        self._fleet = fleet

    def now(self) -> float:
        return self.clock()

    def key_to_share(self) -> str:
        """The key, for the console's one-time ticket trade (`_management/tickets.py`) and a
        worker's hello from its authority (``_workers/``) alone."""
        return self._key.decode("utf-8", "surrogateescape")

    def authorized(self, header: str) -> bool:
        """Whether an ``Authorization`` header value carries the gateway's key."""
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: keep them comparable.
        return hmac.compare_digest(key.lstrip(" ").encode("utf-8", "surrogateescape"), self._key)

    def admits(self, headers: CIMultiDictProxy[str], *, bare: str | None = None) -> bool:
        """The one key check of every listener: exactly one ``Authorization`` header, and it
        carries the key (never the first of several that fits). ``bare``: a header that may
        carry the key itself instead (Anthropic's ``x-api-key``): each given at most once, one
        at least, and every one given carries the key."""
        keys = headers.getall("Authorization", [])
        if bare is None:
            return len(keys) == 1 and self.authorized(keys[0])
        plain = headers.getall(bare, [])
        if len(keys) > 1 or len(plain) > 1 or not (keys or plain):
            return False
        given = plain[0].strip().encode("utf-8", "surrogateescape") if plain else self._key
        return (not keys or self.authorized(keys[0])) and hmac.compare_digest(given, self._key)
