"""The Pod the gateway creates for an instance: one bare Pod (the gateway is its controller),
``restartPolicy: Never`` (restarts and their backoff are the lifecycle's), probes on the
engine's ``/health``, and labels that let a restarted gateway find it again.

Labels (values Kubernetes accepts whatever the deployment's name):

- ``capyctl.dev/owner``: ``kubernetes.owner``, the gateway's pods (the watch's selector);
- ``capyctl.dev/deployment``: a hash of the deployment's name (the name itself is in the
  ``capyctl.dev/deployment-name`` annotation);
- ``capyctl.dev/instance``: the instance's index;
- ``capyctl.dev/spec``: a hash of everything the pod runs (a pod whose hash is not the
  configuration's is not adopted: it is deleted and started again).
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from typing import Any

import orjson

from .._config import Deployment, Kubernetes, Launch, Pod
from .._engines import facts

__all__ = [
    "CONTAINER",
    "DEPLOYMENT",
    "HEALTH_PATH",
    "INSTANCE",
    "OWNER",
    "SPEC",
    "deployment_label",
    "manifest",
    "pod_argv",
    "selector",
]

OWNER = "capyctl.dev/owner"
DEPLOYMENT = "capyctl.dev/deployment"
INSTANCE = "capyctl.dev/instance"
SPEC = "capyctl.dev/spec"
NAME = "capyctl.dev/deployment-name"
CONTAINER = "engine"
HEALTH_PATH = "/health"
PROBE_PERIOD_S = 5
"""How often the kubelet asks the engine's health (readiness, and startup while it loads)."""
_SLUG = re.compile(r"[^a-z0-9]+")


def selector(kube: Kubernetes) -> str:
    """The label selector of every pod this gateway runs."""
    return f"{OWNER}={kube.owner}"


def deployment_label(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:20]


def pod_argv(d: Deployment, launch: Launch, port: int) -> list[str]:
    """The engine's command line in its pod: the operator's, listening on every address of the
    pod's own network, with the flags the gateway forces (and what parking needs)."""
    f = facts(d.engine)
    argv = [*launch.command, "--host", "0.0.0.0", "--port", str(port)]  # noqa: S104 (its pod's)
    wanted = [*f.forced_flags, *(f.sleep_flags if d.parks and not d.router else ())]
    return argv + [flag for flag in wanted if flag not in launch.command]


def _env(d: Deployment, launch: Launch, pod: Pod) -> list[dict[str, Any]]:
    f = facts(d.engine)
    plain = {**launch.env, **(dict(f.sleep_env) if d.parks and not d.router else {})}
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(plain.items())]
    for var, ref in sorted(pod.secret_env.items()):
        secret, _, key = ref.partition("/")
        out.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return out


def _probe(failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": "http"},
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _spec(d: Deployment, launch: Launch, pod: Pod) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": pod.image,
        "command": pod_argv(d, launch, pod.port),
        "env": _env(d, launch, pod),
        "ports": [{"name": "http", "containerPort": pod.port, "protocol": "TCP"}],
        "readinessProbe": _probe(3),
        # the model's load: as long as launch.startup_timeout, then the kubelet gives up too
        "startupProbe": _probe(max(1, math.ceil(launch.startup_timeout / PROBE_PERIOD_S))),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    res = {k: v for k, v in pod.resources.model_dump().items() if v}
    if res:
        container["resources"] = res
    if pod.volume_mounts:
        container["volumeMounts"] = pod.volume_mounts
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": pod.grace_period,
        "automountServiceAccountToken": False,  # the engine has no business with the API
        "enableServiceLinks": False,
        "containers": [container],
    }
    if pod.service_account is not None:
        spec["serviceAccountName"] = pod.service_account
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [t.manifest() for t in pod.tolerations]
    if pod.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pod.image_pull_secrets]
    if pod.volumes:
        spec["volumes"] = pod.volumes
    return spec


def manifest(
    kube: Kubernetes, d: Deployment, index: int, launch: Launch, pod: Pod
) -> tuple[dict[str, Any], str]:
    """The instance's Pod (without its name, which each start chooses: `named`), and the hash
    of its spec."""
    spec = _spec(d, launch, pod)
    digest = hashlib.sha256(orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)).hexdigest()[:20]
    labels = {
        OWNER: kube.owner,
        DEPLOYMENT: deployment_label(d.name),
        INSTANCE: str(index),
        SPEC: digest,
        "app.kubernetes.io/managed-by": "capyctl-gateway",
    }
    meta = {"namespace": pod.namespace or kube.namespace, "labels": labels}
    meta["annotations"] = {NAME: d.name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}, digest


def named(body: dict[str, Any], d: Deployment, index: int) -> dict[str, Any]:
    """``body`` with a new name: the deployment's name as far as a pod's name may carry it,
    its instance and a random part (a name is never reused, so a retried create cannot take
    another start's pod)."""
    slug = _SLUG.sub("-", d.name.lower()).strip("-")[:40].rstrip("-") or "engine"
    name = f"capyctl-{slug}-{index}-{secrets.token_hex(3)}"
    return {**body, "metadata": {**body["metadata"], "name": name}}
