"""Kubernetes manifests: schema validation (offline) and the deployment
properties csi-local depends on."""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy._deploy import (
    BASE_DIR,
    CONFIG_MAP,
    DEVICE_CLASSES_DIR,
    DRIVER,
    EXAMPLES_DIR,
    K8S_DIR,
    KUBELET_DIR_COMPONENT,
    PLUGIN_IMAGE_NAME,
    PLUGIN_IMAGE_RE,
    REPO,
    SIDECAR_IMAGES,
    SNAPSHOT_CONTROLLER_DIR,
    SNAPSHOT_METADATA_COMPONENT,
    SNAPSHOT_METADATA_DIR,
    SNAPSHOTS_COMPONENT,
    SNAPSHOTS_DIR,
    TOPOLOGY_KEY,
    VAC_SYNC_COMMAND,
    VARIANT_DIRS,
    all_docs,
    check_classes_shape,
    compose,
    container,
    device_classes_docs,
    find,
    generated_config_map,
    image_repo,
    is_plugin,
    kustomization,
    kustomize_docs,
    load_docs,
    manifest_files,
    one,
    one_of,
    pod_spec,
    run_lvm,
    snapshot_metadata_docs,
    snapshots_docs,
)

# Oldest Kubernetes release this deployment supports; kubernetes-validate
# ships its schemas (strict: unknown fields are errors).
K8S_VERSION = "1.31.0"


def _newest_minors(count: int) -> list[str]:
    from kubernetes_validate.utils import all_versions

    versions = sorted(set(all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return versions[-count:]


# Every manifest and rendered overlay is valid at the oldest supported release
# and at the two newest ones kubernetes-validate knows (fields removed or
# added since then are errors).
K8S_VERSIONS = (K8S_VERSION, *_newest_minors(2))
CRD_KINDS = {"VolumeSnapshot", "VolumeSnapshotClass", "VolumeSnapshotContent"}


def test_manifests_exist() -> None:
    kinds = {d["kind"] for _, d in all_docs()}
    for kind in ("CSIDriver", "DaemonSet", "Deployment", "StorageClass",
                 "VolumeSnapshot", "PersistentVolumeClaim", "Pod", "ServiceAccount",
                 "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Namespace",
                 "ConfigMap"):
        assert kind in kinds, f"no {kind} in deploy/kubernetes"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "path_doc",
    [pd for pd in all_docs() if pd[1]["kind"] not in CRD_KINDS],
    ids=lambda pd: f"{pd[0].name}:{pd[1]['kind']}/{pd[1]['metadata']['name']}",
)
def test_schema_valid(path_doc: tuple[Any, dict[str, Any]], version: str) -> None:
    _, doc = path_doc
    kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_a_broken_manifest() -> None:
    """The validator really checks (a typo in a field is an error)."""
    ds = one("DaemonSet", "csi-local-node")
    broken = {**ds, "spec": {**ds["spec"], "updateStrategyy": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


# --- CRD kinds kubernetes-validate has no schema for -------------------------


def _check_meta(doc: dict[str, Any], namespaced: bool) -> None:
    assert doc["apiVersion"] == "snapshot.storage.k8s.io/v1"
    meta = doc["metadata"]
    assert isinstance(meta.get("name"), str) and meta["name"]
    if namespaced:
        assert isinstance(meta.get("namespace"), str) and meta["namespace"]
    else:
        assert "namespace" not in meta


def test_volume_snapshot_class_shape() -> None:
    classes = [d for d in snapshots_docs() if d["kind"] == "VolumeSnapshotClass"]
    assert classes
    for c in classes:
        _check_meta(c, namespaced=False)
        assert set(c) <= {"apiVersion", "kind", "metadata", "driver", "deletionPolicy",
                          "parameters"}, set(c)
        assert c["driver"] == DRIVER
        assert c["deletionPolicy"] in ("Delete", "Retain")
        for key in c.get("parameters", {}):
            assert key.startswith("csi.storage.k8s.io/"), f"unknown snapshot parameter {key}"


def test_volume_snapshot_shape() -> None:
    snaps = find("VolumeSnapshot")
    assert snaps
    class_names = {c["metadata"]["name"] for c in snapshots_docs()
                   if c["kind"] == "VolumeSnapshotClass"}
    for s in snaps:
        _check_meta(s, namespaced=True)
        assert set(s) == {"apiVersion", "kind", "metadata", "spec"}
        spec = s["spec"]
        assert set(spec) <= {"source", "volumeSnapshotClassName"}
        source = spec["source"]
        # exactly one of the two sources (the CRD's oneOf)
        assert len(set(source) & {"persistentVolumeClaimName", "volumeSnapshotContentName"}) == 1
        assert set(source) <= {"persistentVolumeClaimName", "volumeSnapshotContentName"}
        assert spec["volumeSnapshotClassName"] in class_names



# --- snapshots: a component, over a base that needs no CRD ---------------------

def _changed_or_new(directory: Path = DEVICE_CLASSES_DIR,
                    against: Path | None = None) -> list[dict[str, Any]]:
    """What `directory` renders that `against` (default: the deployment)
    does not, changed or new."""
    base = [d for _, d in all_docs()] if against is None else kustomize_docs(against)
    return [d for d in kustomize_docs(directory) if all(d != b for b in base)]


# The API groups a cluster serves without any CRD, of those the deployment uses.
BUILT_IN_GROUPS = {"", "apps", "rbac.authorization.k8s.io", "storage.k8s.io",
                   "scheduling.k8s.io"}
SNAPSHOT_GROUPS = {"snapshot.storage.k8s.io", "groupsnapshot.storage.k8s.io"}


def _group(doc: dict[str, Any]) -> str:
    api: str = doc["apiVersion"]
    return api.rsplit("/", 1)[0] if "/" in api else ""


def _containers(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {w["metadata"]["name"]: [image_repo(c["image"]) for c in pod_spec(w)["containers"]]
            for w in docs if w["kind"] in ("DaemonSet", "Deployment")}


def test_base_needs_no_snapshot_crds() -> None:
    """`kubectl apply -k deploy/kubernetes` on a cluster without the snapshot
    CRDs: every object is of a built-in kind (no "no matches for kind
    VolumeSnapshotClass"), and no sidecar needs them (csi-snapshotter would
    only log errors there); no rule grants snapshot resources either."""
    docs = kustomize_docs(K8S_DIR)
    assert {_group(d) for d in docs} <= BUILT_IN_GROUPS, {
        (d["kind"], _group(d)) for d in docs if _group(d) not in BUILT_IN_GROUPS}
    assert not [c for cs in _containers(docs).values() for c in cs
                if c in ("csi-snapshotter", "csi-snapshot-metadata")]
    rules = {g for d in docs if d["kind"] in ("ClusterRole", "Role")
             for r in d["rules"] for g in r["apiGroups"]}
    assert not rules & SNAPSHOT_GROUPS, rules & SNAPSHOT_GROUPS


def test_snapshots_component_adds_what_needs_the_crds() -> None:
    """The snapshots component adds the VolumeSnapshotClass, csi-snapshotter
    after the node pod's other containers (the plugin stays the first, the
    one `kubectl logs` takes) and the RBAC of snapshots; nothing else of the
    deployment changes."""
    base, docs = kustomize_docs(K8S_DIR), snapshots_docs()
    added = {(d["kind"], d["metadata"]["name"]) for d in _changed_or_new(SNAPSHOTS_DIR)}
    assert added == {("VolumeSnapshotClass", "csi-local"),
                     ("DaemonSet", "csi-local-node"),
                     ("ClusterRole", "csi-local-snapshotter"),
                     ("ClusterRoleBinding", "csi-local-snapshotter"),
                     ("ClusterRole", "csi-local-provisioner-snapshots"),
                     ("ClusterRoleBinding", "csi-local-provisioner-snapshots")}, added
    assert [d for d in docs if d["kind"] != "DaemonSet" and d not in base] == [
        d for d in docs if d["kind"] != "DaemonSet" and (d["kind"], d["metadata"]["name"])
        in added]
    node, bare = one_of(docs, "DaemonSet", "csi-local-node"), one_of(base, "DaemonSet",
                                                                      "csi-local-node")
    assert _containers([node])["csi-local-node"] == [
        *_containers([bare])["csi-local-node"], "csi-snapshotter"]
    pod_spec(node)["containers"].pop()
    assert node == bare
    for d in docs:
        if _group(d) in SNAPSHOT_GROUPS:
            assert (d["kind"], d["metadata"]["name"]) in added



@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "doc", [d for d in _changed_or_new(SNAPSHOTS_DIR) if d["kind"] not in CRD_KINDS],
    ids=lambda d: f"snapshots:{d['kind']}/{d['metadata']['name']}")
def test_snapshots_schema_valid(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)

@pytest.mark.parametrize("directory", [SNAPSHOTS_DIR, SNAPSHOT_METADATA_DIR,
                                       DEVICE_CLASSES_DIR], ids=lambda d: d.name)
def test_plugin_is_the_node_pods_first_container(directory: Path) -> None:
    """Patches append, never put a sidecar before the plugin: `kubectl logs`
    and `exec` take a pod's first container by default."""
    node = one_of(kustomize_docs(directory), "DaemonSet", "csi-local-node")
    assert pod_spec(node)["containers"][0]["name"] == "csi-local"


def _snapshotter_tag() -> str:
    return SIDECAR_IMAGES["csi-snapshotter"].rsplit(":", 1)[1]


def test_snapshot_controller_kustomization(tmp_path: Path) -> None:
    """deploy/kubernetes/snapshot-controller takes upstream's
    snapshot-controller at the csi-snapshotter sidecar's release and gives it
    what distributed snapshotting needs: --enable-distributed-snapshotting,
    a ClusterRole that reads nodes, and the controller of that release.
    Rendered against a stand-in of upstream's objects (names as upstream has
    them; the tests have no network)."""
    tag = _snapshotter_tag()
    k = kustomization(SNAPSHOT_CONTROLLER_DIR)
    remote = ("https://github.com/kubernetes-csi/external-snapshotter//deploy/kubernetes/"
              f"snapshot-controller?ref={tag}")
    assert k["resources"] == [remote]
    stand_in = tmp_path / "upstream"
    stand_in.mkdir()
    (stand_in / "kustomization.yaml").write_text("resources: [objects.yaml]\n")
    (stand_in / "objects.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "snapshot-controller-runner"},
         "rules": [{"apiGroups": [""], "resources": ["persistentvolumes"],
                    "verbs": ["get"]}]},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "snapshot-controller", "namespace": "kube-system"},
         "spec": {"selector": {"matchLabels": {"app": "x"}}, "template": {
             "metadata": {"labels": {"app": "x"}},
             "spec": {"containers": [{
                 "name": "snapshot-controller",
                 "image": "registry.k8s.io/sig-storage/snapshot-controller:v0.0.0",
                 "args": ["--v=5", "--leader-election=true"]}]}}}}]))
    local = tmp_path / "controller"
    local.mkdir()
    k["resources"] = ["../upstream"]
    (local / "kustomization.yaml").write_text(yaml.safe_dump(k))
    docs = kustomize_docs(local)
    dep = one_of(docs, "Deployment", "snapshot-controller")
    (c,) = pod_spec(dep)["containers"]
    assert c["args"] == ["--v=5", "--leader-election=true",
                         "--enable-distributed-snapshotting=true"]
    assert c["image"] == f"registry.k8s.io/sig-storage/snapshot-controller:{tag}"
    role = one_of(docs, "ClusterRole", "snapshot-controller-runner")
    assert {("", "nodes", v) for v in ("get", "list", "watch")} <= _rules(role)


