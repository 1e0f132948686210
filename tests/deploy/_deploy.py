"""Helpers shared by the deployment tests: load manifests and job files, and
collect what they pass to the plugin."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "kubernetes"
NOMAD_DIR = REPO / "deploy" / "nomad"
CONTAINER_LVM_CONF = REPO / "deploy" / "container" / "lvm.conf"

DRIVER = "lvm.csi-local.dev"
TOPOLOGY_KEY = "topology.lvm.csi-local.dev/node"
PLUGIN_IMAGE_RE = re.compile(r"^(.*/)?csi-local:[\w.-]+$")

SIDECAR_IMAGES = {
    "csi-provisioner": "registry.k8s.io/sig-storage/csi-provisioner:v6.3.0",
    "csi-snapshotter": "registry.k8s.io/sig-storage/csi-snapshotter:v8.6.0",
    "csi-resizer": "registry.k8s.io/sig-storage/csi-resizer:v2.2.1",
    "csi-node-driver-registrar": "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0",
    "livenessprobe": "registry.k8s.io/sig-storage/livenessprobe:v2.19.0",
}


def manifest_files() -> list[Path]:
    return sorted(K8S_DIR.rglob("*.yaml"))


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in load_docs(p)]


def find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for _, d in all_docs()
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(kind: str, name: str) -> dict[str, Any]:
    found = find(kind, name)
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    for c in pod_spec(workload)["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name} in {workload['metadata']['name']}")


def image_repo(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


@dataclass
class PluginInvocation:
    """What one manifest or job passes to `csi-local serve`."""

    where: str
    flags: list[str] = field(default_factory=list)  # "--flag" names
    env: dict[str, str | None] = field(default_factory=dict)  # literal value or None


def _flag_names(args: list[str]) -> list[str]:
    names = []
    for a in args:
        if a.startswith("--"):
            names.append(a.split("=", 1)[0])
    return names


def k8s_plugin_invocations() -> Iterator[PluginInvocation]:
    for path, doc in all_docs():
        if doc.get("kind") not in ("DaemonSet", "Deployment", "StatefulSet", "Pod"):
            continue
        spec = doc["spec"] if doc["kind"] == "Pod" else pod_spec(doc)
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if not PLUGIN_IMAGE_RE.match(c["image"]):
                continue
            inv = PluginInvocation(where=f"{path.name}:{doc['metadata']['name']}/{c['name']}")
            assert "command" not in c, "the image ENTRYPOINT (csi-local serve) must be used"
            inv.flags = _flag_names(c.get("args", []))
            for e in c.get("env", []):
                inv.env[e["name"]] = e.get("value")
            assert "envFrom" not in c, "list plugin env vars explicitly so they can be checked"
            yield inv


def run_lvm(system_dir: Path, *command: str, lvmlocal: str | None = None,
            devices: str | None = None) -> subprocess.CompletedProcess[str]:
    """`lvm COMMAND...` (lvmconfig, lvmdevices: commands that only read) with
    the image's lvm.conf as lvm.conf, `lvmlocal` as lvmlocal.conf and
    `devices` as the devices file, all in `system_dir` (LVM_SYSTEM_DIR), the
    way the deployments lay them out in /etc/lvm."""
    lvm = shutil.which("lvm") or shutil.which("lvm", path="/usr/sbin:/sbin")
    assert lvm, "lvm not found (apt-get install lvm2)"
    shutil.copy(CONTAINER_LVM_CONF, system_dir / "lvm.conf")
    local = system_dir / "lvmlocal.conf"
    local.unlink(missing_ok=True)
    if lvmlocal is not None:
        local.write_text(lvmlocal)
    devices_file = system_dir / "devices" / "system.devices"
    devices_file.unlink(missing_ok=True)
    if devices is not None:
        devices_file.parent.mkdir(exist_ok=True)
        devices_file.write_text(devices)
    env = {"LVM_SYSTEM_DIR": str(system_dir), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
           "LVM_SUPPRESS_FD_WARNINGS": "1"}
    return subprocess.run([lvm, *command], capture_output=True, text=True, timeout=60,
                          env=env, check=False)


# --- Nomad -----------------------------------------------------------------


def unquote(value: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals and labels."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def load_hcl(path: Path) -> dict[str, Any]:
    import hcl2

    with path.open() as f:
        return hcl2.load(f)


def blocks(body: dict[str, Any], name: str) -> list[Any]:
    """Blocks (or block-ish attributes) called `name` in a python-hcl2 body."""
    value = body.get(name)
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def labelled(block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Split a labelled block {'"label"': body} into (label, body)."""
    keys = [k for k in block if not k.startswith("__")]
    assert len(keys) == 1, f"expected one label, got {keys}"
    return unquote(keys[0]), block[keys[0]]


def nomad_plugin_tasks(job_file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group label, task body) for every task with a csi_plugin block,
    looking inside `dynamic "group"` content too."""
    doc = load_hcl(job_file)
    for job in blocks(doc, "job"):
        _, jbody = labelled(job)
        groups: list[tuple[str, dict[str, Any]]] = [labelled(g) for g in blocks(jbody, "group")]
        for dyn in blocks(jbody, "dynamic"):
            kind, dbody = labelled(dyn)
            if kind == "group":
                label = unquote(dbody["labels"][0])
                for content in blocks(dbody, "content"):
                    groups.append((label, content))
        for glabel, gbody in groups:
            for task in blocks(gbody, "task"):
                _, tbody = labelled(task)
                if blocks(tbody, "csi_plugin"):
                    yield glabel, tbody


def nomad_plugin_invocations() -> Iterator[PluginInvocation]:
    for job_file in sorted(NOMAD_DIR.glob("*.nomad.hcl")):
        for glabel, task in nomad_plugin_tasks(job_file):
            inv = PluginInvocation(where=f"{job_file.name}:{glabel}")
            for cfg in blocks(task, "config"):
                inv.flags += _flag_names([unquote(a) for a in cfg.get("args", [])])
            for env in blocks(task, "env"):
                for k, v in env.items():
                    if not k.startswith("__"):
                        inv.env[k] = unquote(v)
            yield inv
