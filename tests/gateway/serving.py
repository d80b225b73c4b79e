"""``capyctl-gateway serve`` as a process of its own, for the tests that kill or signal it: its
command line on loopback ports and the environment it runs in (this checkout's code, none of
the caller's ``CAPYCTL_`` variables)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["listening", "serve_command"]

ROOT = Path(__file__).resolve().parents[2]


def serve_command(
    config: Path, state: Path, listen: int, management: int
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a gateway serving ``config`` with ``state`` as its state
    directory, on 127.0.0.1 ``listen`` and ``management``, logging JSON lines."""
    argv = [
        str(Path(sys.executable).with_name("capyctl-gateway")), "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{listen}", "--management", f"127.0.0.1:{management}",
        "--state-dir", str(state), "--log-format", "json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env["PYTHONPATH"] = str(ROOT)
    return argv, env


def listening(gateway: subprocess.Popen[bytes], state: Path) -> str:
    """Read the gateway's stderr up to its listening line (it is up, its signals handled) and
    return its API key."""
    assert gateway.stderr is not None
    for line in gateway.stderr:
        if b"listening on" in line:
            break
    return (state / "identity" / "credentials").read_text().split()[1]
