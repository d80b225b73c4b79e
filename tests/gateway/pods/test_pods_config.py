"""A pod instance's configuration and the Pod the gateway makes of it: every manifest is
checked against Kubernetes' own Pod schema (``kubernetes-validate``, strict: an unknown field
fails), and what must never be in it (a secret) is refused when the configuration loads."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import anyio
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from capyctl_gateway._config import KUBERNETES_POOL, GatewayConfig, Kubernetes, load_config
from capyctl_gateway._errors import OperatorError
from capyctl_gateway._pods import kube as kube_module
from capyctl_gateway._pods.kube import KubeError, connect
from capyctl_gateway._pods.manifest import (
    DEPLOYMENT,
    INSTANCE,
    OWNER,
    SPEC,
    deployment_label,
    manifest,
    named,
)
from capyctl_gateway._pods.podstate import pending
from capyctl_gateway._pods.watch import PodWatch
from capyctl_gateway._runners import kind_of

K8S_VERSION = "1.37.0"


def pod_dep(name: str = "Qwen/Qwen3-4B", **pod: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "llamacpp",
        "engine_version": "b10798",
        "instances": [
            {
                "launch": {"command": ["llama-server", "-m", "/models/q.gguf"]},
                "pod": {"image": "ghcr.io/ggml-org/llama.cpp:server", **pod},
            }
        ],
    }


def config(*deps: dict[str, Any], **top: Any) -> GatewayConfig:
    return GatewayConfig.model_validate({"deployments": list(deps), **top})


def made(c: GatewayConfig, index: int = 0) -> dict[str, Any]:
    d = c.deployments[0]
    inst = d.instances[index]
    assert inst.launch is not None and inst.pod is not None
    body, _ = manifest(c.kubernetes, d, index, inst.launch, inst.pod)
    return named(body, d, index)


def test_a_full_pod_template_makes_a_pod_kubernetes_accepts() -> None:
    c = config(
        pod_dep(
            resources={"limits": {"nvidia.com/gpu": 1, "memory": "24Gi"}, "requests": {"cpu": "4"}},
            node_selector={"gpu": "h100"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            namespace="serving",
            service_account="engines",
            image_pull_secrets=["registry"],
            volumes=[{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
            volume_mounts=[{"name": "models", "mountPath": "/models", "readOnly": True}],
            secret_env={"LLAMA_API_KEY": "engine-key/key"},
            grace_period=20,
        ),
        kubernetes={"namespace": "default", "owner": "gw-a"},
    )
    pod = made(c)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["namespace"] == "serving"
    assert meta["labels"][OWNER] == "gw-a"
    assert meta["labels"][DEPLOYMENT] == deployment_label("Qwen/Qwen3-4B")
    assert meta["labels"][INSTANCE] == "0"
    assert meta["annotations"]["capyctl.dev/deployment-name"] == "Qwen/Qwen3-4B"
    assert meta["name"].startswith("capyctl-qwen-qwen3-4b-0-")
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 20
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    argv = container["command"]
    assert argv[:3] == ["llama-server", "-m", "/models/q.gguf"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"  # noqa: S104 (the pod's own network)
    assert argv[argv.index("--port") + 1] == "8080"
    assert "--metrics" in argv  # a flag the gateway forces on llama.cpp
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "24Gi"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["env"] == [
        {
            "name": "LLAMA_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "engine-key", "key": "key"}},
        }
    ]


def test_every_name_a_deployment_may_have_makes_a_valid_pod_and_labels() -> None:
    for name in ("Qwen/Qwen3-4B", "..hidden", "a" * 256, "модель", "x y:z@1", "-"):
        pod = made(config(pod_dep(name)))
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert len(pod["metadata"]["name"]) <= 63


def test_the_spec_hash_follows_what_the_pod_runs_and_nothing_else() -> None:
    def spec_hash(c: GatewayConfig) -> str:
        return str(made(c)["metadata"]["labels"][SPEC])

    base = spec_hash(config(pod_dep()))
    assert spec_hash(config(pod_dep())) == base  # the random name is not in it
    assert spec_hash(config(pod_dep(image="other:1"))) != base
    assert spec_hash(config(pod_dep(), kubernetes={"owner": "b"})) == base


def test_pods_count_in_their_own_pool_and_park_auto_stops_them() -> None:
    d = pod_dep()
    d["lifecycle"] = {"park": "auto"}
    c = config(d)
    assert c.deployments[0].instances[0].pool == KUBERNETES_POOL
    assert kind_of(c.deployments[0].instances[0]) == "pod"
    assert c.deployments[0].parks is False
    router = pod_dep()
    router["instances"][0]["launch"]["command"] = ["llama-server", "--models-dir", "/m"]
    assert config(router).deployments[0].parks is False  # a router parks on one machine
    router["lifecycle"] = {"park": "sleep"}
    assert config(router).deployments[0].parks is True  # asked for: kept


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda i: i["launch"]["command"].extend(["--api-key", "sk-live-123"]), "pod.secret_env"),
        (lambda i: i["launch"].update(env={"HF_TOKEN": "hf_abc"}), "pod.secret_env"),
        # issue 42, item 12: a URL's userinfo lands in the Pod spec as any other argument
        (lambda i: i["launch"]["command"].append("https://hf_abc@hf.co/m"), "pod.secret_env"),
        (lambda i: i["launch"].update(env={"MODEL_URL": "https://u:hf_abc@h/m"}), "pod.secret_env"),
        (lambda i: i.update(host="gpu-1"), "not on a host"),
        (lambda i: i["pod"].update(namespace="Bad_NS"), "not a Kubernetes name"),
        (lambda i: i["pod"].update(resources={"limits": {"memory": "lots"}}), "quantity"),
        (lambda i: i["pod"].update(secret_env={"KEY": "no-key-part"}), "secret-name/key"),
        (lambda i: i["pod"].update(privileged=True), "privileged"),
        (lambda i: i["pod"].update(grace_period=0), "grace_period"),
    ],
)
def test_a_pod_that_could_not_run_or_would_leak_is_refused_at_load(change: Any, said: str) -> None:
    d = pod_dep()
    change(d["instances"][0])
    with pytest.raises(ValidationError) as info:
        config(d)
    assert said in str(info.value)
    assert "sk-live-123" not in str(info.value) and "hf_abc" not in str(info.value)


def test_a_budget_counts_pods_apart_from_this_machine() -> None:
    local = {
        "name": "here",
        "engine": "llamacpp",
        "engine_version": "b10798",
        "memory": {"ready": "10GiB"},
        "lifecycle": {"activation": "always"},
        "instances": [{"launch": {"command": ["llama-server"]}}],
    }
    pod = pod_dep() | {"memory": {"ready": "10GiB"}, "lifecycle": {"activation": "always"}}
    config(local, pod, resources={"memory_budget": "12GiB"})  # 10 here, 10 there: fits
    two = pod_dep("two") | {"memory": {"ready": "10GiB"}, "lifecycle": {"activation": "always"}}
    with pytest.raises(ValidationError, match="on Kubernetes|Kubernetes, more than"):
        config(pod, two, resources={"memory_budget": "12GiB"})


def test_the_guides_example_loads_with_every_pod_key() -> None:
    guide = Path(__file__).resolve().parents[3] / "docs" / "gateway" / "kubernetes.md"
    block = guide.read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    c = GatewayConfig.model_validate(yaml.safe_load(block))
    pod = c.deployments[0].instances[0].pod
    assert pod is not None
    assert set(pod.model_fields_set) == set(type(pod).model_fields)  # every key shown
    assert set(c.kubernetes.model_fields_set) == set(type(c.kubernetes).model_fields)
    kubernetes_validate.validate(made(c), K8S_VERSION, strict=True)


def test_why_a_pod_waits_names_no_address_where_a_client_hears_it() -> None:
    message = 'failed to pull "r.example/img": dial tcp 10.1.2.3:443: i/o timeout'
    waiting = {"state": {"waiting": {"reason": "ErrImagePull", "message": message}}}
    pod = {"status": {"phase": "Pending", "containerStatuses": [waiting]}}
    assert pending(pod) == f"ErrImagePull: {message}"  # status: the operator's view
    assert pending(pod, detail=False) == "ErrImagePull"  # a 503's message and a failed start
    unschedulable = {
        "status": {
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}
            ]
        }
    }  # fmt: skip
    assert pending(unschedulable, detail=False) == (
        "Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    )


@pytest.mark.anyio
async def test_pods_without_a_cluster_to_reach_are_told_plainly(tmp_path: Path) -> None:
    kube = Kubernetes()
    with pytest.raises(OperatorError, match="pods need a Kubernetes cluster"):
        await connect(kube, {"HOME": str(tmp_path)})  # no KUBECONFIG, no ~/.kube/config
    missing = tmp_path / "nowhere"
    with pytest.raises(OperatorError, match=f"the kubeconfig {missing} cannot be read"):
        await connect(kube, {"KUBECONFIG": str(missing)})
    broken = tmp_path / "broken"
    broken.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    with pytest.raises(OperatorError, match="cannot be used"):
        await connect(kube, {"KUBECONFIG": str(broken)})


def test_an_empty_kubernetes_section_means_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"deployments": [pod_dep()]}) + "kubernetes:\n")
    assert load_config(path).kubernetes == Kubernetes()


@pytest.mark.anyio
async def test_a_reply_or_a_watch_event_past_its_bound_fails_and_the_watch_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's bounds reached on the API fake: a list reply over `MAX_REPLY_BYTES` and a
    watch event over `MAX_EVENT_BYTES` are refused (never read whole), and the watch, down
    meanwhile, runs again once nothing that large is left."""
    from tests.kube.apiserver import FakeApiServer
    from tests.kube.conftest import pod

    monkeypatch.setattr(kube_module, "MAX_REPLY_BYTES", 16_384)
    monkeypatch.setattr(kube_module, "MAX_EVENT_BYTES", 8_192)
    async with FakeApiServer() as fake:
        api = await connect(Kubernetes(), {"KUBECONFIG": str(fake.kubeconfig(tmp_path / "k"))})
        try:
            watch = PodWatch(api, "default", "big=yes", 300.0)
            task = asyncio.create_task(watch.run())
            await asyncio.wait_for(watch.listed.wait(), 10)
            body = pod("large", labels={"big": "yes"})
            body["metadata"]["annotations"] = {"padding": "x" * 20_000}
            fake.store.create_pod("default", body)  # (its create reply would be over too)
            with anyio.fail_after(10):
                while watch.broken is None:
                    await watch.changed()
            assert "TooLarge" in watch.broken and "large" not in watch.pods
            with pytest.raises(KubeError, match="TooLarge"):  # a list holding it is over too
                await api.list("default", "big=yes")
            fake.store.delete_pod("default", "large")
            with anyio.fail_after(10):
                while not watch.current:
                    await watch.changed()
            assert "large" not in watch.pods and watch.failures >= 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            await api.close()
