"""The leak plugin (``tests/leaks.py``) itself: a socket a test leaves open fails that test's
module, and the error says who opened it (the test's own line), not only a descriptor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LEAKY = """
import asyncio
import socket

import pytest

pytestmark = pytest.mark.anyio
LISTENER = socket.create_server(("127.0.0.1", 0))
KEPT = []


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_leaves_a_connection_open():
    loop = asyncio.get_running_loop()
    port = LISTENER.getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    KEPT.append(transport)  # never closed


def test_drops_it():
    KEPT.clear()  # its loop has closed: the transport is garbage, still open


def test_in_the_same_module_after():
    pass
"""


def test_a_leaked_transport_fails_its_module_and_names_the_line_that_made_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    root = Path(__file__).resolve().parents[1]
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-o",
            "addopts=",
            "-W",
            "error",
            "-p",
            "anyio",
            "-p",
            "tests.leaks",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_leaky.py"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    out = ran.stdout + ran.stderr
    assert ran.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert "unclosed transport" in out and "Protocol, ('127.0.0.1'" in out, out
    made = 1 + LEAKY.splitlines().index(
        next(ln for ln in LEAKY.splitlines() if "create_connection" in ln)
    )
    assert f"test_leaky.py:{made} in test_leaves_a_connection_open" in out, out
