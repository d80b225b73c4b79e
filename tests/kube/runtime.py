"""What the fake kubelet's container runtime computes: a container's env (fieldRef included),
Kubernetes' ``$(VAR)`` expansion, and one probe's check (httpGet, tcpSocket, exec).

Departures: env ``valueFrom`` knows fieldRef only (a configMap or secret ref fails as a missing
object does: CreateContainerConfigError); probe timeouts are real seconds; grpc probes fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import aiohttp

__all__ = ["ConfigError", "check", "container_env", "expand", "ports"]

Obj = dict[str, Any]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, unknown ones left as written,
    ``$$`` is a literal ``$`` (third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(" and (end := text.find(")", i + 2)) != -1:
                name = text[i + 2 : end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


class ConfigError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def _field(pod: Obj, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
    simple = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""), "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": status.get("podIP", ""), "status.hostIPs": status.get("hostIP", ""),
    }  # fmt: skip
    if path in simple:
        return str(simple[path])
    for key in ("labels", "annotations"):
        if path.startswith(f"metadata.{key}['") and path.endswith("']"):
            return str((meta.get(key) or {}).get(path[len(key) + 11 : -2], ""))
    raise ConfigError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


def container_env(pod: Obj, c: Obj) -> dict[str, str]:
    """The container's env as the kubelet builds it, in order (each value may refer to those
    before it)."""
    env: dict[str, str] = {}
    for var in c.get("env") or []:
        src = var.get("valueFrom")
        if src is None:
            env[var["name"]] = expand(var.get("value") or "", env)
        elif "fieldRef" in src:
            env[var["name"]] = _field(pod, src["fieldRef"]["fieldPath"])
        else:
            kind, ref = next(iter(src.items()))
            if not ref.get("optional"):
                what = {"configMapKeyRef": "configmap", "secretKeyRef": "secret"}.get(kind, kind)
                raise ConfigError(
                    "CreateContainerConfigError", f'{what} "{ref.get("name", "")}" not found'
                )
    return env


async def check(
    http: aiohttp.ClientSession, spec: Obj, ip: str, pod: Obj, c: Obj
) -> tuple[bool, str]:
    try:
        return await _check(http, spec, ip, pod, c)
    except (ValueError, KeyError) as e:
        return False, f"probe not usable: {e}"


async def _check(
    http: aiohttp.ClientSession, spec: Obj, ip: str, pod: Obj, c: Obj
) -> tuple[bool, str]:
    timeout = float(spec["timeoutSeconds"])
    if "httpGet" in spec:
        get = spec["httpGet"]
        url = f"{get['scheme'].lower()}://{get.get('host') or ip}:{_port(c, get['port'])}{get['path']}"
        headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
        try:
            async with http.get(url, headers=headers, allow_redirects=False, ssl=False,
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:  # fmt: skip
                await r.read()
                return 200 <= r.status < 400, f"HTTP probe failed with statuscode: {r.status}"
        except TimeoutError:
            return (
                False,
                f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)',
            )
        except aiohttp.ClientError as e:
            return False, f'Get "{url}": {e}'
    if "tcpSocket" in spec:
        tcp = spec["tcpSocket"]
        host, port = tcp.get("host") or ip, _port(c, tcp["port"])
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a connection that is made
            # as the probe is cancelled, and its writer would be left open for the collector
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as e:
            return False, f"dial tcp {host}:{port}: {e}"
        writer.close()
        await writer.wait_closed()
        return True, ""
    if "exec" in spec:
        env = {**os.environ, **container_env(pod, c)}
        proc = await asyncio.create_subprocess_exec(
            *spec["exec"]["command"],
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False, f"command timed out after {timeout}s"
        return proc.returncode == 0, out.decode(errors="replace")
    return False, "probe kind not supported by the fake kubelet"


def _port(c: Obj, port: int | str) -> int:
    if isinstance(port, int) or port.isdigit():
        return int(port)
    for p in c.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def ports(c: Obj) -> set[int]:
    """The TCP ports a container says it listens on: its ports and its probes'."""
    found = {
        int(p["containerPort"]) for p in c.get("ports") or [] if p.get("protocol", "TCP") == "TCP"
    }
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind) or {}
        for how in ("httpGet", "tcpSocket"):
            if how in probe:
                with contextlib.suppress(ValueError, KeyError):  # a wrong one fails the probe
                    found.add(_port(c, probe[how]["port"]))
    return found
