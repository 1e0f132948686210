"""Opt-in: the built image under a real Docker engine, driven through its
socket by the project's CSI conformance suite (`python -m sanity`).

pytest-docker starts tests/deploy/docker-compose.yml (docker compose up
--build): the plugin runs privileged and creates a loop-backed volume group
(--backing-file). The suite runs on the host against the socket in a shared
directory.

Kept for machines with a Docker engine (a developer's laptop, a CI runner
with Docker): it is the only test of the image under Docker itself. It does
not run in this project's CI, whose machines have no Docker engine (the
image is built and run there with podman, tests/deploy/test_image.py); each
of its tests is reported as skipped with the reason `docker info` gave.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy._deploy import REPO

pytestmark = pytest.mark.docker


def _docker_problem() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker client installed"
    r = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`docker info` failed, no Docker engine: {why}"
    r = subprocess.run([docker, "compose", "version"], capture_output=True, text=True,
                       timeout=60, check=False)
    if r.returncode != 0:
        return "`docker compose` (v2) is not available"
    return None


@pytest.fixture(scope="session", autouse=True)
def docker_engine() -> None:
    problem = _docker_problem()
    if problem:
        pytest.skip(problem)

COMPOSE = Path(__file__).with_name("docker-compose.yml")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO),
                                                    env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="session")
def sanity_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="csi-local-sanity-", dir="/var/tmp"))
    vg = f"csisanity{uuid.uuid4().hex[:8]}"
    os.environ["CSI_SANITY_DIR"] = str(d)
    os.environ["CSI_SANITY_VG"] = vg
    for sub in ("staging", "mount"):
        (d / sub).mkdir()
    try:
        yield d
    finally:
        # after `docker compose down`: remove the demo VG and its loop device
        script = (f"vgremove -f {vg} >/dev/null 2>&1; "
                  f"for l in $(losetup -j {d}/backing.img -O NAME -n); do losetup -d $l; done")
        subprocess.run(["docker", "run", "--rm", "--privileged", "--entrypoint", "sh",
                        "-v", "/dev:/dev", "-v", "/run/lock/lvm:/run/lock/lvm",
                        "-v", f"{d}:{d}", "csi-local:sanity", "-c", script],
                       capture_output=True, timeout=300, check=False)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def docker_compose_file(sanity_dir: Path) -> str:
    return str(COMPOSE)


@pytest.fixture(scope="session")
def docker_compose_project_name() -> str:
    return f"csilocalsanity{os.getpid()}"


@pytest.fixture(scope="session")
def docker_setup() -> list[str]:
    return ["up --build -d"]


@pytest.fixture(scope="session")
def docker_cleanup() -> list[str]:
    return ["down -v"]


def _probe(endpoint: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "csi_local", "probe", "--endpoint", endpoint],
                       capture_output=True, text=True, timeout=30, env=_env(), check=False)
    return r.returncode == 0 and '"ready": true' in r.stdout


@pytest.fixture(scope="module")
def endpoint(docker_services, sanity_dir: Path) -> str:  # type: ignore[no-untyped-def]
    ep = f"unix://{sanity_dir}/csi.sock"
    docker_services.wait_until_responsive(check=lambda: _probe(ep), timeout=180.0, pause=1.0)
    return ep


def test_sanity_suite_through_the_socket(endpoint: str, sanity_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sanity", "--endpoint", endpoint,
         "--staging-dir", str(sanity_dir / "staging"), "--mount-dir", str(sanity_dir / "mount"),
         "--volume-size", "64M"],
        capture_output=True, text=True, timeout=3600, env=_env(), check=False)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
