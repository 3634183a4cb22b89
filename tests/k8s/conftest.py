"""Fixtures of the deployment tests: every overlay, rendered once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from k8s_manifests import K8S, OVERLAYS, Manifests, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, Manifests]:
    return {overlay: Manifests(overlay, render(K8S / "overlays" / overlay)) for overlay in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def manifests(request: pytest.FixtureRequest, rendered: dict[str, Manifests]) -> Manifests:
    return rendered[request.param]