CRD_INSTALL = ("kubectl apply -k 'https://github.com/kubernetes-csi/external-snapshotter//"
               "client/config/crd?ref={tag}'")


@pytest.mark.parametrize("doc", ["README.md", "docs/kubernetes.md"])
def test_docs_install_snapshots_step_by_step(doc: str) -> None:
    """The README and the guide give the snapshot CRDs and controller inline,
    pinned to the sidecar's release, before the deployment with snapshots."""
    text = (REPO / doc).read_text()
    crds = CRD_INSTALL.format(tag=_snapshotter_tag())
    controller = "kubectl apply -k deploy/kubernetes/snapshot-controller"
    assert crds in text and controller in text
    assert text.index(crds) < text.index(controller)
    assert "deploy/kubernetes/components/snapshots" in text


def test_documented_snapshots_kustomization(tmp_path: Path) -> None:
    """The kustomization docs/kubernetes.md shows to add snapshots renders
    what the tests take as the deployment with snapshots."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
                if b.rstrip().endswith("components/snapshots")]
    own = yaml.safe_load(block)
    prefix = own["resources"][0].removesuffix("deploy/kubernetes")
    assert own["resources"] == [f"{prefix}deploy/kubernetes"]
    assert own["components"] == [f"{prefix}deploy/kubernetes/components/snapshots"]
    own["resources"] = [os.path.relpath(K8S_DIR, tmp_path)]
    own["components"] = [os.path.relpath(SNAPSHOTS_COMPONENT, tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(own))
    assert kustomize_docs(tmp_path) == snapshots_docs()


def test_readme_snapshots_kustomization() -> None:
    """The README's kustomization (written into my-csi-local/ at the
    repository's root) takes the deployment and the snapshots component."""
    text = (REPO / "README.md").read_text()
    body = re.search(r"cat > my-csi-local/kustomization.yaml <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert body, "no kustomization in the README"
    own = yaml.safe_load(body[1])
    where = REPO / "my-csi-local"
    assert [(where / r).resolve() for r in own["resources"]] == [K8S_DIR]
    assert [(where / c).resolve() for c in own["components"]] == [SNAPSHOTS_COMPONENT]
    assert "kubectl apply -k my-csi-local" in text


def test_documented_snapshot_metadata_kustomization(tmp_path: Path) -> None:
    """docs/snapshot-metadata.md's kustomization: the deployment with both
    components, snapshots first; and the components apply the same way to
    the device-classes overlay, as it says (the node pods then have the
    classes, csi-snapshotter and the certificate for doctor)."""
    text = SM_DOCS.read_text()
    own = yaml.safe_load(_yaml_block(text, "components/snapshot-metadata"))
    prefix = "../csi-local/deploy/kubernetes"
    assert own["resources"] == [prefix]
    assert own["components"] == [f"{prefix}/components/snapshots",
                                 f"{prefix}/components/snapshot-metadata"]
    assert f"{prefix}/examples/device-classes" in text
    docs = snapshot_metadata_docs()
    assert [_identity(d) for d in docs if _identity(d)[0] == "SnapshotMetadataService"]
    both = kustomize_docs(_composed_over(DEVICE_CLASSES_DIR, tmp_path))
    node = container(one_of(both, "DaemonSet", "csi-local-node"), "csi-local")
    env = {e["name"] for e in node["env"]}
    assert {"CSI_LOCAL_CONFIG", "CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT"} <= env
    assert _containers([one_of(both, "DaemonSet", "csi-local-node")])["csi-local-node"][-1] == (
        "csi-snapshotter")
    assert one_of(both, "DaemonSet", SM_DAEMONSET)


def _identity(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _composed_over(resource: Path, where: Path) -> Path:
    """Both snapshot components over `resource`, in `where`."""
    doc = {"resources": [os.path.relpath(resource, where)],
           "components": [os.path.relpath(c, where)
                          for c in (SNAPSHOTS_COMPONENT, SNAPSHOT_METADATA_COMPONENT)]}
    (where / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return where


# --- another kubelet directory (components/kubelet-dir) ------------------------

KUBELET_DIRS = {"microk8s": "/var/snap/microk8s/common/var/lib/kubelet",
                "k0s": "/var/lib/k0s/kubelet"}


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _kubelet_dir_docs(name: str, path: str, kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    """The deployment with both snapshot components and the kubelet-dir
    component, its path given as `kustomization` (the documented one) gives it."""
    extra = {k: v for k, v in kustomization.items()
             if k not in ("apiVersion", "kind", "resources", "components")}
    (generator,) = extra["configMapGenerator"]
    generator["literals"] = [f"path={path}"]
    return kustomize_docs(compose(f"kubelet-dir-{name}", SNAPSHOTS_COMPONENT,
                                  SNAPSHOT_METADATA_COMPONENT, KUBELET_DIR_COMPONENT,
                                  extra=extra))


def _documented_kubelet_dir() -> dict[str, Any]:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    doc: dict[str, Any] = yaml.safe_load(_yaml_block(text, "components/kubelet-dir"))
    return doc


@pytest.mark.parametrize("name", sorted(KUBELET_DIRS))
def test_kubelet_dir_component(name: str) -> None:
    """One value moves every use of the kubelet directory: nothing names
    /var/lib/kubelet any more; the plugin mounts the directory at the host's
    own path (kubelet passes host paths), Bidirectional; the socket kubelet
    is told of (--kubelet-registration-path, expanded) is the file the plugin
    serves on, through the hostPaths, as is the one the snapshot-metadata
    sidecar dials; the registration directory is kubelet's."""
    path = KUBELET_DIRS[name]
    doc = _documented_kubelet_dir()
    docs = _kubelet_dir_docs(name, path, doc)
    for s in _strings(docs):
        for token in re.split(r"=|unix://", s):
            assert not token.startswith("/var/lib/kubelet"), s
    assert not [d for d in docs if d["metadata"]["name"] == "csi-local-kubelet-dir"]
    ds = one_of(docs, "DaemonSet", "csi-local-node")
    plugin = container(ds, "csi-local")
    (mount,) = [m for m in plugin["volumeMounts"] if m["name"] == "kubelet-dir"]
    assert mount["mountPath"] == path and mount["mountPropagation"] == "Bidirectional"
    assert _host_path(ds, "kubelet-dir") == path
    socket = _host_file(ds, plugin, _env(plugin)["CSI_ENDPOINT"]["value"].removeprefix("unix://"))
    assert socket == PurePosixPath(path, "plugins", DRIVER, "csi.sock")
    reg = container(ds, "node-driver-registrar")
    assert PurePosixPath(_expand(reg, _flag(reg, "--kubelet-registration-path"))) == socket
    assert _host_path(ds, _mounts(reg)["/registration"]["name"]) == f"{path}/plugins_registry"
    for c in pod_spec(ds)["containers"]:
        if "/csi" in _mounts(c):
            assert _host_file(ds, c, "/csi/csi.sock") == socket, c["name"]
    sm = one_of(docs, "DaemonSet", SM_DAEMONSET)
    sidecar = container(sm, SM_SIDECAR)
    assert _host_file(sm, sidecar, _flag(sidecar, "--csi-address")) == socket


def test_kubelet_dir_documented() -> None:
    """The guide's kustomization lists the component last (after the
    components whose objects it changes), with the ConfigMap it reads as
    local configuration, and names the paths of microk8s and k0s."""
    doc = _documented_kubelet_dir()
    assert doc["components"][-1].endswith("deploy/kubernetes/components/kubelet-dir")
    (generator,) = doc["configMapGenerator"]
    assert generator["name"] == "csi-local-kubelet-dir"
    assert generator["options"]["annotations"] == {"config.kubernetes.io/local-config": "true"}
    text = (REPO / "docs" / "kubernetes.md").read_text()
    for path in KUBELET_DIRS.values():
        assert path in text
    assert "change the hostPaths in `base/node.yaml`" not in text

# --- CSIDriver, StorageClass, examples ---------------------------------------


def test_csidriver() -> None:
    spec = one("CSIDriver", DRIVER)["spec"]
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True
    assert spec["storageCapacity"] is True
    assert spec["fsGroupPolicy"] == "File"
    assert spec["volumeLifecycleModes"] == ["Persistent"]
    # Kubelet passes the pod's SELinux label as a context= mount flag, which
    # the plugin takes (fsrules) and hands to mount(8).
    assert spec["seLinuxMount"] is True


def test_storage_classes() -> None:
    classes = find("StorageClass")
    assert classes
    for sc in classes:
        assert sc["provisioner"] == DRIVER
        assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
        assert sc["allowVolumeExpansion"] is True
        for key in sc.get("parameters", {}):
            assert key.startswith("csi.storage.k8s.io/"), f"unknown StorageClass parameter {key}"
        assert sc["parameters"]["csi.storage.k8s.io/fstype"] in ("ext4", "xfs", "btrfs")


def test_examples_reference_each_other() -> None:
    pvcs = {p["metadata"]["name"]: p for p in find("PersistentVolumeClaim")}
    sc_names = {s["metadata"]["name"] for s in find("StorageClass")}
    snap_names = {s["metadata"]["name"] for s in find("VolumeSnapshot")}
    for pvc in pvcs.values():
        assert pvc["spec"]["storageClassName"] in sc_names
    restored = [p for p in pvcs.values() if "dataSource" in p["spec"]]
    assert restored, "no restore-from-snapshot PVC example"
    for p in restored:
        ds = p["spec"]["dataSource"]
        assert ds == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                      "name": ds["name"]}
        assert ds["name"] in snap_names
    for snap in find("VolumeSnapshot"):
        assert snap["spec"]["source"]["persistentVolumeClaimName"] in pvcs
    for pod in find("Pod"):
        for vol in pod["spec"].get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs


# --- node DaemonSet ----------------------------------------------------------


def _env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def _field_ref(c: dict[str, Any], name: str) -> str:
    path: str = _env(c)[name]["valueFrom"]["fieldRef"]["fieldPath"]
    return path


def _mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def _host_path(workload: dict[str, Any], volume_name: str) -> str:
    for v in pod_spec(workload)["volumes"]:
        if v["name"] == volume_name:
            path: str = v["hostPath"]["path"]
            return path
    raise AssertionError(f"no hostPath volume {volume_name}")


def test_sidecar_images_pinned_exactly() -> None:
    """Every sidecar image, in the default deployment and in the variants, is
    the exact version the project pins (and every pinned one is used)."""
    seen = set()
    variants = [d for directory in VARIANT_DIRS for d in kustomize_docs(directory)]
    for doc in [d for _, d in all_docs()] + variants:
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        for c in pod_spec(doc)["containers"]:
            repo = image_repo(c["image"])
            if repo in SIDECAR_IMAGES:
                assert c["image"] == SIDECAR_IMAGES[repo]
                seen.add(repo)
    assert seen == set(SIDECAR_IMAGES)


def test_node_plugin_container() -> None:
    ds = one("DaemonSet", "csi-local-node")
    c = container(ds, "csi-local")
    assert c["securityContext"]["privileged"] is True
    assert _field_ref(c, "NODE_ID") == "spec.nodeName"
    endpoint = _env(c)["CSI_ENDPOINT"]["value"]
    assert endpoint == "unix:///csi/csi.sock"
    assert _host_file(ds, c, endpoint.removeprefix("unix://")) == PurePosixPath(
        f"/var/lib/kubelet/plugins/{DRIVER}/csi.sock")
    assert _env(c)["CSI_LOCAL_DRIVER_NAME"]["value"] == DRIVER
    mounts = _mounts(c)
    assert mounts["/var/lib/kubelet"]["mountPropagation"] == "Bidirectional"
    assert _host_path(ds, mounts["/var/lib/kubelet"]["name"]) == "/var/lib/kubelet"
    assert _host_path(ds, mounts["/dev"]["name"]) == "/dev"
    # LVM state shared with the host (deploy/container/lvm.conf)
    for path in ("/run/lock/lvm", "/run/lvm", "/etc/lvm/backup", "/etc/lvm/archive"):
        assert _host_path(ds, mounts[path]["name"]) == path, path
    state = _env(c)["CSI_LOCAL_STATE_DIR"]["value"]
    assert _host_path(ds, mounts[state]["name"]) == "/var/lib/csi-local"


def test_node_registrar_and_liveness() -> None:
    ds = one("DaemonSet", "csi-local-node")
    reg = container(ds, "node-driver-registrar")
    assert _expand(reg, _flag(reg, "--kubelet-registration-path")) == (
        f"/var/lib/kubelet/plugins/{DRIVER}/csi.sock")
    assert _host_path(ds, _mounts(reg)["/registration"]["name"]) == (
        "/var/lib/kubelet/plugins_registry")
    assert _host_path(ds, _mounts(reg)["/csi"]["name"]) == f"/var/lib/kubelet/plugins/{DRIVER}"
    probe = container(ds, "liveness-probe")
    port = _flag(probe, "--http-endpoint").rsplit(":", 1)[1]
    plugin = container(ds, "csi-local")
    ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    assert str(ports[plugin["livenessProbe"]["httpGet"]["port"]]) == port


def test_provisioner_distributed_mode() -> None:
    ds = one("DaemonSet", "csi-local-node")
    c = container(ds, "csi-provisioner")
    args = c["args"]
    for flag in ("--node-deployment", "--enable-capacity", "--strict-topology",
                 "--immediate-topology=false", "--capacity-ownerref-level=1",
                 "--csi-address=/csi/csi.sock"):
        assert flag in args, flag
    assert _field_ref(c, "NODE_NAME") == "spec.nodeName"
    assert _field_ref(c, "NAMESPACE") == "metadata.namespace"
    assert _field_ref(c, "POD_NAME") == "metadata.name"
    # ownerref level 1 means pod -> DaemonSet: the provisioner must be in one
    assert ds["kind"] == "DaemonSet"



def test_provisioner_timeout_outlasts_the_plugins_commands() -> None:
    """csi-provisioner's --timeout outlasts the plugin's --command-timeout, so
    it never gives up on a CreateVolume whose lvcreate still runs; and
    node.yaml gives the real reason: CreateVolume runs lvcreate, and mkfs is
    NodeStageVolume's (the comment once blamed mkfs)."""
    ds = one("DaemonSet", "csi-local-node")
    timeout = _flag(container(ds, "csi-provisioner"), "--timeout")
    command = _env(container(ds, "csi-local"))["CSI_LOCAL_COMMAND_TIMEOUT"]["value"]
    assert int(timeout.removesuffix("s")) > int(command)
    text = (BASE_DIR / "node.yaml").read_text()
    comment = text.split("- --worker-threads", 1)[0].rsplit("- --extra-create-metadata", 1)[1]
    assert "lvcreate" in comment and "NodeStageVolume" in comment, comment
    assert "mkfs of a large volume is slow" not in comment

def test_snapshotter_distributed_mode() -> None:
    c = container(one_of(snapshots_docs(), "DaemonSet", "csi-local-node"), "csi-snapshotter")
    assert "--node-deployment" in c["args"]
    assert not any(a.startswith("--leader-election") for a in c["args"])
    assert _field_ref(c, "NODE_NAME") == "spec.nodeName"


def test_resizer_deployment_uses_node_expansion_only() -> None:
    dep = one("Deployment", "csi-local-resizer")
    resizer = container(dep, "csi-resizer")
    plugin = container(dep, "csi-local")
    addr = next(a.split("=", 1)[1] for a in resizer["args"] if a.startswith("--csi-address="))
    assert _env(plugin)["CSI_ENDPOINT"]["value"] == f"unix://{addr}"
    # same socket directory shared by both containers
    rdir = {m["name"] for m in resizer["volumeMounts"] if addr.startswith(m["mountPath"])}
    pdir = {m["name"] for m in plugin["volumeMounts"] if addr.startswith(m["mountPath"])}
    assert rdir & pdir
    assert _env(plugin)["CSI_LOCAL_NODE_EXPANSION_ONLY"]["value"] == "true"
    assert _env(plugin)["CSI_LOCAL_DRIVER_NAME"]["value"] == DRIVER
    # the node plugins must not advertise controller expansion either
    node_plugin = container(one("DaemonSet", "csi-local-node"), "csi-local")
    assert _env(node_plugin)["CSI_LOCAL_NODE_EXPANSION_ONLY"]["value"] == "true"
    assert "--leader-election" in resizer["args"]



def test_resizer_watches_no_pods() -> None:
    """The plugin expands online and never answers "volume in use", so
    csi-resizer runs without its pod informer (--handle-volume-inuse-error
    =false, as its README advises for such drivers): no watch of every pod in
    the cluster under its memory limit, and no right to list them."""
    dep = one("Deployment", "csi-local-resizer")
    resizer = container(dep, "csi-resizer")
    assert _flag(resizer, "--handle-volume-inuse-error") == "false"
    sa = pod_spec(dep)["serviceAccountName"]
    pods = {(g, res, verb) for g, res, verb in _granted(sa, dep["metadata"]["namespace"])
            if res == "pods"}
    assert not pods, pods


def test_resizer_runs_on_linux_nodes() -> None:
    """Both of the resizer pod's images are Linux images: a cluster with
    Windows nodes must not schedule it there."""
    spec = pod_spec(one("Deployment", "csi-local-resizer"))
    assert spec.get("nodeSelector", {}).get("kubernetes.io/os") == "linux"

# --- RBAC ---------------------------------------------------------------------

# (apiGroup, resource, verb) each sidecar needs at the pinned version.
NEEDS = {
    "csi-provisioner": {
        ("", "persistentvolumes", "create"), ("", "persistentvolumes", "delete"),
        ("", "persistentvolumeclaims", "update"), ("storage.k8s.io", "storageclasses", "get"),
        ("", "nodes", "get"), ("storage.k8s.io", "csinodes", "get"),
        ("storage.k8s.io", "csistoragecapacities", "create"),
        ("storage.k8s.io", "csistoragecapacities", "delete"), ("", "pods", "get"),
        ("snapshot.storage.k8s.io", "volumesnapshots", "get"),
        ("snapshot.storage.k8s.io", "volumesnapshotcontents", "get"), ("", "events", "create"),
    },
    "csi-snapshotter": {
        ("snapshot.storage.k8s.io", "volumesnapshotcontents", "update"),
        ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"),
        ("snapshot.storage.k8s.io", "volumesnapshotclasses", "get"), ("", "events", "create"),
    },
    "csi-resizer": {
        ("", "persistentvolumeclaims/status", "patch"), ("", "persistentvolumes", "patch"),
        ("coordination.k8s.io", "leases", "create"),
        ("", "events", "create"),
    },
}


def _granted(sa: str, namespace: str,
             docs: list[dict[str, Any]] | None = None) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the ServiceAccount is granted by the roles
    and bindings of `docs` (default: deploy/kubernetes/)."""
    if docs is None:
        docs = [d for _, d in all_docs()]

    def of(*kinds: str) -> list[dict[str, Any]]:
        return [d for d in docs if d["kind"] in kinds]

    granted: set[tuple[str, str, str]] = set()
    roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r
             for r in of("ClusterRole", "Role")}
    for b in of("ClusterRoleBinding", "RoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa
                   and s["namespace"] == namespace for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        ns = None if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
        role = roles[(ref["kind"], ns, ref["name"])]
        for rule in role["rules"]:
            for g in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((g, res, verb))
    return granted


@pytest.mark.parametrize("sidecar", sorted(NEEDS))
def test_rbac_covers_sidecar(sidecar: str) -> None:
    """With snapshots (the base has no csi-snapshotter, and grants nothing of
    snapshot.storage.k8s.io: test_base_needs_no_snapshot_crds)."""
    docs = snapshots_docs()
    for doc in docs:
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        names = [image_repo(c["image"]) for c in pod_spec(doc)["containers"]]
        if sidecar not in names:
            continue
        sa = pod_spec(doc)["serviceAccountName"]
        ns = doc["metadata"]["namespace"]
        assert one_of(docs, "ServiceAccount", sa), f"ServiceAccount {sa} missing"
        missing = NEEDS[sidecar] - _granted(sa, ns, docs)
        assert not missing, f"{sa} lacks {sorted(missing)}"
        return
    raise AssertionError(f"{sidecar} not deployed")


def test_namespaced_objects_share_one_namespace() -> None:
    namespaces = {d["metadata"]["name"] for d in find("Namespace")}
    for path, d in all_docs():
        if "examples" in path.parts:
            continue
        ns = d["metadata"].get("namespace")
        if ns is not None:
            assert ns in namespaces, f"{path.name}: {d['kind']} in unknown namespace {ns}"


def test_topology_key_matches_plugin_contract() -> None:
    text = "\n".join(p.read_text() for p in manifest_files())
    assert TOPOLOGY_KEY in text  # restore example pins to the origin's node by this key


# --- node set, SELinux, host device selection ---------------------------------

STORAGE_NODE_LABEL = "lvm.csi-local.dev/storage-node"


def test_node_plugin_runs_on_labelled_nodes_only() -> None:
    """A node without the VG must not get the plugin at all: the node set is
    explicit, and the docs say how a node joins it."""
    spec = pod_spec(one("DaemonSet", "csi-local-node"))
    assert spec.get("nodeSelector") == {STORAGE_NODE_LABEL: "true"}
    assert "affinity" not in spec  # the one place that decides is the nodeSelector
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert f"kubectl label node <node> {STORAGE_NODE_LABEL}=true" in docs



# csi-provisioner v6.3.0 (--node-deployment) labels each CSIStorageCapacity it
# makes with these, managed-by being "external-provisioner-<node>" (node names
# up to 42 characters), and only manages the objects of its own node.
CAPACITY_SELECTOR = (f"csi.storage.k8s.io/drivername={DRIVER},"
                     "csi.storage.k8s.io/managed-by=external-provisioner-<node>")


def test_taking_a_node_out_removes_its_capacities_and_topology_label() -> None:
    """Unlabelling a node removes its plugin pod, but neither its
    CSIStorageCapacity objects (the DaemonSet owns them) nor the topology
    label kubelet set; the scheduler matches capacities by StorageClass and
    node labels and would keep sending volumes there. The documented
    procedure removes the label, waits for the node's pod to go, then deletes
    the node's capacities and the topology label, in that order; the
    troubleshooting page and node.yaml's comment name both steps."""
    ds = one("DaemonSet", "csi-local-node")
    pod_label = "app.kubernetes.io/name=" + (
        ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"])
    assert "--capacity-ownerref-level=1" in container(ds, "csi-provisioner")["args"]
    text = (REPO / "docs" / "kubernetes.md").read_text()
    block = _sh_block(text, f"{STORAGE_NODE_LABEL}-")
    steps = [
        f"kubectl label node <node> {STORAGE_NODE_LABEL}-",
        f"kubectl -n csi-local get pods -l {pod_label} --field-selector spec.nodeName=<node>",
        f"kubectl -n csi-local delete csistoragecapacities \\\n    -l {CAPACITY_SELECTOR}",
        f"kubectl label node <node> {TOPOLOGY_KEY}-",
    ]
    where = [block.find(s) for s in steps]
    assert -1 not in where, list(zip(steps, where, strict=True))
    assert where == sorted(where), where
    for path in (REPO / "docs" / "troubleshooting.md", BASE_DIR / "node.yaml"):
        doc = path.read_text()
        assert "managed-by=external-provisioner-<node>" in doc, path.name
        assert f"kubectl label node <node> {TOPOLOGY_KEY}-" in doc, path.name

def test_sidecars_beside_a_privileged_plugin_are_privileged() -> None:
    """On SELinux-enforcing nodes a confined container cannot use the socket a
    privileged one made (csi-driver-host-path runs its sidecars privileged
    for this reason)."""
    checked = []
    for _, doc in all_docs():
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        containers = pod_spec(doc)["containers"]
        plugins = [c for c in containers if is_plugin(c)]
        assert len(plugins) == 1, doc["metadata"]["name"]
        plugin_privileged = plugins[0].get("securityContext", {}).get("privileged") is True
        for c in containers:
            if c is plugins[0]:
                continue
            privileged = c.get("securityContext", {}).get("privileged") is True
            if plugin_privileged:
                assert privileged, f"{doc['metadata']['name']}/{c['name']} is not privileged"
            checked.append((doc["metadata"]["name"], c["name"], privileged))
    assert ("csi-local-node", "csi-provisioner", True) in checked
    assert ("csi-local-node", "liveness-probe", True) in checked
    assert ("csi-local-node", "vac-sync", True) in checked
    # both unprivileged: same SELinux type and level, nothing to widen
    assert ("csi-local-resizer", "csi-resizer", False) in checked


def _volume(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in pod_spec(workload)["volumes"] if v["name"] == name)


def test_node_plugin_honours_the_hosts_device_selection() -> None:
    """The host's devices file, multipath WWIDs and (copied) filters reach
    the container's LVM, where deploy/container/lvm.conf makes it use them."""
    ds = one("DaemonSet", "csi-local-node")
    mounts = _mounts(container(ds, "csi-local"))
    devices = mounts["/etc/lvm/devices"]
    assert _host_path(ds, devices["name"]) == "/etc/lvm/devices"
    assert not devices.get("readOnly")  # LVM updates the devices file
    multipath = mounts["/etc/multipath"]
    assert _host_path(ds, multipath["name"]) == "/etc/multipath"
    assert multipath.get("readOnly") is True
    local = mounts["/etc/lvm/lvmlocal.conf"]
    assert local.get("readOnly") is True
    source = _volume(ds, local["name"])["configMap"]
    item = next(i for i in source["items"] if i["path"] == local["subPath"])
    assert source["name"] == generated_config_map()["metadata"]["name"]
    assert item["key"] in generated_config_map()["data"]


def test_node_plugin_gives_doctor_the_hosts_lvm_configuration() -> None:
    """doctor, run in the plugin's container, compares its LVM's view with
    the host's: the host's /etc/lvm is mounted read-only where
    CSI_LOCAL_HOST_LVM_DIR (doctor's --host-lvm-dir) says, and it is not the
    container's own /etc/lvm (which LVM there reads)."""
    ds = one("DaemonSet", "csi-local-node")
    plugin = container(ds, "csi-local")
    where = _env(plugin)["CSI_LOCAL_HOST_LVM_DIR"]["value"]
    mount = _mounts(plugin)[where]
    assert mount.get("readOnly") is True
    assert _host_path(ds, mount["name"]) == "/etc/lvm"
    assert not PurePosixPath(where).is_relative_to("/etc/lvm")
    from csi_local.cli import build_parser

    args = build_parser().parse_args(["doctor", "--volume-group", "vg", "--thin-pool", "p",
                                      "--host-lvm-dir", where])
    assert args.host_lvm_dir == where


def test_configmap_lvmlocal_conf_is_valid_lvm_config(tmp_path: Path) -> None:
    """What the ConfigMap mounts beside the image's lvm.conf is accepted by
    LVM (config/checks=1 rejects unknown settings), and a filter written
    there the way the docs say is the one LVM uses."""
    data = generated_config_map()["data"]["lvmlocal.conf"]
    r = run_lvm(tmp_path, "lvmconfig", "--validate", lvmlocal=data)
    assert r.returncode == 0, r.stdout + r.stderr
    with_filter = data.replace("devices {", 'devices {\n  global_filter = [ "r|^/dev/sdb$|" ]', 1)
    r = run_lvm(tmp_path, "lvmconfig", "devices/global_filter", lvmlocal=with_filter)
    assert r.stdout.strip() == 'global_filter="r|^/dev/sdb$|"', r.stdout + r.stderr


# --- device classes (examples/device-classes) ---------------------------------

DEVICE_CLASSES_CONFIGMAP = "csi-local-classes"


def _variant(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in device_classes_docs()
             if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in the variant, found {len(found)}"
    return found[0]


def _classes_config_map(docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The generated ConfigMap csi-local-classes-<hash> of a build (default:
    the device-classes example)."""
    found = [d for d in (device_classes_docs() if docs is None else docs)
             if d["kind"] == "ConfigMap"
             and re.fullmatch(rf"{DEVICE_CLASSES_CONFIGMAP}-[a-z0-9]{{10}}",
                              d["metadata"]["name"])]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def _classes_text() -> str:
    data = _classes_config_map()["data"]
    assert set(data) == {"classes.toml"}, set(data)
    text: str = data["classes.toml"]
    return text


def _check_takes_every_manifest(directory: Path) -> None:
    """The variant is the deployment plus its own files, never a copy: it
    takes the base whole (so a new manifest is not left out), and every file
    of the variant is used. Applied with -k as it is: no file outside its
    directory but the base, so no load restrictor to turn off."""
    k = kustomization(directory)
    resources = k["resources"]
    assert [r for r in resources if r.startswith("../")] == ["../../base"], resources
    assert (directory / "../../base").resolve() == BASE_DIR
    own = {r for r in resources if not r.startswith("../")}
    own |= {p["path"] for p in k.get("patches", [])}
    assert own == {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
    text = (directory / "kustomization.yaml").read_text()
    assert f"kubectl apply -k {directory.relative_to(REPO)}" in text
    assert "load-restrictor" not in text


def test_device_classes_kustomization_takes_every_manifest() -> None:
    _check_takes_every_manifest(DEVICE_CLASSES_DIR)


def test_device_classes_changes_only_what_it_should() -> None:
    """The node DaemonSet is changed, the ConfigMap and StorageClasses are
    added; the resizer (a capabilities-only plugin) and the rest stay."""
    changed = {(d["kind"], d["metadata"]["name"]) for d in _changed_or_new()}
    assert changed == {("DaemonSet", "csi-local-node"),
                       ("ConfigMap", _classes_config_map()["metadata"]["name"]),
                       ("StorageClass", "csi-local-fast"),
                       ("StorageClass", "csi-local-big")}, changed


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "doc", _changed_or_new(), ids=lambda d: f"device-classes:{d['kind']}/{d['metadata']['name']}")
def test_device_classes_schema_valid(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_device_classes_configmap_shape() -> None:
    cm = _classes_config_map()
    assert cm["metadata"]["namespace"] == one("Namespace", "csi-local")["metadata"]["name"]
    data = tomllib.loads(_classes_text())
    classes = check_classes_shape(data, "classes.toml")
    assert set(classes) == {"fast", "big"}
    assert data["default"] == "fast"
    assert classes["fast"]["volume_group"] == "vg-nvme"
    assert classes["big"]["volume_group"] == "vg-hdd"



def test_a_device_classes_edit_rolls_the_node_pods(tmp_path: Path) -> None:
    """The plugin reads classes.toml only when it starts, and a mounted
    ConfigMap's update never restarts it: the ConfigMap is generated, its
    name carrying a hash of the file, so an edit changes the node pods'
    template and `kubectl apply -k` rolls them (no manual rollout restart)."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(K8S_DIR, copy)
    path = copy / DEVICE_CLASSES_DIR.relative_to(K8S_DIR) / "classes.toml"
    edited = path.read_text().replace('readahead = "auto"', "readahead = 1024")
    assert edited != path.read_text()
    path.write_text(edited)
    before, after = device_classes_docs(), kustomize_docs(path.parent)
    old, new = _classes_config_map(before), _classes_config_map(after)
    assert old["metadata"]["name"] != new["metadata"]["name"]
    (a,) = [d for d in before if (d["kind"], d["metadata"]["name"]) == ("DaemonSet",
                                                                         "csi-local-node")]
    (b,) = [d for d in after if (d["kind"], d["metadata"]["name"]) == ("DaemonSet",
                                                                        "csi-local-node")]
    text = yaml.safe_dump(b["spec"]["template"])
    assert new["metadata"]["name"] in text and old["metadata"]["name"] not in text
    assert f"name: {DEVICE_CLASSES_CONFIGMAP}\n" not in text
    assert a["spec"]["template"] != b["spec"]["template"]
    assert "rollout restart" not in (DEVICE_CLASSES_DIR / "classes.toml").read_text()

def test_device_classes_configmap_parses_with_the_plugins_parser() -> None:
    """The plugin's own parser (the one that refuses a bad file at start) takes
    the example as it is."""
    from csi_local.volumes.device_classes import parse_classes

    parsed = parse_classes(_classes_text(), source="classes.toml")
    assert sorted(parsed.names) == ["big", "fast"]
    assert parsed.default == "fast"
    fast = parsed.get("fast")
    assert fast is not None and fast.pool_name == "vg-nvme/pool"
    assert fast.default_fs_type == "xfs" and fast.overprovision_ratio == 2.0


def test_device_classes_examples_are_one() -> None:
    """The ConfigMap's file, Nomad's and the docs' show the same classes."""
    configmap = tomllib.loads(_classes_text())
    nomad = tomllib.loads((REPO / "deploy" / "nomad" / "classes.toml").read_text())
    docs = (REPO / "docs" / "device-classes.md").read_text()
    first = docs.split("```toml\n", 1)[1].split("```", 1)[0]
    assert configmap == nomad == tomllib.loads(first)


def test_device_classes_storage_classes() -> None:
    """One StorageClass per class, each the default csi-local StorageClass but
    for its name and parameters, naming a class the ConfigMap defines."""
    classes = tomllib.loads(_classes_text())["classes"]
    template = one("StorageClass", "csi-local")
    named = {}
    for sc in device_classes_docs():
        if sc["kind"] != "StorageClass" or "deviceClass" not in sc.get("parameters", {}):
            continue
        params = sc["parameters"]
        assert params["deviceClass"] in classes, params
        for key in set(params) - {"deviceClass"}:
            assert key.startswith("csi.storage.k8s.io/"), f"unknown StorageClass parameter {key}"
        assert params["csi.storage.k8s.io/fstype"] in ("ext4", "xfs", "btrfs")
        strip = ("metadata", "parameters")
        assert {k: v for k, v in sc.items() if k not in strip} == (
            {k: v for k, v in template.items() if k not in strip})
        assert sc["metadata"]["labels"] == template["metadata"]["labels"]
        named[sc["metadata"]["name"]] = params["deviceClass"]
    assert named == {"csi-local-fast": "fast", "csi-local-big": "big"}
    # one VolumeSnapshotClass serves every class: snapshots stay in their source's
    for vsc in find("VolumeSnapshotClass"):
        assert "deviceClass" not in vsc.get("parameters", {})


def test_device_classes_node_plugin_reads_the_configmap() -> None:
    """--config (CSI_LOCAL_CONFIG) names the file where the ConfigMap is
    mounted, the flags' volume group and thin pool are gone (both at once is
    an error at start), and nothing else of node.yaml changes."""
    ds = _variant("DaemonSet", "csi-local-node")
    c = container(ds, "csi-local")
    env = _env(c)
    assert "CSI_LOCAL_VOLUME_GROUP" not in env and "CSI_LOCAL_THIN_POOL" not in env
    assert not any(a.split("=", 1)[0] in ("--volume-group", "--thin-pool", "--config")
                   for a in c.get("args", []))
    path = PurePosixPath(env["CSI_LOCAL_CONFIG"]["value"])
    assert path == PurePosixPath("/etc/csi-local/classes.toml")
    mount = _mounts(c)[str(path.parent)]
    assert mount.get("readOnly") is True and "subPath" not in mount
    source = _volume(ds, mount["name"])["configMap"]
    assert source["name"] == _classes_config_map()["metadata"]["name"]
    assert {"key": "classes.toml", "path": path.name} in source["items"]
    assert "classes.toml" in _classes_config_map()["data"]

    # the rest is node.yaml's
    base = one("DaemonSet", "csi-local-node")
    base_plugin = container(base, "csi-local")
    undo = {**c,
            "env": [e for e in c["env"] if e["name"] != "CSI_LOCAL_CONFIG"],
            "volumeMounts": [m for m in c["volumeMounts"] if m is not mount]}
    assert undo == {**base_plugin, "env": [e for e in base_plugin["env"] if e["name"] not in
                                           ("CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL")]}
    spec, base_spec = pod_spec(ds), pod_spec(base)
    assert [x for x in spec["containers"] if x["name"] != "csi-local"] == (
        [x for x in base_spec["containers"] if x["name"] != "csi-local"])
    assert [v for v in spec["volumes"] if v["name"] != mount["name"]] == base_spec["volumes"]
    strip = ("containers", "volumes")
    assert {k: v for k, v in spec.items() if k not in strip} == (
        {k: v for k, v in base_spec.items() if k not in strip})


# --- changed-block tracking (components/snapshot-metadata) ----------------------

SM_SIDECAR = "csi-snapshot-metadata"
SM_DAEMONSET = "csi-local-snapshot-metadata"
SM_SERVICE = "csi-local-snapshot-metadata"
SM_SECRET = "csi-local-snapshot-metadata-tls"
SM_CA_PLACEHOLDER = "REPLACE_WITH_BASE64_OF_ca.crt"
SM_DOCS = REPO / "docs" / "snapshot-metadata.md"
SM_SIDECAR_ROLE = "csi-local-snapshot-metadata"
SM_CLIENT_ROLE = "csi-local-snapshot-metadata-client"
SM_CLIENT_TOKEN_ROLE = "csi-local-snapshot-metadata-client-token"

# (apiGroup, resource, verb) the external-snapshot-metadata sidecar v1.1.0
# uses: the SnapshotMetadataService (audience), TokenReview and
# SubjectAccessReview of each client, the VolumeSnapshot and its content named
# in a request, and the VolumeSnapshotClass (by name, or listed for the
# default) where it looks for snapshotter secrets.
SM_SIDECAR_NEEDS = {
    ("cbt.storage.k8s.io", "snapshotmetadataservices", "get"),
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
    ("snapshot.storage.k8s.io", "volumesnapshots", "get"),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", "get"),
    ("snapshot.storage.k8s.io", "volumesnapshotclasses", "get"),
    ("snapshot.storage.k8s.io", "volumesnapshotclasses", "list"),
}
# A backup client with upstream's library (pkg/iterator): the VolumeSnapshot
# ("get volumesnapshots" is also the sidecar's SubjectAccessReview), its
# content (driver, snapshot handle), the SnapshotMetadataService by name.
SM_CLIENT_NEEDS = {
    ("snapshot.storage.k8s.io", "volumesnapshots", "get"),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", "get"),
    ("cbt.storage.k8s.io", "snapshotmetadataservices", "get"),
}


def _sm(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in snapshot_metadata_docs()
             if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in the variant, found {len(found)}"
    return found[0]


def _flag(c: dict[str, Any], name: str) -> str:
    values = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{c['name']}: {name} given {len(values)} times"
    return str(values[0])


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, res, verb) for rule in role["rules"] for g in rule["apiGroups"]
            for res in rule["resources"] for verb in rule["verbs"]}


def _host_file(workload: dict[str, Any], c: dict[str, Any], path: str) -> PurePosixPath:
    """Where `path` in container `c` is on the host, through its hostPath mounts."""
    p = PurePosixPath(path)
    mounts = [m for m in c["volumeMounts"]
              if p == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in p.parents]
    assert mounts, f"{c['name']}: nothing mounted over {path}"
    m = max(mounts, key=lambda m: len(PurePosixPath(m["mountPath"]).parts))
    return PurePosixPath(_host_path(workload, m["name"])) / p.relative_to(m["mountPath"])



def _expand(c: dict[str, Any], value: str) -> str:
    """`value` with the $(NAME) references kubelet expands from the
    container's literal environment variables."""
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], value)

def _resolve_port(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert len(found) == 1, f"{c['name']}: no port named {port}"
    return int(found[0])


def _sh_block(text: str, marker: str) -> str:
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"expected one sh block with {marker!r}, found {len(blocks)}"
    return str(blocks[0])


def _check_component_takes_every_manifest(directory: Path) -> None:
    """A Component: every file of its directory is used, and none outside it
    (no load restrictor to turn off)."""
    (k,) = load_docs(directory / "kustomization.yaml")
    assert k["kind"] == "Component" and k["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    resources = k.get("resources", [])
    assert not [r for r in resources if "/" in r], resources
    own = set(resources) | {p["path"] for p in k.get("patches", [])}
    assert own == {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert "load-restrictor" not in (directory / "kustomization.yaml").read_text()


@pytest.mark.parametrize("directory", [SNAPSHOTS_COMPONENT, SNAPSHOT_METADATA_COMPONENT],
                         ids=lambda d: d.name)
def test_components_take_every_manifest(directory: Path) -> None:
    _check_component_takes_every_manifest(directory)


def test_snapshot_metadata_changes_only_what_it_should() -> None:
    """The sidecar's DaemonSet and ServiceAccount, the Service, the
    SnapshotMetadataService and the RBAC are added; of the base only the node
    DaemonSet changes, by the certificate for doctor alone (see
    test_snapshot_metadata_node_plugin_gets_the_certificate_only; the
    resizer's capabilities-only plugin serves no snapshot metadata)."""
    changed = {(d["kind"], d["metadata"]["name"])
               for d in _changed_or_new(SNAPSHOT_METADATA_DIR, SNAPSHOTS_DIR)}
    assert changed == {("DaemonSet", SM_DAEMONSET),
                       ("DaemonSet", "csi-local-node"),
                       ("ServiceAccount", SM_DAEMONSET),
                       ("Service", SM_SERVICE),
                       ("SnapshotMetadataService", DRIVER),
                       ("ClusterRole", SM_SIDECAR_ROLE),
                       ("ClusterRoleBinding", SM_SIDECAR_ROLE),
                       ("ClusterRole", SM_CLIENT_ROLE),
                       ("ClusterRole", SM_CLIENT_TOKEN_ROLE)}, changed


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "doc", [d for d in _changed_or_new(SNAPSHOT_METADATA_DIR, SNAPSHOTS_DIR)
            if d["kind"] != "SnapshotMetadataService"],  # a CRD kind: shape checked below
    ids=lambda d: f"snapshot-metadata:{d['kind']}/{d['metadata']['name']}")
def test_snapshot_metadata_schema_valid(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_snapshot_metadata_service_object_shape() -> None:
    """The SnapshotMetadataService (cbt.storage.k8s.io/v1beta1, cluster-scoped,
    spec.address/caCert/audience all required): named after the driver (the
    sidecar and clients look it up by that name), its address the Service's
    DNS name and port, its CA a placeholder the API server refuses until the
    documented command fills it in."""
    sms = _sm("SnapshotMetadataService", DRIVER)
    assert sms["apiVersion"] == "cbt.storage.k8s.io/v1beta1"
    assert set(sms) == {"apiVersion", "kind", "metadata", "spec"}
    assert "namespace" not in sms["metadata"]
    spec = sms["spec"]
    assert set(spec) == {"address", "caCert", "audience"}, set(spec)
    for key, value in spec.items():
        assert isinstance(value, str) and value, key
    # host:port, no scheme (clients dial it as it is)
    assert "://" not in spec["address"]
    host, port = spec["address"].rsplit(":", 1)
    svc = _sm("Service", SM_SERVICE)
    assert host == f"{SM_SERVICE}.{svc['metadata']['namespace']}.svc"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    # format: byte in the CRD: the placeholder is not base64, so it cannot be
    # applied by mistake
    assert spec["caCert"] == SM_CA_PLACEHOLDER
    assert not re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", SM_CA_PLACEHOLDER)
    replace = f'sed -i "s|{SM_CA_PLACEHOLDER}|'
    assert replace in SM_DOCS.read_text()
    assert replace in (SNAPSHOT_METADATA_COMPONENT / "snapshotmetadataservice.yaml").read_text()


def test_snapshot_metadata_service_reaches_the_sidecar_on_the_clients_node() -> None:
    """One address for the whole cluster, answered by the sidecar on the
    client's own node (internalTrafficPolicy: Local): the Service selects the
    sidecar's pods, and only them, and targets the sidecar's gRPC port."""
    svc = _sm("Service", SM_SERVICE)
    spec = svc["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    assert spec.get("clusterIP") != "None"  # headless would hand out every node's pod
    assert spec["internalTrafficPolicy"] == "Local"
    ds = _sm("DaemonSet", SM_DAEMONSET)
    assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    selector = spec["selector"]
    for doc in snapshot_metadata_docs():
        if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            matches = selector.items() <= labels.items()
            is_sidecar = (doc["kind"], doc["metadata"]["name"]) == ("DaemonSet", SM_DAEMONSET)
            assert matches == is_sidecar, doc["metadata"]["name"]
    assert not pod_spec(ds).get("hostNetwork")  # one endpoint per pod, on its node
    (port,) = spec["ports"]
    sidecar = container(ds, SM_SIDECAR)
    grpc_port = int(_flag(sidecar, "--port"))
    assert _resolve_port(sidecar, port["targetPort"]) == grpc_port
    assert port.get("protocol", "TCP") == "TCP"


def test_snapshot_metadata_sidecar_uses_the_plugins_socket() -> None:
    """--csi-address is the socket the plugin serves on (CSI_ENDPOINT), the same
    file on the host through each pod's hostPath mounts, on the same nodes
    (the node plugin's nodeSelector and tolerations)."""
    ds = _sm("DaemonSet", SM_DAEMONSET)
    node = _sm("DaemonSet", "csi-local-node")
    sidecar = container(ds, SM_SIDECAR)
    plugin = container(node, "csi-local")
    endpoint = _env(plugin)["CSI_ENDPOINT"]["value"]
    assert endpoint.startswith("unix://")
    assert _host_file(ds, sidecar, _flag(sidecar, "--csi-address")) == (
        _host_file(node, plugin, endpoint.removeprefix("unix://")))
    for key in ("nodeSelector", "tolerations"):
        assert pod_spec(ds)[key] == pod_spec(node)[key], key


def test_snapshot_metadata_sidecar_tls() -> None:
    """--tls-cert/--tls-key name the keys of the kubernetes.io/tls Secret the
    docs create, mounted whole (renewals reach the files) and read-only; the
    Secret is optional, so a missing one never keeps the plugin from starting."""
    ds = _sm("DaemonSet", SM_DAEMONSET)
    sidecar = container(ds, SM_SIDECAR)
    cert = PurePosixPath(_flag(sidecar, "--tls-cert"))
    key = PurePosixPath(_flag(sidecar, "--tls-key"))
    assert (cert.name, key.name) == ("tls.crt", "tls.key")
    assert cert.parent == key.parent
    mount = _mounts(sidecar)[str(cert.parent)]
    assert mount.get("readOnly") is True and "subPath" not in mount
    source = _volume(ds, mount["name"])["secret"]
    assert source["secretName"] == SM_SECRET
    assert source.get("optional") is True
    assert "items" not in source  # both keys, under their own names
    ns = ds["metadata"]["namespace"]
    assert f"kubectl -n {ns} create secret tls {SM_SECRET}" in SM_DOCS.read_text()


def test_snapshot_metadata_sidecar_container() -> None:
    """Privileged as the plugin whose socket it uses, its ports declared,
    ready when its health endpoint says so: in a pod of its own, so that its
    readiness (none while the TLS Secret is missing) is never the node
    plugin's. The node DaemonSet has the base's containers, no more."""
    ds = _sm("DaemonSet", SM_DAEMONSET)
    spec = pod_spec(ds)
    (sidecar,) = spec["containers"]
    assert sidecar["name"] == SM_SIDECAR
    assert sidecar["image"] == SIDECAR_IMAGES[image_repo(sidecar["image"])]
    assert sidecar["securityContext"]["privileged"] is True
    own = {p["containerPort"] for p in sidecar["ports"]}
    grpc_port = int(_flag(sidecar, "--port"))
    http_port = int(_flag(sidecar, "--http-endpoint").rsplit(":", 1)[1])
    assert own == {grpc_port, http_port}
    probe = sidecar["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    assert _resolve_port(sidecar, probe["port"]) == http_port
    node = _sm("DaemonSet", "csi-local-node")
    assert [c["name"] for c in pod_spec(node)["containers"]] == [
        c["name"] for c in pod_spec(one_of(snapshots_docs(), "DaemonSet",
                                           "csi-local-node"))["containers"]]
    assert SM_SIDECAR not in [c["name"] for c in pod_spec(node)["containers"]]
    assert spec["priorityClassName"] in {d["metadata"]["name"] for d in snapshot_metadata_docs()
                                         if d["kind"] == "PriorityClass"}


def test_snapshot_metadata_node_plugin_gets_the_certificate_only() -> None:
    """For doctor's certificate check, the plugin's container gets the
    Secret's tls.crt (not its key) read-only, optional (a missing Secret
    never keeps the node pods from starting or becoming ready), at the path
    CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT names: the file the sidecar reads
    with --tls-cert. Nothing else of the base's node DaemonSet changes."""
    node = copy.deepcopy(_sm("DaemonSet", "csi-local-node"))
    plugin = container(node, "csi-local")
    cert = _env(plugin)["CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT"]["value"]
    mount = _mounts(plugin)[str(PurePosixPath(cert).parent)]
    assert mount.get("readOnly") is True and "subPath" not in mount
    source = _volume(node, mount["name"])["secret"]
    assert source["secretName"] == SM_SECRET and source.get("optional") is True
    assert source["items"] == [{"key": "tls.crt", "path": PurePosixPath(cert).name}]
    sidecar = container(_sm("DaemonSet", SM_DAEMONSET), SM_SIDECAR)
    assert PurePosixPath(_flag(sidecar, "--tls-cert")).name == "tls.crt"
    from csi_local.cli import build_parser

    args = build_parser().parse_args(["doctor", "--volume-group", "vg", "--thin-pool", "p",
                                      "--snapshot-metadata-tls-cert", cert])
    assert args.snapshot_metadata_tls_cert == cert
    # without these three, the base's node DaemonSet
    plugin["env"] = [e for e in plugin["env"]
                     if e["name"] != "CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT"]
    plugin["volumeMounts"].remove(mount)
    pod_spec(node)["volumes"] = [v for v in pod_spec(node)["volumes"]
                                 if v["name"] != mount["name"]]
    assert node == one_of(snapshots_docs(), "DaemonSet", "csi-local-node")


def test_snapshot_metadata_rbac_covers_sidecar() -> None:
    """The sidecar runs under a ServiceAccount of its own (not the node
    plugin's); its ClusterRole grants all it uses (upstream's lacks the
    VolumeSnapshotClass rule), bound to that ServiceAccount, and nothing it
    does not: no secrets (the VolumeSnapshotClass names none), no writes."""
    docs = snapshot_metadata_docs()
    ds = _sm("DaemonSet", SM_DAEMONSET)
    sa = pod_spec(ds)["serviceAccountName"]
    assert sa != pod_spec(_sm("DaemonSet", "csi-local-node"))["serviceAccountName"]
    assert _sm("ServiceAccount", sa)["metadata"]["namespace"] == ds["metadata"]["namespace"]
    ns = ds["metadata"]["namespace"]
    missing = SM_SIDECAR_NEEDS - _granted(sa, ns, docs)
    assert not missing, f"{sa} lacks {sorted(missing)}"
    own = _rules(_sm("ClusterRole", SM_SIDECAR_ROLE))
    assert own == SM_SIDECAR_NEEDS, own ^ SM_SIDECAR_NEEDS
    binding = _sm("ClusterRoleBinding", SM_SIDECAR_ROLE)
    assert binding["roleRef"]["name"] == SM_SIDECAR_ROLE
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    for vsc in find("VolumeSnapshotClass"):
        assert not any("secret" in k for k in vsc.get("parameters", {})), vsc["metadata"]["name"]


def test_snapshot_metadata_client_roles() -> None:
    """Backup clients: reading snapshots, contents and the
    SnapshotMetadataService in one ClusterRole; the TokenRequest in another,
    alone, meant for a RoleBinding in the client's namespace (minting tokens
    cluster-wide would be far more than a backup tool needs). The variant
    binds neither: the ServiceAccounts are the user's."""
    client = _rules(_sm("ClusterRole", SM_CLIENT_ROLE))
    token = _rules(_sm("ClusterRole", SM_CLIENT_TOKEN_ROLE))
    assert SM_CLIENT_NEEDS <= client, SM_CLIENT_NEEDS - client
    assert {verb for g, _, verb in client if g} <= {"get", "list", "watch"}
    assert not any(res == "serviceaccounts/token" for _, res, _ in client)
    assert token == {("", "serviceaccounts/token", "create")}
    for doc in snapshot_metadata_docs():
        if doc["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            assert doc["roleRef"]["name"] not in (SM_CLIENT_ROLE, SM_CLIENT_TOKEN_ROLE)
    text = SM_DOCS.read_text()
    assert re.search(rf"create clusterrolebinding \S+ \\\s+--clusterrole={SM_CLIENT_ROLE} ", text)
    assert re.search(rf"create rolebinding \S+ \\\s+--clusterrole={SM_CLIENT_TOKEN_ROLE} ", text)


def test_snapshot_metadata_docs_certificate(tmp_path: Path) -> None:
    """The documented openssl commands make a CA and a server certificate that
    a client checking the SnapshotMetadataService's host name accepts, and the
    documented sed puts that CA into the SnapshotMetadataService as base64."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    text = SM_DOCS.read_text()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _sh_block(text, "openssl req -x509")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    host = _sm("SnapshotMetadataService", DRIVER)["spec"]["address"].rsplit(":", 1)[0]
    for name, ok in ((host, True), ("elsewhere.csi-local.svc", False)):
        r = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "-verify_hostname", name,
                            "tls.crt"], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                           check=False)
        assert (r.returncode == 0) == ok, (name, r.stdout + r.stderr)

    (sed,) = re.findall(r"^sed -i .*?\.yaml$", _sh_block(text, "kubectl apply -k"), re.S | re.M)
    rel = SNAPSHOT_METADATA_COMPONENT.relative_to(REPO) / "snapshotmetadataservice.yaml"
    copy = tmp_path / "repo" / rel
    copy.parent.mkdir(parents=True)
    shutil.copy(REPO / rel, copy)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", sed], cwd=tmp_path / "repo",
                       env={"PATH": "/usr/bin:/bin", "CERTS": str(tmp_path)},
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    (sms,) = [d for d in yaml.safe_load_all(copy.read_text()) if d]
    assert base64.b64decode(sms["spec"]["caCert"], validate=True) == (
        (tmp_path / "ca.crt").read_bytes())


# --- applied as shipped (issue: a cluster operator applies deploy/ as it is) ---

ALL_RENDERINGS = (K8S_DIR, *VARIANT_DIRS)


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")]


@pytest.mark.parametrize("directory", ALL_RENDERINGS, ids=lambda d: d.name)
def test_priority_classes_are_the_projects_own(directory: Path) -> None:
    """A system-* priority class outside kube-system needs a ResourceQuota
    that admits it, which many clusters (GKE) lack: every pod's class is one
    this rendering ships, below the system classes' range and never the
    cluster's default."""
    docs = kustomize_docs(directory)
    shipped = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PriorityClass"}
    used = set()
    for w in _workloads(docs):
        name = pod_spec(w).get("priorityClassName")
        assert name, f"{w['metadata']['name']}: no priorityClassName"
        assert not name.startswith("system-"), f"{w['metadata']['name']}: {name}"
        assert name in shipped, f"{w['metadata']['name']}: {name} is not shipped"
        used.add(name)
    assert used == set(shipped)
    for pc in shipped.values():
        assert pc["apiVersion"] == "scheduling.k8s.io/v1"
        assert 0 < pc["value"] <= 1_000_000_000  # the API's limit for user classes
        assert pc.get("globalDefault", False) is False
    node = pod_spec(one("DaemonSet", "csi-local-node"))["priorityClassName"]
    resizer = pod_spec(one("Deployment", "csi-local-resizer"))["priorityClassName"]
    assert shipped[node]["value"] > shipped[resizer]["value"]
    assert "PriorityClass" in (REPO / "docs" / "kubernetes.md").read_text()


def _registry_host(image: str) -> str | None:
    """The registry of an image reference, or None when it has none (the
    runtime then pulls from docker.io)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def test_top_level_kustomization_installs_the_base() -> None:
    """`kubectl apply -k deploy/kubernetes` sends the base, all of it."""
    k = kustomization(K8S_DIR)
    assert k["resources"] == ["base"]
    base = kustomization(BASE_DIR)
    listed = set(base["resources"])
    assert listed == {p.name for p in BASE_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomize_docs(K8S_DIR) == kustomize_docs(BASE_DIR)


@pytest.mark.parametrize("directory", ALL_RENDERINGS, ids=lambda d: d.name)
def test_plugin_image_is_a_pullable_reference(directory: Path) -> None:
    """The plugin image of every rendering names its registry and a tag: an
    unqualified `csi-local:0.2.0` is looked for on docker.io (ErrImagePull).
    The manifests name it only by the kustomize images entry's name."""
    images = {c["image"] for w in _workloads(kustomize_docs(directory))
              for c in pod_spec(w)["containers"] if PLUGIN_IMAGE_RE.match(c["image"])}
    (entry,) = [i for i in kustomization(BASE_DIR)["images"] if i["name"] == PLUGIN_IMAGE_NAME]
    assert images == {f"{entry.get('newName', entry['name'])}:{entry['newTag']}"}, images
    (image,) = images
    assert _registry_host(image), image
    for path in BASE_DIR.glob("*.yaml"):
        for doc in load_docs(path):
            for w in _workloads([doc]):
                for c in pod_spec(w)["containers"]:
                    if image_repo(c["image"]) == image_repo(PLUGIN_IMAGE_NAME):
                        assert c["image"] == PLUGIN_IMAGE_NAME, (path.name, c["image"])


def _yaml_block(text: str, marker: str) -> str:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"expected one yaml block with {marker!r}, found {len(blocks)}"
    return str(blocks[0])


def test_documented_image_override(tmp_path: Path) -> None:
    """The kustomization docs/kubernetes.md shows for an image pushed to a
    registry puts that image in every plugin container, and nothing else
    changes; the docs also say how the image is built and pushed."""
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "scripts/build-image -t" in docs and re.search(r"^podman .*\bpush ", docs, re.M)
    own = yaml.safe_load(_yaml_block(docs, "newName:"))
    (entry,) = own["images"]
    assert entry["name"] == PLUGIN_IMAGE_NAME
    # the docs' kustomization, taking this checkout's deploy/kubernetes
    own["resources"] = [os.path.relpath(K8S_DIR, tmp_path)]  # kustomize: relative only
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(own))
    built = kustomize_docs(tmp_path)
    wanted = f"{entry['newName']}:{entry['newTag']}"
    plugins = [c for w in _workloads(built) for c in pod_spec(w)["containers"]
               if PLUGIN_IMAGE_RE.match(c["image"])]
    # the two plugins and the node pod's vac-sync, the same image
    assert len(plugins) == 3 and {c["image"] for c in plugins} == {wanted}
    for c in plugins:
        c["image"] = "?"
    shipped = kustomize_docs(K8S_DIR)
    for w in _workloads(shipped):
        for c in pod_spec(w)["containers"]:
            if PLUGIN_IMAGE_RE.match(c["image"]):
                c["image"] = "?"
    assert built == shipped


@pytest.mark.parametrize("directory", ALL_RENDERINGS, ids=lambda d: d.name)
def test_liveness_timeouts_agree(directory: Path) -> None:
    """kubelet's timeout on a container's livenessProbe outlasts the
    livenessprobe sidecar's --probe-timeout behind that port: else a Probe
    slower than kubelet's timeout restarts the plugin before the sidecar
    answers. No sidecar uses the deprecated --health-port."""
    checked = 0
    for w in _workloads(kustomize_docs(directory)):
        containers = pod_spec(w)["containers"]
        for c in containers:
            assert not any(a.startswith("--health-port") for a in c.get("args", [])), c["name"]
        sidecars = {int(_flag(c, "--http-endpoint").rsplit(":", 1)[1]): c for c in containers
                    if image_repo(c["image"]) == "livenessprobe"}
        for c in containers:
            probe = c.get("livenessProbe", {}).get("httpGet")
            if probe is None:
                continue
            port = _resolve_port(c, probe["port"])
            if port not in sidecars:
                continue
            timeout = _flag(sidecars[port], "--probe-timeout")
            assert timeout.endswith("s") and timeout[:-1].isdigit(), timeout
            assert c["livenessProbe"]["timeoutSeconds"] > int(timeout[:-1]), c["name"]
            checked += 1
    assert checked == 1


# --- least privilege ------------------------------------------------------------

SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# The containers that call the API server (by image); every other one of the
# pods talks to kubelet, to the plugin's socket, or to nothing.
API_CALLERS = {"csi-provisioner", "csi-snapshotter", "csi-resizer", "csi-snapshot-metadata",
               "vac-sync"}


@pytest.mark.parametrize("directory", ALL_RENDERINGS, ids=lambda d: d.name)
def test_api_credentials_only_where_the_api_is_called(directory: Path) -> None:
    """No pod gets the ServiceAccount token mounted into every container: the
    pod's automount is off, and the containers that call the API server,
    and only those, mount a projected volume with what kubelet would have
    put there (a bound token, the cluster CA, the namespace) at its path."""
    seen = set()
    for w in _workloads(kustomize_docs(directory)):
        spec = pod_spec(w)
        assert spec.get("automountServiceAccountToken") is False, w["metadata"]["name"]
        for c in spec["containers"]:
            mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == SA_PATH]
            caller = ("vac-sync" if c.get("command") == VAC_SYNC_COMMAND
                      else image_repo(c["image"]))
            calls = caller in API_CALLERS
            assert bool(mounts) == calls, (w["metadata"]["name"], c["name"])
            if not mounts:
                continue
            seen.add(caller)
            (m,) = mounts
            assert m.get("readOnly") is True and "subPath" not in m
            sources = _volume(w, m["name"])["projected"]["sources"]
            token = next(s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s)
            assert token["path"] == "token" and "audience" not in token  # the API server's
            ca = next(s["configMap"] for s in sources if "configMap" in s)
            assert ca == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                                  "path": "ca.crt"}]}
            ns = next(s["downwardAPI"] for s in sources if "downwardAPI" in s)
            assert ns["items"] == [{"path": "namespace",
                                    "fieldRef": {"fieldPath": "metadata.namespace"}}]
    expected = {SNAPSHOT_METADATA_DIR: API_CALLERS,
                SNAPSHOTS_DIR: API_CALLERS - {"csi-snapshot-metadata"}}.get(
        directory, API_CALLERS - {"csi-snapshot-metadata", "csi-snapshotter"})
    assert seen == expected


def test_the_plugin_never_holds_an_api_token() -> None:
    """The plugin calls no Kubernetes API: nothing it runs reads a token. The
    one reader is `csi-local vac-sync` (csi/vac_sync.py), a command of its own
    in a container of its own (test_vac_sync_container), which only the
    command line's vac-sync branch imports."""
    src = REPO / "src" / "csi_local"
    reader = src / "csi" / "vac_sync.py"
    for path in src.rglob("*.py"):
        text = path.read_text()
        if path == reader:
            continue
        assert "serviceaccount" not in text and "kubernetes.default" not in text, path
        if "vac_sync" in text:
            assert path == src / "cli.py", path
    cli = (src / "cli.py").read_text()
    (branch,) = re.findall(r'if args.command == "vac-sync":\n(.*?)\n    if ', cli, re.S)
    assert "csi_local.csi.vac_sync" in branch


def test_vac_sync_container() -> None:
    """The node pod's vac-sync: the plugin image's vac-sync command on the
    plugin's socket, for the plugin's driver; it reads PVs and
    VolumeAttributesClasses (read only), and the resizer's plugin copy
    records nothing of a ControllerModifyVolume (docs/qos.md)."""
    ds = one("DaemonSet", "csi-local-node")
    c = container(ds, "vac-sync")
    plugin = container(ds, "csi-local")
    assert c["command"] == VAC_SYNC_COMMAND and "args" not in c
    assert c["image"] == plugin["image"]
    assert _env(c)["CSI_ENDPOINT"] == _env(plugin)["CSI_ENDPOINT"]
    assert _env(c)["CSI_LOCAL_DRIVER_NAME"]["value"] == DRIVER
    assert float(_env(c)["CSI_LOCAL_VAC_SYNC_INTERVAL"]["value"]) > 0
    assert {m["name"] for m in c["volumeMounts"]} == {"plugin-dir", "kube-api-access"}
    sa = pod_spec(ds)["serviceAccountName"]
    granted = _granted(sa, ds["metadata"]["namespace"])
    for resource in ("persistentvolumes", "volumeattributesclasses"):
        group = "" if resource == "persistentvolumes" else "storage.k8s.io"
        assert {(group, resource, v) for v in ("get", "list")} <= granted
    assert ("storage.k8s.io", "volumeattributesclasses", "update") not in granted
    resizer = one("Deployment", "csi-local-resizer")
    assert _env(container(resizer, "csi-local"))["CSI_LOCAL_MODIFY_VALIDATE_ONLY"]["value"] \
        == "true"
    assert "--feature-gates=VolumeAttributesClass=true" in container(resizer, "csi-resizer")["args"]
    assert "--feature-gates=VolumeAttributesClass=true" in \
        container(ds, "csi-provisioner")["args"]
    # the node plugin itself applies a ControllerModifyVolume
    assert "CSI_LOCAL_MODIFY_VALIDATE_ONLY" not in _env(plugin)


def test_example_volume_attributes_class() -> None:
    """The example class: valid as storage.k8s.io/v1 from Kubernetes 1.34 on
    and, with only its apiVersion changed, as v1beta1 at 1.31; for this
    driver; its parameters what ControllerModifyVolume accepts."""
    from csi_local.volumes import qos

    (vac,) = load_docs(EXAMPLES_DIR / "qos" / "volumeattributesclass.yaml")
    assert vac["driverName"] == DRIVER
    for version in [v for v in K8S_VERSIONS if tuple(map(int, v.split("."))) >= (1, 34)]:
        kubernetes_validate.validate(vac, version, strict=True)
    kubernetes_validate.validate({**vac, "apiVersion": "storage.k8s.io/v1beta1"}, K8S_VERSION,
                                 strict=True)
    assert set(vac["parameters"]) <= set(qos.CSI_PARAMETERS)
    assert all(qos.changes_from(vac["parameters"]).values())


def test_resizer_pod_runs_without_privileges() -> None:
    """Both containers of the resizer pod: no capability, no privilege
    escalation, a read-only root; what the plugin copy writes (its socket,
    state and lock directories, LVM's run-time files) is on emptyDirs."""
    dep = one("Deployment", "csi-local-resizer")
    spec = pod_spec(dep)
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc.get("privileged", False) is False, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert "add" not in sc["capabilities"]
    plugin = container(dep, "csi-local")
    env = _env(plugin)
    from csi_local.host.locks import DEFAULT_LOCK_DIR

    assert "CSI_LOCAL_LOCK_DIR" not in env
    writable = [env["CSI_ENDPOINT"]["value"].removeprefix("unix://"),
                env["CSI_LOCAL_STATE_DIR"]["value"] + "/state.json",
                DEFAULT_LOCK_DIR + "/x", "/run/lvm/hints", "/run/lock/lvm/V_vg", "/tmp/x"]
    for path in writable:
        p = PurePosixPath(path)
        mounts = [m for m in plugin["volumeMounts"]
                  if PurePosixPath(m["mountPath"]) in p.parents]
        assert mounts, f"{path} is on the read-only root"
        m = max(mounts, key=lambda m: len(m["mountPath"]))
        assert "emptyDir" in _volume(dep, m["name"]), path
        assert not m.get("readOnly")
    # the lvm shell would write its profile into /etc/lvm/profile
    assert env["CSI_LOCAL_LVM_SHELL"]["value"] == "false"


@pytest.mark.parametrize("directory", ALL_RENDERINGS, ids=lambda d: d.name)
def test_no_lib_modules_mount(directory: Path) -> None:
    """The image has no modprobe and nothing in it loads a module (the host
    does; doctor checks /proc/modules): /lib/modules is not mounted."""
    for w in _workloads(kustomize_docs(directory)):
        for v in pod_spec(w).get("volumes", []):
            assert v.get("hostPath", {}).get("path") != "/lib/modules", w["metadata"]["name"]
        for c in pod_spec(w)["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["mountPath"] != "/lib/modules", c["name"]
    nomad = (REPO / "deploy" / "nomad" / "csi-local.nomad.hcl").read_text()
    assert "/lib/modules" not in nomad


FILTER = '  global_filter = [ "r|^/dev/sdb$|" ]\n'


@pytest.mark.parametrize(("name", "edit"), [
    ("lvmlocal.conf", lambda t: t.replace("devices {\n", "devices {\n" + FILTER)),
    ("config.env", lambda t: t.replace("log-level=info", "log-level=debug")),
])
def test_a_settings_edit_rolls_the_pods(tmp_path: Path, name: str,
                                        edit: Any) -> None:
    """ConfigMap values reach a running container neither as environment
    variables nor through lvmlocal.conf's subPath mount: an edit of the
    settings must change the pod templates, so that `kubectl apply -k` rolls
    the pods over to it. The ConfigMap is generated: its name carries a hash
    of its content, and kustomize puts that name into the pods."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(K8S_DIR, copy)
    path = copy / "base" / name
    edited = edit(path.read_text())
    assert edited != path.read_text()
    path.write_text(edited)
    before, after = kustomize_docs(K8S_DIR), kustomize_docs(copy)
    old, new = generated_config_map(before), generated_config_map(after)
    assert old["metadata"]["name"] != new["metadata"]["name"]
    for kind, workload in (("DaemonSet", "csi-local-node"), ("Deployment", "csi-local-resizer")):
        (a,) = [d for d in before if (d["kind"], d["metadata"]["name"]) == (kind, workload)]
        (b,) = [d for d in after if (d["kind"], d["metadata"]["name"]) == (kind, workload)]
        text = yaml.safe_dump(b["spec"]["template"])
        assert new["metadata"]["name"] in text and old["metadata"]["name"] not in text, workload
        assert a["spec"]["template"] != b["spec"]["template"], workload
        assert f"name: {CONFIG_MAP}\n" not in text  # no reference kustomize left unhashed


def test_snapshot_metadata_cert_manager_certificate() -> None:
    """The cert-manager Certificate of docs/snapshot-metadata.md makes the
    Secret the sidecar mounts, in its namespace, for the host of the
    SnapshotMetadataService's address (clients check it), as a server
    certificate renewed before it expires."""
    docs = SM_DOCS.read_text()
    cert = yaml.safe_load(_yaml_block(docs, "kind: Certificate"))
    assert cert["apiVersion"] == "cert-manager.io/v1"
    ds = _sm("DaemonSet", SM_DAEMONSET)
    assert cert["metadata"]["namespace"] == ds["metadata"]["namespace"]
    spec = cert["spec"]
    assert spec["secretName"] == SM_SECRET
    host = _sm("SnapshotMetadataService", DRIVER)["spec"]["address"].rsplit(":", 1)[0]
    assert host in spec["dnsNames"]
    assert spec["usages"] == ["server auth"]
    assert spec["issuerRef"]["name"] and spec["issuerRef"]["kind"] in ("Issuer",
                                                                       "ClusterIssuer")
    hours = {k: int(spec[k].removesuffix("h")) for k in ("duration", "renewBefore")}
    assert 0 < hours["renewBefore"] < hours["duration"]
