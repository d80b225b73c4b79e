"""The operator's console: one HTML page, its stylesheet and its script, shipped in the package
(``console/``) and served on the management listener (``GET /``), with what the page shows
beyond the status document: why a launched deployment is in its state, which of the
operator's commands would change something now, and each instance's load sample (cache or slot
usage and its age).

The page holds no secret and needs no key; everything it reads or does goes through the
keyed management API. Its answers forbid scripts from anywhere but the page's own origin, and
inline ones (``Content-Security-Policy``), framing, and referrers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .._fleet import Fleet
from .._lifecycle.states import DeploymentLife

__all__ = ["HEADERS", "actions", "add_console_routes", "annotate"]

STATIC = Path(__file__).with_name("console")
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
FILES = {
    "/": ("index.html", "text/html"),
    "/console/console.css": ("console.css", "text/css"),
    "/console/console.js": ("console.js", "text/javascript"),
}


def add_console_routes(app: web.Application) -> None:
    """Serve the page and its two files (read once, here)."""
    for path, (name, kind) in FILES.items():
        app.router.add_get(path, _file((STATIC / name).read_bytes(), kind))


def _file(body: bytes, kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=HEADERS)

    return serve


def annotate(fleet: Fleet, doc: dict[str, Any]) -> dict[str, Any]:
    """Add to a ``status deployment`` document (in place) why its launched deployment is in its
    state (``deployment.why``) and the commands that would change something now
    (``deployment.actions``), and each instance's load sample (``usage``, ``sample_age_s``:
    left out where the engine reported none)."""
    name = doc["deployment"]["name"]
    route = fleet.routes[name]
    life = fleet.lifecycle.lives.get(name)
    if life is not None:
        doc["deployment"]["why"] = why(life)
        doc["deployment"]["actions"] = actions(life)
    for row, inst in zip(doc["instances"], route.instances, strict=True):
        sample = inst.runner.sample()
        if sample is None:
            continue
        if sample.usage is not None:
            row["usage"] = round(sample.usage, 4)
        row["sample_age_s"] = round(sample.age_s, 3)
    return doc


def actions(life: DeploymentLife) -> list[str]:
    """Which of ``start``, ``stop`` and ``park`` would change something now (the console
    offers only those). Start: unless it serves, or a start is under way, and no operator's
    stop or ``activation: explicit`` holds it (then it would lift that). Stop: unless an
    operator's stop holds it already, or nothing runs and no request may start it (a stop of
    one that is merely stopped keeps it so: requests get 409). Park: while an instance is ready
    and nothing closes it (where it cannot sleep, a park stops it, and the next request starts
    it again)."""
    held = life.refusal() is not None
    closing = life.closing is not None
    out = []
    if held or not (life.serves_now or life.activating):
        out.append("start")
    if not life.operator_stopped and not (held and life.state in ("stopped", "failed")):
        out.append("stop")
    if life.ready and not closing and not life.operator_stopped:
        out.append("park")
    return out


def why(life: DeploymentLife) -> str:
    """Why a launched deployment is in its state, in a few words."""
    refusal = life.refusal()
    if refusal is not None:
        return refusal.message
    if life.blocked:
        return "its start waits for memory another deployment holds"
    if life.closing is not None and not life.closing.done():
        return "closing: its requests finish first"
    if life.activating:
        return "starting for the requests that wait for it"
    failed = [lc.failure for lc in life.launched if lc.failure is not None]
    if failed and not life.ready:
        return f"its last start failed: {failed[0]}"
    if life.ready:
        return "serving"
    if life.state == "parked":
        return "parked: the next request wakes it"
    return "stopped: the next request starts it"
