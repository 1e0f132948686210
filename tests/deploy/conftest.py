"""Configuration for the deployment tests (tests/deploy).

These run on the host (not in the test VM). Markers registered here:

  image   builds the container image with scripts/build-image (podman, buildah)
  docker  drives the image through a Docker engine with pytest-docker (opt-in)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "image: builds the csi-local container image with podman and runs it with buildah "
        "(host only; fails when CI=true and the tools are missing)",
    )
    config.addinivalue_line(
        "markers",
        "docker: runs the image under a Docker engine via pytest-docker (skipped without one)",
    )


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_as_root(tools: tuple[str, ...], why_root: str, what: str, hint: str = "") -> None:
    """Skip (fail with CI=true) a test that needs these tools and root."""
    missing = [t for t in tools if shutil.which(t) is None]
    problem = f"missing {', '.join(missing)}" if missing else None
    if problem is None and os.geteuid() != 0:
        problem = f"not root ({why_root})"
    if problem:
        msg = f"{what}: {problem}{hint}"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg + "; set CI=true to make this a failure")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
