"""The gateway's three exception trees, and the in-band error event.

Every error the gateway answers a client with:

    GatewayError                  status, code, message, retryable; detail for the log only
    ├── RefusedError              the request as sent is refused (4xx, the client's to fix)
    │   ├── InvalidRequestError   400 invalid_request
    │   ├── UnauthorizedError     401 unauthorized
    │   ├── UnknownModelError     404 unknown_model
    │   └── TooLargeError         413 request_too_large
    ├── BusyError                 the gateway cannot take it now (retryable)
    │   ├── QueueFullError        429 queue_full (with Retry-After)
    │   └── UnavailableError      503 unavailable: a deadline passed, no slot or instance
    ├── ActivationFailedError     500 activation_failed: a launched engine did not start
    ├── DeploymentStoppedError    409 deployment_stopped / deployment_inactive
    ├── ClientGoneError           the client hung up: there is nobody left to answer
    ├── InternalError             500 internal_error: a defect in the gateway (logged with
    │                             its traceback by the code that turned it into this)
    └── EngineError               502 engine_error: the engine failed this request
        ├── NotAcceptedError      the engine provably never got it: another instance may
        ├── EngineRejectedError   the engine refused it: its 4xx status and message are kept
        └── UnverifiedError       the engine's stream broke a rule (stream_unverified in band)
            └── SSEError          the bytes are not a stream of data events

A request the gateway itself ends hears one by its ender's code (`_relay.ending.ended_by_gateway`).

What an operator must fix before the gateway can run (the CLI catches the root, prints the
message and exits 1):

    OperatorError                 the message names the file or key and what to do
    ├── ConfigError               the configuration (``_config.py``)
    ├── CredentialsError          the key or credentials file (``_identity.py``)
    ├── JoinError                 a join file or enrollment (``_machines/enroll.py``)
    └── PkiError                  a control key, CSR or certificate (``_machines/certs.py``)

Driving an engine (the lifecycle and the runners; never shown to a client as it is, but
turned into ``activation_failed`` or ``unavailable`` by the lifecycle):

    EngineControlError            message; log_tail, began, lingers (see the class)
    ├── StartFailedError          it exited, could not be run, or did not answer in time
    ├── ParkFailedError           it did not park or wake as asked
    ├── HostGoneError             its host has no session, or lost it before answering
    └── OrderRefusedError         its host carried the order out and failed: the host's words

The engine client's own transport errors (``_engine_answer.py``: `EngineConnectError`, an
`OSError`, and `EngineConnectionError`, a `ConnectionError`) are translated into the first
tree by the exchange alone.

The rarer refusals (``unsupported_parameter``, ``api_mismatch``, ``cache_salt_unsupported``,
``not_found``, ``method_not_allowed``) are a `RefusedError` or a `GatewayError` given their
status and code.

Only ``message`` reaches a client; it names a deployment and an instance index, never an
address. ``detail`` (an aiohttp error's text, an engine's own words) goes to the log with the
request ID. Errors are built per request, never shared: a traceback or a ``__context__`` must
not carry one request's state into another's.

`answer` and `error_event` (in ``_http/answers.py`` and here) are the only places that turn
one into bytes for a client. Imports nothing of the gateway.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "ActivationFailedError",
    "BusyError",
    "ClientGoneError",
    "DeploymentStoppedError",
    "EngineControlError",
    "EngineError",
    "EngineRejectedError",
    "GatewayError",
    "HostGoneError",
    "InternalError",
    "InvalidRequestError",
    "NotAcceptedError",
    "OperatorError",
    "OrderRefusedError",
    "ParkFailedError",
    "QueueFullError",
    "RefusedError",
    "SSEError",
    "StartFailedError",
    "TooLargeError",
    "UnauthorizedError",
    "UnavailableError",
    "UnknownModelError",
    "UnverifiedError",
    "error_body",
    "error_event",
]

MAX_MESSAGE_BYTES = 512
"""An engine's own message is cut to this many bytes before it reaches a client."""


