"""Domain events the collector emits, and the hook protocol that receives them.

Hooks are called synchronously from the collector's task, right after the state they describe
changed; they must be quick and must not do I/O. Logging is just one such hook.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ._errors import CanopyxError
from ._snapshot import CheckReport, EngineSnapshot

__all__ = [
    "ChecksCompleted",
    "EngineRestarted",
    "Event",
    "EventHook",
    "LoggingHook",
    "ScrapeFailed",
    "ScrapeSucceeded",
]


@dataclass(frozen=True, slots=True)
class ScrapeSucceeded:
    key: str
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class ScrapeFailed:
    key: str
    check: str
    """Which check failed: health, models, discovery or metrics."""
    error: CanopyxError
    at: float


@dataclass(frozen=True, slots=True)
class ChecksCompleted:
    key: str
    report: CheckReport


@dataclass(frozen=True, slots=True)
class EngineRestarted:
    """The engine's process start marker changed between two samples."""

    key: str
    previous: float
    current: float


Event = ScrapeSucceeded | ScrapeFailed | ChecksCompleted | EngineRestarted


class EventHook(Protocol):
    def __call__(self, event: Event, /) -> None: ...


class LoggingHook:
    """Logs failures and check results; successful scrapes at DEBUG only."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger("canopyx_provider.collector")

    def __call__(self, event: Event) -> None:
        match event:
            case ScrapeFailed(key=key, check=check, error=error):
                self._log.warning("%s: %s check failed: %s", key, check, error.message)
            case ChecksCompleted(key=key, report=report):
                failed = report.failed
                if failed is None:
                    self._log.info("%s: startup checks passed", key)
                else:
                    self._log.warning("%s: %s check failed: %s", key, failed.name, failed.reason)
            case EngineRestarted(key=key):
                self._log.info("%s: engine restarted", key)
            case ScrapeSucceeded(key=key, snapshot=snap):
                if self._log.isEnabledFor(logging.DEBUG):
                    self._log.debug("%s: %r", key, snap)
