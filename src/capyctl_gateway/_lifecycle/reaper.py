"""``python -m capyctl_gateway._lifecycle.reaper -- ENGINE ARGV...``: the keeper of one engine.

The gateway starts this small process (with ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM
when the gateway dies, even by SIGKILL); it starts the engine in a process group of its own and
waits. On SIGTERM or SIGINT, whoever sent it, it stops the engine's whole group: SIGTERM, then
SIGKILL after a grace period. So an engine's own children (vLLM's engine core, for one) never
outlive the gateway, which ``PR_SET_PDEATHSIG`` on the engine alone would not ensure. It exits
with the engine's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_group(pgid: int, engine: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    while engine.poll() is None and time.monotonic() < end:
        time.sleep(0.05)  # nothing to wait on but the child itself
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # the engine, and anything it left behind
    engine.wait()


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.stderr.write("usage: python -m capyctl_gateway._lifecycle.reaper -- ENGINE ARGV...\n")
        return 2
    _die_with_parent()
    if os.getppid() == 1:  # the gateway died before we could ask to be told
        return 1
    try:
        engine = subprocess.Popen(argv[1:], start_new_session=True)
    except OSError as exc:
        sys.stderr.write(f"the engine could not be run: {exc.strerror}\n")
        return 127
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and engine.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.wait(0.2)
    if stopping:
        _stop_group(engine.pid, engine)
    else:  # the engine exited on its own: take whatever it left in its group with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
    code = engine.returncode
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
