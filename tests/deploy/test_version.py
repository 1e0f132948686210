"""One version everywhere: src/csi_local/version.py is its one home, and
every place that states the version (the package's metadata, what the
commands and the plugin report, the image's label and tag, the deployment
files, the docs' build and load commands) states that one. Each place is a
test of its own, so a drift names the place that drifted.

CHANGELOG.md is history and may name older versions; it is not read here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from csi_local.version import __version__
from tests.deploy._deploy import (
    BASE_DIR,
    NOMAD_DIR,
    PLUGIN_IMAGE_NAME,
    REPO,
    blocks,
    labelled,
    load_hcl,
    unquote,
)

VERSION_FILE = REPO / "src" / "csi_local" / "version.py"


def _literal() -> str:
    """version.py's literal, read as setuptools reads it (no import)."""
    tree = ast.parse(VERSION_FILE.read_text())
    values = [node.value.value for node in tree.body
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and [getattr(t, "id", None) for t in node.targets] == ["__version__"]]
    assert len(values) == 1 and isinstance(values[0], str), values
    return values[0]


VERSION = _literal()


def test_the_version_is_semantic() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION


def test_pyproject_reads_version_py() -> None:
    """pyproject.toml holds no version of its own: setuptools reads version.py."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in data["project"]
    assert "version" in data["project"]["dynamic"]
    attr = data["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "csi_local.version.__version__"


def test_the_package_and_its_metadata() -> None:
    assert __version__ == VERSION
    assert __import__("csi_local").__version__ == VERSION
    installed = importlib.metadata.version("csi-local")
    assert installed == VERSION, (
        f"the installed metadata says {installed}: install the checkout again "
        "(pip install -e .) after a change of src/csi_local/version.py")


def _run(*argv: str) -> str:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_csi_local_version() -> None:
    assert _run("-m", "csi_local", "--version").strip() == f"csi-local {VERSION}"


def test_dhv_fingerprint() -> None:
    out = _run("-c", "import sys; from csi_local.dhv import main; "
               "sys.exit(main(['csi-local-dhv', 'fingerprint']))")
    assert out.strip() == f'{{"version": "{VERSION}"}}'


def test_get_plugin_info(tmp_path: Path) -> None:
    from typing import cast

    from csi_local._gen import csi_pb2 as pb
    from csi_local.config import Config
    from csi_local.csi.identity_servicer import IdentityServicer
    from csi_local.volumes.pool import Pools

    config = Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="n", volume_group="vg",
                    thin_pool="pool", state_dir=str(tmp_path / "state"),
                    lock_dir=str(tmp_path / "locks"))
    identity = IdentityServicer(config, cast(Pools, None))  # GetPluginInfo asks no pool
    reply = identity.GetPluginInfo(pb.GetPluginInfoRequest(), None)  # type: ignore[arg-type]
    assert reply.vendor_version == VERSION


def test_build_info_metric() -> None:
    import platform

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from csi_local.ops.metrics import Metrics

    text = generate_latest(Metrics(node="n").registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "csi_local_build_info"]
    (sample,) = family.samples
    assert sample.value == 1
    assert sample.labels == {"version": VERSION, "python": platform.python_version(),
                             "node": "n"}


def test_dockerfile_label_default() -> None:
    """The image's version label when built without scripts/build-image
    (which passes the version itself)."""
    text = (REPO / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG VERSION=(\S+)$", text, re.M)
    assert default == VERSION


def test_kubernetes_image_tag() -> None:
    kustomization = yaml.safe_load((BASE_DIR / "kustomization.yaml").read_text())
    (entry,) = [i for i in kustomization["images"] if i["name"] == PLUGIN_IMAGE_NAME]
    assert entry["newTag"] == VERSION


def test_nomad_job_image() -> None:
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    variables = dict(labelled(v) for v in blocks(load_hcl(path), "variable"))
    assert unquote(variables["image"]["default"]) == f"{PLUGIN_IMAGE_NAME}:{VERSION}"


# Where the docs, scripts and deployment files name the plugin's image by its
# tag: `csi-local:<tag>`, or a kustomize images entry whose name (or newName)
# ends in csi-local, followed by its newTag (other images' entries differ).
_TAGGED = re.compile(r"csi-local:(\d[\w.+-]*)"
                     r"|csi-local[ \t]*(?:#[^\n]*)?\n[ \t]*newTag:[ \t]*([\w.+-]+)")


def _stated_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "RELEASING.md",
             REPO / "Dockerfile", *sorted((REPO / "docs").glob("*.md")),
             *sorted(p for p in (REPO / "scripts").iterdir() if p.is_file()),
             *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    return [p for p in files if p.exists()]


@pytest.mark.parametrize("path", _stated_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_stated_tag(path: Path) -> None:
    """Each `csi-local:<tag>` and `newTag:` in the docs' commands and the
    deployment files is the version (the image scripts/build-image makes)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return  # not text
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2))
             for m in _TAGGED.finditer(text)]
    assert [(line, tag) for line, tag in found if tag != VERSION] == []


def test_stated_tags_are_found() -> None:
    """The scan above sees the places it guards (a regex that matched
    nothing would pass every file)."""
    seen = {str(p.relative_to(REPO)) for p in _stated_files() if _TAGGED.search(p.read_text())}
    assert {"README.md", "docs/kubernetes.md", "docs/nomad.md",
            "deploy/kubernetes/base/kustomization.yaml",
            "deploy/nomad/csi-local.nomad.hcl"} <= seen, seen
