"""The body limits of the listeners beside the public one, reached over real sockets: the
control port reads at most 64 KiB of an enrollment (``client_max_size`` in
``_machines/control.py``): one byte more is refused with 413 before it is parsed."""

from __future__ import annotations

import anyio
import pytest

from capyctl_gateway._cli_machines import control_runner
from capyctl_gateway._gateway import Gateway
from capyctl_gateway._machines.enroll import ServerIdentity
from tests.gateway.http.test_listener_bounds import (
    _clean_up,
    connect,
    control_context,
    serve,
    server,
)

__all__ = ["_clean_up", "server"]

pytestmark = pytest.mark.anyio
CONTROL_MAX_BODY_BYTES = 64 * 1024


@pytest.mark.parametrize(
    ("size", "status"), [(CONTROL_MAX_BODY_BYTES, b" 400 "), (CONTROL_MAX_BODY_BYTES + 1, b" 413 ")]
)
async def test_an_enrollment_over_64_kib_is_refused_with_413(
    server: tuple[Gateway, ServerIdentity], size: int, status: bytes
) -> None:
    """64 KiB is read (and refused as an enrollment without its fields); a byte more is not."""
    gw, identity = server
    port = await serve(control_runner(gw), control_context(identity))
    reader, writer = await connect(port, identity)
    writer.write(
        b"POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {size}\r\n\r\n".encode()
        + b"{"
        + b" " * (size - 2)
        + b"}"
    )
    with anyio.fail_after(5):
        line = await reader.readline()
    assert line.startswith(b"HTTP/1.1" + status), line
