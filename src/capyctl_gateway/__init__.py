"""capyctl_gateway: the ``capyctl-gateway`` OpenAI chat gateway."""

from __future__ import annotations

from ._app import Gateway as Gateway
from ._app import create_app as create_app
from ._config import ConfigError as ConfigError
from ._config import GatewayConfig as GatewayConfig
from ._config import load_config as load_config
from ._errors import GatewayError as GatewayError
from ._identity import CredentialsError as CredentialsError
from ._identity import load_or_create_api_key as load_or_create_api_key

__all__ = (
    "ConfigError",
    "CredentialsError",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "create_app",
    "load_config",
    "load_or_create_api_key",
)
