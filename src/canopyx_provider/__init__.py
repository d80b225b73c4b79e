"""canopyx_provider: engine metric adapters, a polling collector and pricing callbacks for
GPU providers who sell inference through Canopy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._collector import Collector as Collector
from ._collector import EngineStatus as EngineStatus
from ._collector import TargetState as TargetState
from ._errors import AmbiguousMetricError as AmbiguousMetricError
from ._errors import CanopyxError as CanopyxError
from ._errors import ConfigError as ConfigError
from ._errors import EngineUnreachableError as EngineUnreachableError
from ._errors import InfoParseError as InfoParseError
from ._errors import MetricsParseError as MetricsParseError
from ._errors import MissingMetricError as MissingMetricError
from ._errors import ModelNotListedError as ModelNotListedError
from ._errors import ParseError as ParseError
from ._errors import ScrapeError as ScrapeError
from ._errors import ScrapeTimeoutError as ScrapeTimeoutError
from ._errors import SnapshotValidationError as SnapshotValidationError
from ._errors import StaleSnapshotError as StaleSnapshotError
from ._errors import UnexpectedStatusError as UnexpectedStatusError
from ._errors import error_code as error_code
from ._events import ChecksCompleted as ChecksCompleted
from ._events import EngineRestarted as EngineRestarted
from ._events import Event as Event
from ._events import EventHook as EventHook
from ._events import LoggingHook as LoggingHook
from ._events import ScrapeFailed as ScrapeFailed
from ._events import ScrapeSucceeded as ScrapeSucceeded
from ._keys import engine_api_key as engine_api_key
from ._link import CanopyLink as CanopyLink
from ._link import CheckStatus as CheckStatus
from ._link import ConnectionGrant as ConnectionGrant
from ._link import InProcessLink as InProcessLink
from ._link import LinkMessage as LinkMessage
from ._link import PricePublication as PricePublication
from ._link import QuoteAnswer as QuoteAnswer
from ._link import StatusReport as StatusReport
from ._options import ProviderOptions as ProviderOptions
from ._pricing import CanopyCounts as CanopyCounts
from ._pricing import Decline as Decline
from ._pricing import LoadAndAdmission as LoadAndAdmission
from ._pricing import Price as Price
from ._pricing import PricingStrategy as PricingStrategy
from ._pricing import QuoteContext as QuoteContext
from ._pricing import QuoteRequest as QuoteRequest
from ._provider import Provider as Provider
from ._scrape import Fetcher as Fetcher
from ._scrape import HttpxFetcher as HttpxFetcher
from ._scrape import RawResponse as RawResponse
from ._snapshot import Capacity as Capacity
from ._snapshot import CheckReport as CheckReport
from ._snapshot import CheckResult as CheckResult
from ._snapshot import EngineKind as EngineKind
from ._snapshot import EngineMetrics as EngineMetrics
from ._snapshot import EngineSnapshot as EngineSnapshot
from ._snapshot import SupportLevel as SupportLevel
from .adapters import EngineAdapter as EngineAdapter
from .adapters import adapter_for as adapter_for
from .adapters import llama_cpp as llama_cpp
from .adapters import mlx as mlx
from .adapters import ollama as ollama
from .adapters import sglang as sglang
from .adapters import tabby_api as tabby_api
from .adapters import tensorfold as tensorfold
from .adapters import vllm as vllm

if TYPE_CHECKING:
    from ._scrape_aiohttp import AiohttpFetcher as AiohttpFetcher

_LAZY = {"AiohttpFetcher": "._scrape_aiohttp"}
"""Names imported on first use: aiohttp is asyncio-only and slow to import; trio users and the
CLI need not load it."""


if not TYPE_CHECKING:  # for type checkers every name is imported above, and no other exists

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


__all__ = (
    "AiohttpFetcher",
    "AmbiguousMetricError",
    "CanopyCounts",
    "CanopyLink",
    "CanopyxError",
    "Capacity",
    "CheckReport",
    "CheckResult",
    "CheckStatus",
    "ChecksCompleted",
    "Collector",
    "ConfigError",
    "ConnectionGrant",
    "Decline",
    "EngineAdapter",
    "EngineKind",
    "EngineMetrics",
    "EngineRestarted",
    "EngineSnapshot",
    "EngineStatus",
    "EngineUnreachableError",
    "Event",
    "EventHook",
    "Fetcher",
    "HttpxFetcher",
    "InProcessLink",
    "InfoParseError",
    "LinkMessage",
    "LoadAndAdmission",
    "LoggingHook",
    "MetricsParseError",
    "MissingMetricError",
    "ModelNotListedError",
    "ParseError",
    "Price",
    "PricePublication",
    "PricingStrategy",
    "Provider",
    "ProviderOptions",
    "QuoteAnswer",
    "QuoteContext",
    "QuoteRequest",
    "RawResponse",
    "ScrapeError",
    "ScrapeFailed",
    "ScrapeSucceeded",
    "ScrapeTimeoutError",
    "SnapshotValidationError",
    "StaleSnapshotError",
    "StatusReport",
    "SupportLevel",
    "TargetState",
    "UnexpectedStatusError",
    "adapter_for",
    "engine_api_key",
    "error_code",
    "llama_cpp",
    "mlx",
    "ollama",
    "sglang",
    "tabby_api",
    "tensorfold",
    "vllm",
)
