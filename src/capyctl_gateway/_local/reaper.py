"""``python -m capyctl_gateway._local.reaper -- ENGINE ARGV...``: the keeper of one engine.

The gateway starts this small process (with ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM
when the gateway dies, even by SIGKILL); it starts the engine in a process group of its own and
waits. On SIGTERM or SIGINT, whoever sent it, it stops the engine's whole group: SIGTERM, then
SIGKILL after a grace period. It exits with the engine's status.

What the engine leaves behind dies with it, whoever kills which:

- the engine's own children (vLLM's engine core, for one) are in its process group, which is
  stopped whole;
- a descendant that left the group (``setsid``, a daemonising child) is reparented to this
  process when its parent dies (``PR_SET_CHILD_SUBREAPER``), and every such stray is killed
  once the engine has gone;
- the engine is bound to this process's death (``PR_SET_PDEATHSIG`` = SIGKILL): killing the
  reaper kills the engine, and the gateway, seeing the reaper gone, kills the engine's group.

What a reaper killed by SIGKILL cannot collect is a stray that had already left the engine's
group: the gateway cannot reach it either (a cgroup could; none is used).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _engine_dies_with_us() -> None:  # runs in the engine's process, between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _children() -> list[int]:
    """This process's children now (strays it adopted included)."""
    pid = os.getpid()
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
    return found


def _reap_strays(engine: int, *, kill: bool) -> None:
    """Collect adopted strays that exited (and, with ``kill``, kill the rest first), never the
    engine itself (its status is `subprocess.Popen`'s to collect)."""
    for _ in range(100):  # each round kills what the last one left; bounded all the same
        strays = [p for p in _children() if p != engine]
        if not strays:
            return
        for pid in strays:
            if kill:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # its own group, if it made one
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0 if kill else os.WNOHANG)
        if not kill:
            return


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
        sys.stderr.write("usage: python -m capyctl_gateway._local.reaper -- ENGINE ARGV...\n")
        return 2
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the gateway died before we could ask to be told
        return 1
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        engine = subprocess.Popen(argv[1:], start_new_session=True, preexec_fn=_engine_dies_with_us)
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
        _reap_strays(engine.pid, kill=False)
    if stopping:
        _stop_group(engine.pid, engine)
    else:  # the engine exited on its own: take whatever it left in its group with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
    _reap_strays(engine.pid, kill=True)
    code = engine.returncode
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
