"""The manifests that run the gateway in a cluster (``deploy/kubernetes/``): each object is
valid against Kubernetes' own schemas (``kubernetes-validate``, strict), the Role grants only
what the pod runner calls, and the configuration the ConfigMap carries loads as the gateway
would load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from capyctl_gateway._config import load_config
from capyctl_gateway._identity import CredentialsError, read_api_key

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
K8S_VERSION = "1.37.0"


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return found


def one(kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects() if o["kind"] == kind]
    return found


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_kubernetes(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    if obj["kind"] != "Namespace":
        assert obj["metadata"]["namespace"] == "capyctl"


def test_the_role_grants_what_the_pod_runner_calls_and_nothing_else() -> None:
    rules = {
        (tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"])
        for r in one("Role")["rules"]
    }
    assert rules == {
        (("",), ("pods",)): {"create", "get", "list", "watch", "delete"},
        (("",), ("pods/log",)): {"get"},
        (("",), ("events",)): {"list"},
    }
    binding = one("RoleBinding")
    assert binding["roleRef"]["name"] == one("Role")["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject["name"] == one("ServiceAccount")["metadata"]["name"]
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == subject["name"]


def test_the_configmaps_configuration_loads_and_runs_its_engine_as_a_pod(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(one("ConfigMap")["data"]["gateway.yaml"])
    loaded = load_config(config)
    assert loaded.kubernetes.namespace == "capyctl"
    assert all(i.pod is not None for d in loaded.deployments for i in d.instances)


def test_the_placeholder_key_is_refused(tmp_path: Path) -> None:
    identity = tmp_path / "identity"
    identity.mkdir(mode=0o700)
    key = identity / "credentials"
    key.write_text(one("Secret")["stringData"]["credentials"])
    key.chmod(0o600)
    with pytest.raises(CredentialsError, match="too short"):
        read_api_key(tmp_path)
