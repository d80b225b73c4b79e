"""What the fake API server does to a Pod body before storing it, and the Status bodies it
answers with: schema validation (kubernetes_validate, strict), the checks and defaults of the
real server that matter to a client, QoS class, resource quantities, merge patches.

Departures: an unknown field or a wrongly typed one is refused 422 Invalid (the real server
drops unknown fields with a ``Warning`` header by default, and answers 400 BadRequest "strict
decoding error" under ``fieldValidation=Strict`` or for a type error); only the checks named
here are made; quantities are stored as given, as strings (the real server canonicalizes them:
"1024Mi" becomes "1Gi"); no service account token volume is added; JSON patch knows add,
remove, replace and test.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
import uuid
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import kubernetes_validate

from tests.kube.selectors import label_key_error, label_value_error

__all__ = ["ApiError", "merge_patch", "now", "parse_quantity", "prepare_pod", "qos_class"]

Obj = dict[str, Any]

REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
    422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
    504: "Timeout",
}  # fmt: skip
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of the real server's generateName
_PROBE_DEFAULTS = {
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}
_DEFAULT_TOLERATIONS = [
    {
        "key": f"node.kubernetes.io/{k}",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    }
    for k in ("not-ready", "unreachable")
]  # added by the DefaultTolerationSeconds admission plugin


def now() -> str:
    """The time as the API server writes it: RFC 3339, seconds, UTC, ``Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def status_body(
    code: int, message: str, reason: str | None = None, details: Obj | None = None
) -> Obj:
    body: Obj = {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason or REASONS.get(code, "Unknown"), "code": code,
    }  # fmt: skip
    if details is not None:
        body["details"] = details
    return body


