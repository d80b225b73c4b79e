"""capyctl_gateway: the ``capyctl-gateway`` OpenAI chat gateway."""

from __future__ import annotations

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
