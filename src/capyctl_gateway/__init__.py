"""capyctl_gateway: the ``capyctl-gateway`` OpenAI chat gateway.

The public names are imported on first use (PEP 562), so that a small process of the gateway's
own (an engine's keeper, ``_local/reaper.py``, started once per engine start) imports only what
it needs, not the whole gateway.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._config import ConfigError as ConfigError
    from ._config import GatewayConfig as GatewayConfig
    from ._config import load_config as load_config
    from ._errors import GatewayError as GatewayError
    from ._gateway import Gateway as Gateway
    from ._http.app import GATEWAY_KEY as GATEWAY_KEY
    from ._http.app import GatewayRunner as GatewayRunner
    from ._http.app import create_app as create_app
    from ._identity import CredentialsError as CredentialsError
    from ._identity import load_or_create_api_key as load_or_create_api_key
    from ._management.api import create_management_app as create_management_app

__all__ = (
    "ConfigError",
    "CredentialsError",
    "GATEWAY_KEY",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "GatewayRunner",
    "create_app",
    "create_management_app",
    "load_config",
    "load_or_create_api_key",
)

_WHERE = {
    "ConfigError": "._config",
    "GatewayConfig": "._config",
    "load_config": "._config",
    "GatewayError": "._errors",
    "Gateway": "._gateway",
    "GATEWAY_KEY": "._http.app",
    "GatewayRunner": "._http.app",
    "create_app": "._http.app",
    "CredentialsError": "._identity",
    "load_or_create_api_key": "._identity",
    "create_management_app": "._management.api",
}


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later reads find it without this call
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
