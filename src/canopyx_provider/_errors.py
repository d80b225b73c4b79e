"""The exceptions raised by canopyx_provider.

Every exception the SDK raises on purpose derives from `CanopyxError`::

    CanopyxError
    ├── ScrapeError                   an HTTP exchange with the engine failed
    │   ├── EngineUnreachableError    connection refused, reset, DNS, ...
    │   ├── ScrapeTimeoutError        no answer within request_timeout_ms
    │   └── UnexpectedStatusError     an answer with a status the endpoint must not give
    ├── ParseError                    an answer arrived but could not be read
    │   ├── MetricsParseError         Prometheus text that does not parse
    │   └── InfoParseError            JSON (health, models, props, server_info) that does not parse
    ├── SnapshotValidationError       the metrics do not meet the single-engine contract
    │   ├── MissingMetricError        no sample left after selection
    │   └── AmbiguousMetricError      more than one sample left after selection
    ├── ModelNotListedError           /v1/models does not list the engine model ID
    ├── StaleSnapshotError            the latest snapshot is older than max_metrics_age_ms
    └── ConfigError (also ValueError) bad options, a bad key file, ...

Third-party errors (httpx, aiohttp, prometheus_client) are translated at one boundary each:
`_scrape.py` for httpx, `_scrape_aiohttp.py` for aiohttp and `_prom.py` for the Prometheus parser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "AmbiguousMetricError",
    "CanopyxError",
    "ConfigError",
    "EngineUnreachableError",
    "InfoParseError",
    "MetricsParseError",
    "MissingMetricError",
    "ModelNotListedError",
    "ParseError",
    "ScrapeError",
    "ScrapeTimeoutError",
    "SnapshotValidationError",
    "StaleSnapshotError",
    "UnexpectedStatusError",
]


class CanopyxError(Exception):
    """The root of every error canopyx_provider raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class ScrapeError(CanopyxError):
    """An HTTP exchange with the engine failed."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class EngineUnreachableError(ScrapeError):
    """The engine could not be reached (refused, reset, name not resolved...)."""


class ScrapeTimeoutError(ScrapeError):
    """The engine did not answer within the request timeout."""


class UnexpectedStatusError(ScrapeError):
    """The engine answered with a status the endpoint must not give."""

    def __init__(self, message: str, *, url: str, status: int) -> None:
        super().__init__(message, url=url)
        self.status = status


class ParseError(CanopyxError):
    """An answer arrived but could not be read."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class MetricsParseError(ParseError):
    """A Prometheus exposition that does not parse."""


class InfoParseError(ParseError):
    """A JSON document (health, models, props, server_info) that does not parse or lacks a key."""


class SnapshotValidationError(CanopyxError):
    """The exposition does not meet the single-engine contract."""

    def __init__(self, message: str, *, metric: str) -> None:
        super().__init__(message)
        self.metric = metric


class MissingMetricError(SnapshotValidationError):
    """No sample of a required metric is left after label selection."""

    def __init__(
        self, metric: str, *, selector: Mapping[str, str], seen: Sequence[Mapping[str, str]]
    ) -> None:
        wanted = _labels(selector)
        if seen:
            others = ", ".join(_labels(s) for s in seen)
            detail = f"no sample matches {wanted}; samples seen: {others}"
        else:
            detail = "the engine does not publish it"
        super().__init__(f"missing metric {metric}: {detail}", metric=metric)
        self.selector = dict(selector)
        self.seen = [dict(s) for s in seen]


class AmbiguousMetricError(SnapshotValidationError):
    """More than one sample of a metric is left after label selection."""

    def __init__(
        self, metric: str, *, selector: Mapping[str, str], seen: Sequence[Mapping[str, str]]
    ) -> None:
        sets = ", ".join(_labels(s) for s in seen)
        super().__init__(
            f"ambiguous metric {metric}: {len(seen)} samples match {_labels(selector)} "
            f"({sets}); add labels to select exactly one engine",
            metric=metric,
        )
        self.selector = dict(selector)
        self.seen = [dict(s) for s in seen]


class ModelNotListedError(CanopyxError):
    """The engine's model list does not include the engine model ID."""

    def __init__(self, model_id: str, *, listed: Sequence[str]) -> None:
        names = ", ".join(repr(i) for i in listed) or "nothing"
        super().__init__(f"the engine lists {names}, not {model_id!r}")
        self.model_id = model_id
        self.listed = tuple(listed)


class StaleSnapshotError(CanopyxError):
    """The latest snapshot is older than max_metrics_age_ms, or there is none."""


class ConfigError(CanopyxError, ValueError):
    """Options or files that cannot be used as given.

    ``option`` names the option at fault where one does (``labels``, ``router``...), so that a
    front end can word the message in its own terms.
    """

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


_CODES: tuple[tuple[type[CanopyxError], str], ...] = (
    (EngineUnreachableError, "unreachable"),
    (ScrapeTimeoutError, "timeout"),
    (UnexpectedStatusError, "unexpected_status"),
    (ScrapeError, "broken_answer"),
    (ParseError, "unreadable"),
    (MissingMetricError, "missing_metric"),
    (AmbiguousMetricError, "ambiguous_metric"),
    (SnapshotValidationError, "invalid_metric"),
    (ModelNotListedError, "model_not_listed"),
)


def error_code(error: CanopyxError) -> str:
    """A fixed code for ``error`` that carries no engine figures (safe to send to Canopy)."""
    return next((code for cls, code in _CODES if isinstance(error, cls)), "failed")
