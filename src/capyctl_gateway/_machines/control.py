"""The server's control listener: ``POST /v1/enroll`` (a host's first contact, with its join
token; TLS without a client certificate) and ``GET /v1/session`` (the host's WebSocket session,
which needs the certificate enrollment gave it). The listener's TLS context is
`pki.server_context`: a certificate is checked when presented, and required here for a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import WSMsgType, web
from yarl import URL

from .._log import SparseLog, event
from . import pki
from .enroll import JoinError
from .protocol import LOST_AFTER_S, MAX_MESSAGE_BYTES, REPORT_EVERY_S, InstanceReport, host_view
from .roster import der_fingerprint

if TYPE_CHECKING:
    from .server import Machines

__all__ = ["PINGS_KEPT", "HostSession", "control_app", "ingress_origin", "on_host"]

PINGS_KEPT = 32
"""Pings whose send time is remembered: a report naming an older one settles nothing."""

logger = logging.getLogger("capyctl_gateway")


@dataclass(eq=False)
class HostSession:
    name: str
    ws: web.WebSocketResponse
    cert: str
    """The fingerprint of the certificate it came with (checked against the roster)."""
    peer: str | None = None
    """The address its session comes from (where its ingress must be)."""
    ingress: str = ""
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    pinged: dict[int, float] = field(default_factory=dict)
    """When each recent ping was sent, on the settlement's clock (the last `PINGS_KEPT`)."""
    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=16))


def control_app(machines: Callable[[], Machines]) -> web.Application:
    """The control listener's application; ``machines`` gives the server's hosts once its
    fleet is open (the listener is served only after that)."""
    control = _Control(machines)
    app = web.Application(client_max_size=64 * 1024)
    app.router.add_post("/v1/enroll", control.enroll)
    app.router.add_get("/v1/session", control.session)
    return app


class _Control:
    def __init__(self, machines: Callable[[], Machines]) -> None:
        self._machines = machines
        self._m: Machines | None = None
        self.refusals = SparseLog()
        """Whoever reaches the control port can be refused: at most a line a second of it."""

    @property
    def m(self) -> Machines:
        """The server's hosts (kept once known: a session may end after the fleet closed)."""
        if self._m is None:
            self._m = self._machines()
        return self._m

    async def enroll(self, request: web.Request) -> web.Response:
        try:
            doc = await request.json(loads=orjson.loads)
            host, token, csr = str(doc["host"]), str(doc["token"]), str(doc["csr"]).encode()
        except (ValueError, KeyError, TypeError):
            return _refuse(400, "bad_request", "an enrollment is JSON with host, token and csr")
        try:
            cert = self.m.identity.sign(csr, host)  # a request it cannot sign spends nothing
            self.m.invites.spend(token, host)
        except (JoinError, pki.PkiError) as exc:
            shown = host if pki.valid_host_name(host) else "(an invalid name)"
            self.refusals.warning("an enrollment as host %s was refused: %s", shown, exc)
            return _refuse(403, "join_refused", str(exc))
        self.m.invites.roster.enroll(host, pki.fingerprint(cert))  # warns of a name taken over
        logger.info("host %s enrolled", host)
        return web.json_response({"certificate": cert.decode()})

    async def session(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        admitted = _admitted(self.m, self.refusals, transport)
        if isinstance(admitted, web.Response):
            return admitted
        host, cert = admitted
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, autoping=True)
        await ws.prepare(request)
        old = self.m.sessions.get(host)
        if old is not None:  # the newer session wins (a host that reconnected)
            self.m.lost(old, "replaced by a new session")
        peername = transport.get_extra_info("peername") if transport is not None else None
        session = HostSession(host, ws, cert, peer=peername[0] if peername else None)
        try:
            await self._converse(session)
        finally:
            if self.m.sessions.get(host) is session:
                self.m.lost(session, "session ended")
        return ws

    async def _converse(self, session: HostSession) -> None:
        ws, host = session.ws, session.name
        hello = await ws.receive(timeout=LOST_AFTER_S)
        if hello.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return
        ingress = ingress_origin(orjson.loads(hello.data).get("ingress"))
        if ingress is None:
            logger.warning("host %s: its hello names no usable ingress; session refused", host)
            return
        if not on_host(ingress, session.peer):
            self.refusals.warning(
                "host %s: its ingress %s is not on the address its session comes from (%s); "
                "session refused (docs/gateway/machines.md)",
                host,
                ingress,
                session.peer,
            )
            return
        session.ingress = ingress
        await ws.send_bytes(
            orjson.dumps({"t": "setup", "deployments": host_view(self.m.config, host)})
        )
        self.m.up(session)
        event("host_session", "host %s: session up", host, host=host, state="live")
        pinger = asyncio.get_running_loop().create_task(self._ping(session))
        try:
            while True:
                try:
                    msg = await ws.receive(timeout=LOST_AFTER_S)
                except TimeoutError:
                    self.m.lost(session, f"nothing heard for {LOST_AFTER_S:.0f} s")
                    return
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    return
                self._heard(session, orjson.loads(msg.data))
        finally:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger

    async def _ping(self, session: HostSession) -> None:
        """Ping every second; and close the session once its certificate no longer holds the
        host's name (revoked, or the name enrolled again elsewhere)."""
        for n in itertools.count():
            if not _holds_its_name(self.m, session):
                return
            session.pinged[n] = self.m.clock()
            if len(session.pinged) > PINGS_KEPT:
                session.pinged.pop(min(session.pinged))
            with contextlib.suppress(ConnectionError):
                await session.ws.send_bytes(orjson.dumps({"t": "ping", "n": n}))
            await asyncio.sleep(REPORT_EVERY_S)

    def _heard(self, session: HostSession, msg: dict[str, Any]) -> None:
        now = asyncio.get_running_loop().time()
        kind = msg.get("t")
        if kind == "report":
            for doc in msg.get("instances", []):
                self.m.apply(session, InstanceReport.from_json(doc), now)
        elif kind == "pong":
            sent = session.pinged.get(int(msg.get("n", -1)))
            if sent is not None:
                session.rtts.append(self.m.clock() - sent)
        elif kind == "done":
            fut = session.pending.get(int(msg.get("id", -1)))
            if fut is not None and not fut.done():
                fut.set_result(msg)