class GatewayError(Exception):
    """A documented refusal: HTTP ``status``, machine ``code``, human ``message``.

    Subclasses fix the status and code; the base takes them for the rarer codes
    (``unsupported_parameter``, ``api_mismatch``, ``cache_salt_unsupported``, ...).
    """

    status: int = 500
    code: str = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retryable: bool | None = None,
        detail: str | None = None,
        in_band: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        self.detail = detail
        """What only the log may see (addresses, the engine's own words)."""
        self.in_band = in_band
        """The client asked for a stream and hears of this as an error event on it."""

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retryable:
            out["retryable"] = True
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, {self.message!r})"


class RefusedError(GatewayError):
    """The request, as sent, is refused before any engine sees it."""

    status = 400
    code = "invalid_request"


class InvalidRequestError(RefusedError):
    pass


class UnauthorizedError(RefusedError):
    status = 401
    code = "unauthorized"

    def __init__(self) -> None:
        super().__init__("missing or invalid api key")


class UnknownModelError(RefusedError):
    status = 404
    code = "unknown_model"


class TooLargeError(RefusedError):
    status = 413
    code = "request_too_large"


class BusyError(GatewayError):
    """The gateway cannot take the request now; the same request may succeed later."""

    retryable = True


class QueueFullError(BusyError):
    status = 429
    code = "queue_full"


class UnavailableError(BusyError):
    status = 503
    code = "unavailable"


class ActivationFailedError(GatewayError):
    """A launched engine could not be started or woken for the request; the next request
    tries a fresh start."""

    status = 500
    code = "activation_failed"


class DeploymentStoppedError(GatewayError):
    """An operator stopped the deployment (``deployment_stopped``), or it starts only when
    told to (``deployment_inactive``): a request does not start it."""

    status = 409
    code = "deployment_stopped"


class ClientGoneError(GatewayError):
    """The client went away; logged as 499, never written anywhere."""

    status = 499
    code = "client_gone"

    def __init__(self) -> None:
        super().__init__("the client hung up")


class InternalError(GatewayError):
    """A defect in the gateway, turned into an answer (``_tasks.Supervisor.fault``): its
    traceback is in the log, its message names neither an address nor the exception."""

    status = 500
    code = "internal_error"


class EngineError(GatewayError):
    """The engine failed this request (connection, status, answer)."""

    status = 502
    code = "engine_error"


class NotAcceptedError(EngineError):
    """The engine provably never got the request (no connection was established)."""


class EngineRejectedError(EngineError):
    """The engine refused the request; its status (400, 413, 422) and message are kept."""

    code = "engine_rejected"

    def __init__(self, status: int, message: str) -> None:
        cut = message.encode()[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")
        super().__init__(cut or "rejected by the engine", status=status)


class UnverifiedError(EngineError):
    """The engine's stream broke a rule: nothing more of it may reach the client."""

    code = "stream_unverified"


class SSEError(UnverifiedError):
    """The bytes are not a stream of data events."""


class OperatorError(Exception):
    """Something an operator must fix before the gateway can run; the message says what."""


class EngineControlError(Exception):
    """An engine could not be started, parked, woken or stopped as asked. ``began``: whether an
    engine ran (if not, ``message`` says why, to clients too); ``lingers``: one may still run."""

    def __init__(
        self, message: str, *, log_tail: str = "", began: bool = True, lingers: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.log_tail = log_tail
        """The end of the engine's own log, where there is one (never shown to a client)."""
        self.began, self.lingers = began, lingers


class StartFailedError(EngineControlError):
    """The engine did not become ready: it exited, or did not answer within its timeout."""


class ParkFailedError(EngineControlError):
    """The engine did not park or wake as asked."""


class HostGoneError(EngineControlError):
    """An order could not be carried out: the host has no session, or lost it meanwhile."""


class OrderRefusedError(EngineControlError):
    """The host carried the order out and it failed; the message is the host's words."""


def error_body(err: GatewayError) -> bytes:
    return orjson.dumps(err.body())


def error_event(err: GatewayError) -> bytes:
    """The in-band form, once a stream has started: one data event, never followed by [DONE]."""
    inner = {"code": err.code, "message": err.message, "retryable": err.retryable}
    return b"data: " + orjson.dumps({"error": inner}) + b"\n\n"


def invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message)