class ApiError(Exception):
    """An answer other than success, carried out of the store as the server would send it."""

    def __init__(
        self, code: int, message: str, reason: str | None = None, details: Obj | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.body = status_body(code, message, reason, details)

    @classmethod
    def not_found(cls, name: str, kind: str = "pods") -> ApiError:
        return cls(404, f'{kind} "{name}" not found', details={"name": name, "kind": kind})

    @classmethod
    def conflict(cls, name: str) -> ApiError:
        msg = (f'Operation cannot be fulfilled on pods "{name}": the object has been modified; '
               "please apply your changes to the latest version and try again")  # fmt: skip
        return cls(409, msg, "Conflict", {"name": name, "kind": "pods"})

    @classmethod
    def invalid(cls, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
        """``causes``: (field, reason, message) as the real validation reports them."""
        text = ", ".join(f"{f}: {m}" if f else m for f, _, m in causes)
        body = [{"reason": r, "message": m, "field": f} for f, r, m in causes]
        details = {"name": name, "kind": "pods", "causes": body}
        return cls(422, f'Pod "{name}" is invalid: {text}', "Invalid", details)


_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip


def parse_quantity(value: str | int | float) -> Fraction:
    """A resource quantity ("500m", "64Gi", "1e3", 2) as an exact number."""
    m = re.fullmatch(r"([+-]?[0-9.]+)(m|[kMGTPE]i?|Ki|e[+-]?\d+|E[+-]?\d+)?", str(value).strip())
    if m is None:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    number, suffix = Fraction(m.group(1)), m.group(2) or ""
    if suffix == "m":
        return number / 1000
    if suffix[:1] in "eE" and suffix[1:]:
        return number * Fraction(10) ** int(suffix[1:])
    return number * _SUFFIXES[suffix]


def _causes_from_schema(pod: Obj) -> list[tuple[str, str, str]]:
    try:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
    except kubernetes_validate.ValidationError as e:
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)[1:]
        unknown = re.match(
            r"Additional properties are not allowed \((.*) (was|were) unexpected\)", e.message
        )
        if unknown:
            names = re.findall(r"'([^']*)'", unknown.group(1))
            return [
                (
                    f"{field}.{n}" if field else n,
                    "FieldValueInvalid",
                    "field not declared in schema",
                )
                for n in names
            ]
        return [(field, "FieldValueInvalid", f"Invalid value: {e.message}")]
    return []


def prepare_pod(body: Any, namespace: str) -> Obj:
    """The Pod to store from a create's body: checked (raises ApiError) and defaulted, without
    the server-set identity (uid, resourceVersion, timestamps) which the store adds."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body of the request was in an unknown format")
    pod = copy.deepcopy(body)
    if pod.setdefault("apiVersion", "v1") != "v1" or pod.setdefault("kind", "Pod") != "Pod":
        raise ApiError(
            400,
            f"the API version in the data ({pod['apiVersion']}) does not match the expected API version (v1)",
        )
    meta = pod.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise ApiError(400, "the body of the request was in an unknown format")
    if meta.get("namespace") not in (None, "", namespace):
        raise ApiError(
            400,
            "the namespace of the provided object does not match the namespace sent on the request",
        )
    name = str(meta.get("name") or meta.get("generateName") or "")
    pod.pop("status", None)  # a client's status is dropped on create
    if causes := _causes_from_schema(pod):
        raise ApiError.invalid(name, causes)
    causes = _check(pod)
    if causes:
        raise ApiError.invalid(name, causes)
    if not meta.get("name"):
        meta["name"] = meta["generateName"] + "".join(random.choice(_SUFFIX) for _ in range(5))
    meta["namespace"] = namespace
    _default(pod["spec"])
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(pod["spec"])}
    return pod


def _check(pod: Obj) -> list[tuple[str, str, str]]:
    meta, spec, causes = pod["metadata"], pod.get("spec") or {}, []
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        causes.append(
            (
                "metadata.name",
                "FieldValueRequired",
                "Required value: name or generateName is required",
            )
        )
    elif name and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
        causes.append(
            (
                "metadata.name",
                "FieldValueInvalid",
                f"Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        if (err := label_key_error(key) or label_value_error(str(value))) is not None:
            causes.append(
                ("metadata.labels", "FieldValueInvalid", f'Invalid value: "{key}={value}": {err}')
            )
    containers = spec.get("containers") or []
    if not containers:
        causes.append(("spec.containers", "FieldValueRequired", "Required value"))
    seen: set[str] = set()
    for i, c in enumerate(containers):
        where = f"spec.containers[{i}]"
        if not c.get("name"):
            causes.append((f"{where}.name", "FieldValueRequired", "Required value"))
        elif not _DNS_LABEL.match(c["name"]) or len(c["name"]) > 63:
            causes.append(
                (
                    f"{where}.name",
                    "FieldValueInvalid",
                    f'Invalid value: "{c["name"]}": a lowercase RFC 1123 label',
                )
            )
        elif c["name"] in seen:
            causes.append(
                (f"{where}.name", "FieldValueDuplicate", f'Duplicate value: "{c["name"]}"')
            )
        seen.add(c.get("name") or "")
        if not c.get("image"):
            causes.append((f"{where}.image", "FieldValueRequired", "Required value"))
        for q in ("requests", "limits"):
            for res, val in ((c.get("resources") or {}).get(q) or {}).items():
                try:
                    parse_quantity(val)
                except ValueError as e:
                    causes.append(
                        (
                            f"{where}.resources.{q}[{res}]",
                            "FieldValueInvalid",
                            f"Invalid value: {e}",
                        )
                    )
    return causes


def _default(spec: Obj) -> None:
    for key, value in (("restartPolicy", "Always"), ("terminationGracePeriodSeconds", 30),
                       ("dnsPolicy", "ClusterFirst"), ("schedulerName", "default-scheduler"),
                       ("securityContext", {}), ("serviceAccountName", "default"),
                       ("serviceAccount", "default"), ("enableServiceLinks", True), ("priority", 0),
                       ("preemptionPolicy", "PreemptLowerPriority")):  # fmt: skip
        spec.setdefault(key, value)
    tolerations = spec.setdefault("tolerations", [])
    tolerations.extend(
        t for t in _DEFAULT_TOLERATIONS if not any(x.get("key") == t["key"] for x in tolerations)
    )
    for c in spec["containers"]:
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        image = c["image"].rsplit("/", 1)[-1]
        latest = "@" not in image and (":" not in image or image.endswith(":latest"))
        c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        res = c.setdefault("resources", {})
        for q in ("limits", "requests"):  # quantities are strings once stored ("1", not 1)
            if res.get(q):
                res[q] = {k: str(v) for k, v in res[q].items()}
        for key, value in (res.get("limits") or {}).items():  # requests default to limits
            res.setdefault("requests", {}).setdefault(key, value)
        for port in c.get("ports") or []:
            port.setdefault("protocol", "TCP")
        for env in c.get("env") or []:
            if "fieldRef" in (env.get("valueFrom") or {}):
                env["valueFrom"]["fieldRef"].setdefault("apiVersion", "v1")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if isinstance(p := c.get(probe), dict):
                for key, value in _PROBE_DEFAULTS.items():
                    p.setdefault(key, value)
                if "httpGet" in p:
                    p["httpGet"].setdefault("scheme", "HTTP")
                    p["httpGet"].setdefault("path", "/")


def qos_class(spec: Obj) -> str:
    """BestEffort, Burstable or Guaranteed, from cpu and memory as the real server decides."""
    requests: dict[str, Fraction] = {}
    limits: dict[str, Fraction] = {}
    guaranteed = True
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        for into, got in ((requests, res.get("requests") or {}), (limits, res.get("limits") or {})):
            for key in ("cpu", "memory"):
                if key in got and parse_quantity(got[key]) != 0:
                    into[key] = into.get(key, Fraction(0)) + parse_quantity(got[key])
        lim = res.get("limits") or {}
        if not all(k in lim for k in ("cpu", "memory")):
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and requests == limits:
        return "Guaranteed"
    return "Burstable"


def new_identity(meta: Obj) -> None:
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now()
    meta["generation"] = 1


def image_id(image: str) -> str:
    return f"{image.split('@')[0]}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"


MERGE_KEYS = {"conditions": "type", "containerStatuses": "name", "containers": "name", "env": "name",
              "initContainerStatuses": "name", "podIPs": "ip", "hostIPs": "ip", "tolerations": "key"}  # fmt: skip


def merge_patch(target: Any, patch: Any, *, strategic: bool = False, field: str = "") -> Any:
    """RFC 7386 merge patch; with ``strategic``, lists of objects with a known merge key (a
    status's conditions by type, its containerStatuses by name...) merge item by item, as a
    strategic merge patch does. Directives such as ``$patch`` are not supported."""
    if strategic and field in MERGE_KEYS and isinstance(patch, list) and isinstance(target, list):
        key, out = MERGE_KEYS[field], copy.deepcopy(target)
        for item in patch:
            at = next(
                (
                    i
                    for i, t in enumerate(out)
                    if isinstance(item, dict)
                    and isinstance(t, dict)
                    and t.get(key) == item.get(key)
                ),
                None,
            )
            if at is None:
                out.append(item)
            else:
                out[at] = merge_patch(out[at], item, strategic=True)
        return out
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged: Obj = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value, strategic=strategic, field=key)
    return merged


def json_patch(target: Obj, ops: Any) -> Obj:
    """RFC 6902 (add, remove, replace, test) on a copy; a failing op is a 422."""
    doc: Any = copy.deepcopy(target)
    if not isinstance(ops, list):
        raise ApiError(400, "the body of the request was in an unknown format")
    for op in ops:
        parts = [
            p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]
        ]
        try:
            parent = doc
            for p in parts[:-1]:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            last: Any = parts[-1]
            if isinstance(parent, list):
                last = len(parent) if last == "-" else int(last)
            kind = op.get("op")
            if kind not in ("add", "remove", "replace", "test"):
                raise ApiError(
                    422, f"the fake API server does not support the JSON patch op {kind!r}"
                )
            if kind == "test" and parent[last] != op.get("value"):
                raise ApiError(
                    422,
                    f"the server rejected our request due to an error in our request: test failed at {op['path']}",
                )
            if kind in ("remove", "replace"):
                _ = parent[last]  # must exist
            if kind == "remove" or (kind == "replace" and isinstance(parent, list)):
                del parent[last]
            if kind in ("add", "replace"):
                if isinstance(parent, list):
                    parent.insert(last, op["value"])
                else:
                    parent[last] = op["value"]
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(
                422, f"the server rejected our request due to an error in our request: {op}: {e}"
            ) from e
    if not isinstance(doc, dict):
        raise ApiError(422, "the patch did not leave an object")
    return doc