def _admitted(
    m: Machines, refusals: SparseLog, transport: asyncio.BaseTransport | None
) -> tuple[str, str] | web.Response:
    """The host a session comes from and its certificate's fingerprint; or the refusal: no
    host's certificate (401), or one that does not hold its name (403: revoked, or the name
    enrolled again elsewhere), decided before it can replace the name's holder's session."""
    peer = transport.get_extra_info("peercert") if transport is not None else None
    host = pki.peer_host(peer)
    if host is None or transport is None:
        refusals.warning("a session without a host's certificate was refused")
        return _refuse(401, "unauthorized", "a session needs the host's certificate")
    tls = transport.get_extra_info("ssl_object")
    cert = der_fingerprint((tls.getpeercert(binary_form=True) if tls is not None else None) or b"")
    why = m.invites.roster.refusal(host, cert)
    if why is not None:
        refusals.warning("a session of host %s was refused: %s", host, why)
        return _refuse(403, "host_refused", f"host {host}: {why}")
    return host, cert


def _holds_its_name(m: Machines, session: HostSession) -> bool:
    """Whether the session's certificate still holds its host's name; if not (revoked, or the
    name enrolled again elsewhere), the session is closed."""
    why = m.invites.roster.refusal(session.name, session.cert)
    if why is None:
        return True
    logger.warning("host %s: session closed: %s", session.name, why)
    m.lost(session, why)
    return False


def ingress_origin(value: object) -> str | None:
    """A host's ingress as it announced it: ``http://<IP>:<port>`` and nothing more."""
    if not isinstance(value, str):
        return None
    try:
        url = URL(value)
        ip = ipaddress.ip_address(url.host or "")
    except ValueError:
        return None
    if url.scheme != "http" or url.explicit_port is None or url.path not in ("", "/"):
        return None
    if url.query_string or url.fragment or url.user or ip.is_unspecified:
        return None
    return str(url.origin())


def on_host(ingress: str, peer: str | None) -> bool:
    """Whether the announced ``ingress`` is on ``peer``, the address the host's session comes
    from: a host cannot point the server's forwards (with their gate keys) at another machine,
    nor at the server's own loopback unless it runs there itself."""
    try:
        ip = ipaddress.ip_address(URL(ingress).host or "")
        src = ipaddress.ip_address((peer or "").split("%")[0])
    except ValueError:
        return False
    if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped is not None:
        src = src.ipv4_mapped  # a dual-stack listener sees IPv4 hosts so
    return ip == src


def _refuse(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"code": code, "message": message}, status=status)
