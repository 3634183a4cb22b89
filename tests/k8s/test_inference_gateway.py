"""The inference-gateway overlay: an InferencePool of the orchestrators, an HTTPRoute to it, and
the endpoint picker's configuration, consistent with each other and with what an orchestrator
serves. Each check is a function of the rendered manifests, so that careless variants of the
overlay are shown to fail it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import yaml
from k8s_manifests import COMPONENTS, Doc, Manifests

from tandem import metrics

OVERLAY = "inference-gateway"
POOL_GROUP = "inference.networking.k8s.io"
SIGNALS = {"queuedRequestsSpec": metrics.EPP_WAITING, "runningRequestsSpec": metrics.EPP_RUNNING,
           "kvUsageSpec": metrics.EPP_KV_USAGE}


def _pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def problems(m: Manifests) -> list[str]:
    """What would keep the gateway from reaching Tandem through the pool, or the picker from
    reading its load."""
    found: list[str] = []
    for pool in m.of_kind("InferencePool"):
        selector = pool["spec"]["selector"]["matchLabels"]
        for component in COMPONENTS:
            for workload in m.workloads(component):
                selected = selector.items() <= _pod_labels(workload).items()
                if component == "orchestrator" and not selected:
                    found.append(f"pool {pool['metadata']['name']} does not select the orchestrators")
                if component != "orchestrator" and selected:
                    found.append(f"pool {pool['metadata']['name']} selects {component} pods, which "
                                 "speak gRPC to orchestrators, not the OpenAI API")
        container = m.container("orchestrator")
        http = {p["name"]: p["containerPort"] for p in container["ports"]}.get("http")
        env = m.env(container)
        port = pool["spec"]["targetPorts"][0]["number"]
        if port != http or int(env.get("TANDEM_HTTP_PORT", 0)) != port:
            found.append(f"pool targets port {port}, but the orchestrator's HTTP API (which serves "
                         f"/metrics too) listens on {env.get('TANDEM_HTTP_PORT')}")
        if "endpointPickerRef" not in pool["spec"]:
            found.append("the pool names no endpoint picker")
    pools = {p["metadata"]["name"] for p in m.of_kind("InferencePool")}
    for route in m.of_kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            for ref in rule.get("backendRefs", []):
                if ref.get("kind") == "InferencePool" and (ref.get("group") != POOL_GROUP
                                                           or ref["name"] not in pools):
                    found.append(f"route {route['metadata']['name']} sends to a pool that is not here: {ref}")
    config = yaml.safe_load(m.get("ConfigMap", "tandem-epp-config")["data"]["epp-config.yaml"])
    extractor = next(p["parameters"] for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    engine = _pod_labels(m.workload("orchestrator")).get(extractor["engineLabelKey"], extractor["defaultEngine"])
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    if engine not in engines:
        found.append(f"the orchestrators' engine {engine!r} has no engineConfigs entry")
    else:
        for spec, gauge in SIGNALS.items():
            name = gauge.describe()[0].name
            if engines[engine].get(spec) != name:
                found.append(f"the picker reads {spec} from {engines[engine].get(spec)!r}; the "
                             f"orchestrator exports {name!r}")
    return found


@pytest.fixture
def gateway(rendered: dict[str, Manifests]) -> Manifests:
    return Manifests(OVERLAY, copy.deepcopy(rendered[OVERLAY].docs))


def test_the_overlay_routes_to_the_orchestrators_and_reads_their_load(gateway: Manifests) -> None:
    assert problems(gateway) == []
    assert {d["kind"] for d in gateway.docs} >= {"InferencePool", "HTTPRoute", "InferenceObjective"}


def _select_targets(m: Manifests) -> None:
    m.get("InferencePool", "tandem")["spec"]["selector"]["matchLabels"] = {
        "app.kubernetes.io/name": "tandem"}  # every Tandem pod, targets and drafts included


def _wrong_selector(m: Manifests) -> None:
    m.get("InferencePool", "tandem")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "orchestrators"


def _grpc_port(m: Manifests) -> None:
    m.get("InferencePool", "tandem")["spec"]["targetPorts"] = [{"number": 50051}]


def _unlabelled_orchestrators(m: Manifests) -> None:
    del _pod_labels(m.workload("orchestrator"))["inference.networking.k8s.io/engine-type"]
    config = m.get("ConfigMap", "tandem-epp-config")["data"]
    config["epp-config.yaml"] = config["epp-config.yaml"].replace("defaultEngine: tandem", "defaultEngine: vllm")


def _route_to_another_pool(m: Manifests) -> None:
    m.get("HTTPRoute", "tandem")["spec"]["rules"][0]["backendRefs"][0]["name"] = "vllm"


def _renamed_metric(m: Manifests) -> None:
    config = m.get("ConfigMap", "tandem-epp-config")["data"]
    config["epp-config.yaml"] = config["epp-config.yaml"].replace("tandem:kv_cache_usage_perc",
                                                                  "vllm:kv_cache_usage_perc")


@pytest.mark.parametrize("careless", [_select_targets, _wrong_selector, _grpc_port,
                                      _unlabelled_orchestrators, _route_to_another_pool,
                                      _renamed_metric])
def test_a_careless_variant_fails(gateway: Manifests, careless: Callable[[Manifests], None]) -> None:
    careless(gateway)
    assert problems(gateway), f"{careless.__name__} went unnoticed"


def test_only_the_orchestrators_carry_the_engine_label(gateway: Manifests) -> None:
    for component in ("draft", "target"):
        for workload in gateway.workloads(component):
            assert "inference.networking.k8s.io/engine-type" not in _pod_labels(workload)
