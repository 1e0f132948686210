"""Nomad job and volume specifications: they parse, and every key is a real
field of its block (field names from Nomad's job and volume specification
docs and the HCL decoders in hashicorp/nomad: jobspec2, api/csi.go,
api/host_volumes.go, command/volume_register_csi.go)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import hcl2
import pytest

from csi_local.dhv.request import parse_parameters
from csi_local.volumes import qos
from tests.deploy._deploy import (
    BASE_DIR,
    NOMAD_DIR,
    PLUGIN_IMAGE_NAME,
    REPO,
    TOPOLOGY_KEY,
    blocks,
    check_classes_shape,
    hcl_list,
    kustomization,
    labelled,
    load_hcl,
    nomad_plugin_invocations,
    nomad_plugin_tasks,
    plugin_memory_limits,
    run_lvm,
    unquote,
)

# --- field names -------------------------------------------------------------

JOB_FILE_TOP = {"job", "variable", "locals"}
VARIABLE = {"type", "default", "description", "validation", "sensitive", "nullable"}
JOB = {
    "all_at_once", "constraint", "affinity", "datacenters", "group", "meta", "migrate",
    "multiregion", "namespace", "node_pool", "parameterized", "periodic", "priority",
    "region", "reschedule", "spread", "type", "update", "vault", "consul", "ui", "name",
    "vault_token", "consul_token", "dynamic",
}
DYNAMIC = {"for_each", "labels", "iterator", "content"}
GROUP = {
    "count", "constraint", "affinity", "consul", "disconnect", "ephemeral_disk",
    "max_client_disconnect", "meta", "migrate", "network", "reschedule", "restart",
    "service", "shutdown_delay", "stop_after_client_disconnect", "task", "volume",
    "scaling", "spread", "update", "prevent_reschedule_on_lost", "dynamic",
}
CONSTRAINT = {"attribute", "operator", "value", "distinct_hosts", "distinct_property",
              "regexp", "set_contains", "version", "semver"}
RESTART = {"attempts", "delay", "interval", "mode", "render_templates"}
TASK = {
    "action", "affinity", "artifact", "config", "constraint", "consul", "csi_plugin",
    "dispatch_payload", "driver", "env", "identity", "kill_signal", "kill_timeout", "kind",
    "leader", "lifecycle", "logs", "meta", "resources", "restart", "scaling", "schedule",
    "service", "shutdown_delay", "template", "user", "vault", "volume_mount", "dynamic",
}
CSI_PLUGIN = {"id", "type", "mount_dir", "stage_publish_base_dir", "health_timeout"}
TEMPLATE = {"change_mode", "change_signal", "change_script", "data", "destination", "env",
            "error_on_missing_key", "left_delimiter", "right_delimiter", "perms", "uid", "gid",
            "source", "splay", "vault_grace", "wait", "once"}
RESOURCES = {"cpu", "cores", "memory", "memory_max", "device", "numa", "secrets"}
# docker task driver: the keys this repository uses, all documented config options
DOCKER_CONFIG = {
    "image", "args", "command", "entrypoint", "privileged", "mount", "volumes",
    "network_mode", "ipc_mode", "pid_mode", "cap_add", "devices", "force_pull", "labels",
    "logging", "work_dir", "image_pull_timeout", "readonly_rootfs", "security_opt", "ports",
}
DOCKER_MOUNT = {"type", "target", "source", "readonly", "bind_options", "volume_options",
                "tmpfs_options"}
GROUP_VOLUME = {"type", "source", "read_only", "access_mode", "attachment_mode",
                "mount_options", "per_alloc", "sticky"}
VOLUME_MOUNT = {"volume", "destination", "read_only", "propagation_mode", "selinux_label"}

CSI_VOLUME = {
    "id", "name", "namespace", "type", "plugin_id", "external_id", "snapshot_id", "clone_id",
    "capacity_min", "capacity_max", "capability", "mount_options", "topology_request",
    "secrets", "parameters", "context",
}
HOST_VOLUME = {
    "id", "name", "namespace", "type", "plugin_id", "node_pool", "node_id", "constraint",
    "capacity", "capacity_min", "capacity_max", "capability", "parameters", "host_path",
}
CAPABILITY = {"access_mode", "attachment_mode"}
MOUNT_OPTIONS = {"fs_type", "mount_flags"}
TOPOLOGY_REQUEST = {"required", "preferred"}
TOPOLOGY_LIST = {"topology"}
TOPOLOGY = {"segments"}
ACCESS_MODES = {"single-node-reader-only", "single-node-writer", "multi-node-reader-only",
                "multi-node-single-writer", "multi-node-multi-writer"}
ATTACHMENT_MODES = {"file-system", "block-device"}


def keys(body: dict[str, Any]) -> set[str]:
    # python-hcl2 adds bookkeeping keys such as __is_block__ and __comments__
    return {k for k in body if not k.startswith("__")}


def check(body: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = keys(body) - allowed
    assert not unknown, f"{where}: not a Nomad field: {sorted(unknown)}"


# --- job files ---------------------------------------------------------------


def job_files() -> list[Path]:
    return sorted(NOMAD_DIR.glob("*.nomad.hcl"))


def volume_files() -> list[Path]:
    return sorted(p for p in NOMAD_DIR.glob("*.hcl") if not p.name.endswith(".nomad.hcl"))


def test_files_exist() -> None:
    names = {p.name for p in NOMAD_DIR.glob("*.hcl")}
    assert {"csi-local.nomad.hcl", "volume.hcl", "volume-from-snapshot.hcl",
            "volume-clone.hcl", "host-volume.hcl", "volume-fast.hcl",
            "host-volume-fast.hcl"} <= names, names
    assert (NOMAD_DIR / "classes.toml").is_file()


def _check_task(t: dict[str, Any], where: str) -> None:
    check(t, TASK, where)
    for cfg in blocks(t, "config"):
        if unquote(t.get("driver")) == "docker":
            check(cfg, DOCKER_CONFIG, f"{where}.config")
            for m in blocks(cfg, "mount"):
                check(m, DOCKER_MOUNT, f"{where}.config.mount")
    for p in blocks(t, "csi_plugin"):
        check(p, CSI_PLUGIN, f"{where}.csi_plugin")
    for r in blocks(t, "resources"):
        check(r, RESOURCES, f"{where}.resources")
    for vm in blocks(t, "volume_mount"):
        check(vm, VOLUME_MOUNT, f"{where}.volume_mount")
    for c in blocks(t, "constraint"):
        check(c, CONSTRAINT, f"{where}.constraint")
    for tpl in blocks(t, "template"):
        check(tpl, TEMPLATE, f"{where}.template")
    for d in blocks(t, "dynamic"):
        kind, dbody = labelled(d)
        assert kind == "template", f"{where}: dynamic {kind}"
        check(dbody, DYNAMIC, f"{where}.dynamic")
        for content in blocks(dbody, "content"):
            check(content, TEMPLATE, f"{where}.dynamic[template].content")


def _check_group(g: dict[str, Any], where: str) -> None:
    check(g, GROUP, where)
    for c in blocks(g, "constraint"):
        check(c, CONSTRAINT, f"{where}.constraint")
    for r in blocks(g, "restart"):
        check(r, RESTART, f"{where}.restart")
    for v in blocks(g, "volume"):
        _, vbody = labelled(v)
        check(vbody, GROUP_VOLUME, f"{where}.volume")
    for t in blocks(g, "task"):
        name, tbody = labelled(t)
        _check_task(tbody, f"{where}.task[{name}]")


@pytest.mark.parametrize("path", job_files(), ids=lambda p: p.name)
def test_job_fields(path: Path) -> None:
    doc = load_hcl(path)
    check(doc, JOB_FILE_TOP, path.name)
    for v in blocks(doc, "variable"):
        _, vbody = labelled(v)
        check(vbody, VARIABLE, f"{path.name}.variable")
    jobs = blocks(doc, "job")
    assert len(jobs) == 1
    name, job = labelled(jobs[0])
    where = f"{path.name}:job[{name}]"
    check(job, JOB, where)
    for g in blocks(job, "group"):
        gname, gbody = labelled(g)
        _check_group(gbody, f"{where}.group[{gname}]")
    for d in blocks(job, "dynamic"):
        kind, dbody = labelled(d)
        assert kind == "group", f"{where}: dynamic {kind}"
        check(dbody, DYNAMIC, f"{where}.dynamic")
        for content in blocks(dbody, "content"):
            _check_group(content, f"{where}.dynamic[group].content")


def test_field_check_catches_a_typo() -> None:
    doc = hcl2.loads('csi_plugin {\n  id = "x"\n  typ = "monolith"\n}\n')
    with pytest.raises(AssertionError, match="typ"):
        check(blocks(doc, "csi_plugin")[0], CSI_PLUGIN, "csi_plugin")


def test_plugin_job_is_per_node_monolith() -> None:
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    doc = load_hcl(path)
    _, job = labelled(blocks(doc, "job")[0])
    assert unquote(job["type"]) == "system"
    # one group per node, generated from the "nodes" variable
    dyn = [labelled(d) for d in blocks(job, "dynamic")]
    assert [k for k, _ in dyn] == ["group"]
    dbody = dyn[0][1]
    assert dbody["for_each"] == "${var.nodes}"
    content = blocks(dbody, "content")[0]
    constraint = blocks(content, "constraint")[0]
    assert unquote(constraint["attribute"]) == "${node.unique.name}"
    assert constraint["value"] == "${group.value}"

    tasks = list(nomad_plugin_tasks(path))
    assert len(tasks) == 1
    _, task = tasks[0]
    assert unquote(task["driver"]) == "docker"
    cfg = blocks(task, "config")[0]
    assert cfg["privileged"] is True
    plugin = blocks(task, "csi_plugin")[0]
    assert unquote(plugin["type"]) == "monolith"
    for field in ("mount_dir", "stage_publish_base_dir", "health_timeout"):
        assert unquote(plugin.get(field)), field
    plugin_id = unquote(plugin["id"])
    # Nomad registers csi_plugin.id verbatim (no ${node.*}/${attr.*}
    # interpolation): the per-node part must be resolved at parse time.
    assert "${node." not in plugin_id and "${attr." not in plugin_id
    assert plugin_id == "csi-local-${group.value}"
    # the plugin's node id is the node name used in topology segments
    args = hcl_list(cfg["args"], set_variable=False)
    assert "--node-id=${node.unique.name}" in args
    assert f"--endpoint=unix://{unquote(plugin['mount_dir'])}/csi.sock" in args
    targets = {unquote(m["target"]) for m in blocks(cfg, "mount")}
    assert {"/run/lock/lvm", "/run/lvm", "/etc/lvm/backup", "/etc/lvm/archive",
            "/var/lib/csi-local"} <= targets


def test_plugin_job_needs_a_docker_that_allows_its_task() -> None:
    """The task is a privileged docker container with bind mounts: the job
    is constrained on the attributes the docker driver fingerprints when its
    client allows both, so placement fails with that reason on a client
    that does not (rather than the task failing at start)."""
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    _, job = labelled(blocks(load_hcl(path), "job")[0])
    required = {unquote(c["attribute"]): unquote(c["value"]) for c in blocks(job, "constraint")
                if unquote(c.get("operator", "=")) in ("=", "==")}
    assert required == {"${attr.driver.docker.privileged.enabled}": "true",
                        "${attr.driver.docker.volumes.enabled}": "true"}, required
    ((_, task),) = nomad_plugin_tasks(path)
    cfg = blocks(task, "config")[0]
    assert unquote(task["driver"]) == "docker" and cfg["privileged"] is True
    assert any(unquote(m["type"]) == "bind" and unquote(m["source"]).startswith("/")
               for m in blocks(cfg, "mount"))
    docs = (REPO / "docs" / "nomad.md").read_text()
    for attribute in required:
        assert attribute.removeprefix("${attr.").removesuffix("}") in docs, attribute


def test_plugin_image_is_the_kubernetes_one() -> None:
    """The job's default image is the one the Kubernetes manifests run (the
    kustomize images entry: its name and tag), named with its registry: the
    docker driver takes `csi-local:0.2.0` for docker.io/library/csi-local and
    pulls it, which fails. The docs' and README's commands build and load
    that same image."""
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    variables = dict(labelled(v) for v in blocks(load_hcl(path), "variable"))
    (entry,) = [i for i in kustomization(BASE_DIR)["images"] if i["name"] == PLUGIN_IMAGE_NAME]
    image = f"{entry.get('newName', entry['name'])}:{entry['newTag']}"
    assert unquote(variables["image"]["default"]) == image
    assert image.startswith("localhost/"), image
    readme = (REPO / "README.md").read_text()
    nomad_readme = readme.split("### Nomad (CSI)", 1)[1].split("\n### ", 1)[0]
    docs = (REPO / "docs" / "nomad.md").read_text()
    for where, text in (("docs/nomad.md", docs), ("README.md", nomad_readme)):
        assert f"scripts/build-image -t {image}" in text, where
        commands = "".join(re.findall(r"```sh\n(.*?)```", text, re.S))
        named = set(re.findall(r"[\w./-]*csi-local:[\w.-]+", commands))
        # a registry of the operator's own, passed with -var image=...
        assert named <= {image, "registry.example.com/csi-local:0.2.0"}, (where, named)
    assert f"podman --storage-driver vfs save -o csi-local.tar {image}" in docs


def test_plugin_memory_is_the_kubernetes_limit() -> None:
    """The Nomad task may use as much memory as the Kubernetes node
    container: the same plugin stages the same volumes (an encrypted stage
    runs cryptsetup's argon2id at 64 MiB on top of the idle plugin, which
    128 MB did not hold). tests/integration/test_encryption.py measures that
    stage against these limits."""
    limits = plugin_memory_limits()
    nomad = {k: v for k, v in limits.items() if k.startswith("csi-local.nomad.hcl:")}
    assert nomad and set(nomad.values()) == {limits["node.yaml:csi-local"]}, limits


# --- volume specifications ---------------------------------------------------


@pytest.mark.parametrize("path", volume_files(), ids=lambda p: p.name)
def test_volume_spec_fields(path: Path) -> None:
    doc = load_hcl(path)
    vtype = unquote(doc["type"])
    check(doc, CSI_VOLUME if vtype == "csi" else HOST_VOLUME, path.name)
    for cap in blocks(doc, "capability"):
        check(cap, CAPABILITY, f"{path.name}.capability")
        assert unquote(cap["access_mode"]) in ACCESS_MODES
        assert unquote(cap["attachment_mode"]) in ATTACHMENT_MODES
    for mo in blocks(doc, "mount_options"):
        check(mo, MOUNT_OPTIONS, f"{path.name}.mount_options")
    for tr in blocks(doc, "topology_request"):
        check(tr, TOPOLOGY_REQUEST, f"{path.name}.topology_request")
        for kind in ("required", "preferred"):
            for lst in blocks(tr, kind):
                check(lst, TOPOLOGY_LIST, f"{path.name}.{kind}")
                for topo in blocks(lst, "topology"):
                    check(topo, TOPOLOGY, f"{path.name}.{kind}.topology")


def _segments(doc: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for tr in blocks(doc, "topology_request"):
        for lst in blocks(tr, "required"):
            for topo in blocks(lst, "topology"):
                for seg in blocks(topo, "segments"):
                    out.append({unquote(k): unquote(v) for k, v in keys_items(seg)})
    return out


def keys_items(d: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in d.items() if not k.startswith("__")]


@pytest.mark.parametrize(
    "path", [p for p in volume_files() if not p.name.startswith("host-volume")],
    ids=lambda p: p.name)
def test_csi_volume_targets_one_node(path: Path) -> None:
    doc = load_hcl(path)
    assert unquote(doc["type"]) == "csi"
    for field in ("id", "name", "plugin_id", "capacity_min", "capacity_max"):
        assert unquote(doc.get(field)), f"{path.name}: {field}"
    assert blocks(doc, "capability")
    plugin_id = unquote(doc["plugin_id"])
    assert plugin_id.startswith("csi-local-")
    node = plugin_id.removeprefix("csi-local-")
    # the volume's node plugin and its requested topology name the same node
    assert _segments(doc) == [{TOPOLOGY_KEY: node}]


def test_snapshot_and_clone_examples() -> None:
    snap = load_hcl(NOMAD_DIR / "volume-from-snapshot.hcl")
    clone = load_hcl(NOMAD_DIR / "volume-clone.hcl")
    assert unquote(snap.get("snapshot_id")) and "clone_id" not in snap
    assert unquote(clone.get("clone_id")) and "snapshot_id" not in clone


def test_host_volume_uses_dhv_plugin() -> None:
    doc = load_hcl(NOMAD_DIR / "host-volume.hcl")
    assert unquote(doc["type"]) == "host"
    assert unquote(doc["plugin_id"]) == "csi-local-dhv"
    params = blocks(doc, "parameters")[0]
    assert set(keys(params)) <= {"fs_type", "mount_options"}
    assert unquote(params["fs_type"]) in ("ext4", "xfs", "btrfs")


# --- device classes ------------------------------------------------------------

CLASSES_TOML = NOMAD_DIR / "classes.toml"
# csi-local-dhv's parameters (docs/nomad-host-volumes.md) and the CSI plugin's
# own CreateVolume parameters (others but csi.storage.k8s.io/* are refused)
DHV_PARAMETERS = {"fs_type", "mount_options", "source_volume", "source_snapshot",
                  "attachment_mode", "device_class"}
CSI_PARAMETERS = {"deviceClass", *qos.CSI_PARAMETERS}


def _classes() -> dict[str, dict[str, Any]]:
    return check_classes_shape(tomllib.loads(CLASSES_TOML.read_text()), CLASSES_TOML.name)


def test_classes_example_parses_with_the_plugins_parser() -> None:
    from csi_local.volumes.device_classes import parse_classes

    parsed = parse_classes(CLASSES_TOML.read_text(), source="classes.toml")
    assert sorted(parsed.names) == sorted(_classes())


def _parameters(path: Path) -> dict[str, str]:
    doc = load_hcl(path)
    params = blocks(doc, "parameters")
    return {k: unquote(v) for k, v in keys_items(params[0])} if params else {}


@pytest.mark.parametrize("path", volume_files(), ids=lambda p: p.name)
def test_volume_parameters_are_the_plugins(path: Path) -> None:
    """Every parameter is one the plugin takes (it refuses the others), and a
    device class is one the example classes.toml defines."""
    host = unquote(load_hcl(path)["type"]) == "host"
    params = _parameters(path)
    unknown = set(params) - (DHV_PARAMETERS if host else CSI_PARAMETERS)
    assert not unknown, f"{path.name}: {sorted(unknown)}"
    cls = params.get("device_class" if host else "deviceClass")
    if cls is not None:
        assert cls in _classes(), f"{path.name}: no class {cls!r} in {CLASSES_TOML.name}"


def test_device_class_examples() -> None:
    assert _parameters(NOMAD_DIR / "volume-fast.hcl")["deviceClass"] == "fast"
    # its IO limits are values CreateVolume takes
    assert all(qos.changes_from(_parameters(NOMAD_DIR / "volume-fast.hcl")).values())
    host = _parameters(NOMAD_DIR / "host-volume-fast.hcl")
    assert host["device_class"] == "fast"
    # otherwise as host-volume.hcl
    doc = load_hcl(NOMAD_DIR / "host-volume-fast.hcl")
    plain = load_hcl(NOMAD_DIR / "host-volume.hcl")
    assert unquote(doc["plugin_id"]) == unquote(plain["plugin_id"]) == "csi-local-dhv"
    assert blocks(doc, "constraint") == blocks(plain, "constraint")


def test_plugin_job_takes_device_classes() -> None:
    """classes_toml set: --config names the file its template writes, and no
    --volume-group/--thin-pool (both at once is an error at start); unset: the
    flags as before, and no template (one with empty data is an invalid job)."""
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    variables = dict(labelled(v) for v in blocks(load_hcl(path), "variable"))
    assert unquote(variables["classes_toml"]["default"]) == ""
    ((_, task),) = nomad_plugin_tasks(path)
    args = blocks(task, "config")[0]["args"]

    unset = hcl_list(args, set_variable=False)
    assert "--volume-group=${var.volume_group}" in unset
    assert "--thin-pool=${var.thin_pool}" in unset
    assert not any(a.startswith("--config") for a in unset)

    given = hcl_list(args, set_variable=True)
    assert not any(a.startswith(("--volume-group", "--thin-pool")) for a in given)
    (config,) = [a.split("=", 1)[1] for a in given if a.startswith("--config=")]
    # the rest is the same either way
    assert [a for a in given if not a.startswith("--config=")] == (
        [a for a in unset if not a.startswith(("--volume-group=", "--thin-pool="))])

    (dynamic,) = [labelled(d) for d in blocks(task, "dynamic")]
    kind, body = dynamic
    assert kind == "template"
    assert body["for_each"] == '${var.classes_toml == "" ? [] : [var.classes_toml]}'
    (content,) = blocks(body, "content")
    assert content["data"] == "${template.value}"
    # a template's destination is relative to the task directory, which the
    # container sees as NOMAD_TASK_DIR (/local)
    destination = unquote(content["destination"])
    assert destination.startswith("local/")
    assert config == "${NOMAD_TASK_DIR}/" + destination.removeprefix("local/")
    # the docs' and the job's command lines pass the example file
    for text in (path.read_text(), (REPO / "docs" / "nomad.md").read_text()):
        assert '-var="classes_toml=$(cat deploy/nomad/classes.toml)"' in text


def test_golden_clone_example_is_what_the_plugin_accepts() -> None:
    doc = load_hcl(NOMAD_DIR / "host-volume-clone.hcl")
    assert unquote(doc["type"]) == "host" and unquote(doc["plugin_id"]) == "csi-local-dhv"
    assert unquote(doc["name"]) == "db[0]"  # per_alloc's name for allocation 0 of "db"
    params = {k: unquote(v) for k, v in blocks(doc, "parameters")[0].items()
              if not k.startswith("__")}
    # the plugin's own parser accepts them (the one home of the parameter rules)
    parsed = parse_parameters(json.dumps(params))
    assert parsed.source == ("snapshot", params["source_snapshot"])
    job = load_hcl(NOMAD_DIR / "golden.nomad.hcl")
    _, body = labelled(blocks(job, "job")[0])
    _, group = labelled(blocks(body, "group")[0])
    _, volume = labelled(blocks(group, "volume")[0])
    assert volume["per_alloc"] is True and unquote(volume["type"]) == "host"
    assert unquote(volume["source"]) + "[0]" == unquote(doc["name"])


def test_plugin_task_honours_the_hosts_device_selection(tmp_path: Path) -> None:
    """As on Kubernetes: the client's devices file and multipath WWIDs are
    mounted, its filters come in through lvm_local_conf -> lvmlocal.conf."""
    path = NOMAD_DIR / "csi-local.nomad.hcl"
    ((_, task),) = nomad_plugin_tasks(path)
    cfg = blocks(task, "config")[0]
    mounts = {unquote(m["target"]): m for m in blocks(cfg, "mount")}
    assert unquote(mounts["/etc/lvm/devices"]["source"]) == "/etc/lvm/devices"
    assert not mounts["/etc/lvm/devices"].get("readonly")  # LVM updates the devices file
    assert unquote(mounts["/etc/multipath"]["source"]) == "/etc/multipath"
    assert mounts["/etc/multipath"].get("readonly") is True
    local = mounts["/etc/lvm/lvmlocal.conf"]
    assert local.get("readonly") is True
    (template,) = blocks(task, "template")
    # docker bind sources that are relative are relative to the task directory,
    # where template destinations are too
    assert unquote(template["destination"]) == unquote(local["source"]) == "local/lvmlocal.conf"
    assert template["data"] == "${var.lvm_local_conf}"
    variables = dict(labelled(v) for v in blocks(load_hcl(path), "variable"))
    default = unquote(variables["lvm_local_conf"]["default"])
    default = default.encode().decode("unicode_escape")  # HCL's \n escapes
    r = run_lvm(tmp_path, "lvmconfig", "--validate", lvmlocal=default)
    assert r.returncode == 0, r.stdout + r.stderr
    # the docs' example, passed with -var, is valid LVM configuration too
    docs = (REPO / "docs" / "nomad.md").read_text()
    example = docs.split("-var='lvm_local_conf=", 1)[1].split("'", 1)[0]
    r = run_lvm(tmp_path, "lvmconfig", "devices/global_filter", lvmlocal=example)
    assert r.stdout.strip() == 'global_filter="r|^/dev/sdb$|"', r.stdout + r.stderr


def test_kill_timeout_within_the_clients_default_cap() -> None:
    """A Nomad client caps kill_timeout at its max_kill_timeout (30 s unless
    set), silently: the plugin job asks for no more, and the docs say how to
    raise both. (The plugin's own grace fits in it: test_plugin_flags.py.)"""
    found = [inv.kill_timeout for inv in nomad_plugin_invocations()]
    assert found and all(t <= 30 for t in found), found
    docs = (REPO / "docs" / "nomad.md").read_text()
    assert "max_kill_timeout" in docs


def test_host_volume_quick_start_writes_the_configuration(tmp_path: Path) -> None:
    """docs/nomad.md's walk-through to a host volume installs the plugin with
    `csi-local-dhv install` (which writes its configuration), restarts the
    client before creating the volume, and never just links the plugin in
    (a plugin without configuration fails its first create). Its install
    command, run here into a scratch directory, writes a configuration the
    plugin loads."""
    import shlex
    import subprocess
    import sys

    from csi_local.dhv.config import load_config

    docs = (REPO / "docs" / "nomad.md").read_text()
    section = docs.split("## Dynamic host volumes", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert "ln -s" not in block
    lines = block.replace("\\\n", " ").splitlines()
    install = next(ln for ln in lines if "csi-local-dhv install" in ln).split("#", 1)[0]
    order = [i for i, ln in enumerate(lines)
             if "csi-local-dhv install" in ln or "restart nomad" in ln
             or "nomad volume create" in ln]
    assert len(order) == 3 and order == sorted(order), lines
    argv = shlex.split(install)
    assert argv[0].endswith("/csi-local-dhv") and argv[1] == "install", argv
    plugin_dir = argv[argv.index("--plugin-dir") + 1]
    assert plugin_dir.endswith("/host_volume_plugins")
    args = [a if a != plugin_dir else str(tmp_path) for a in argv[2:]]
    dhv = Path(sys.executable).parent / "csi-local-dhv"
    r = subprocess.run([str(dhv), "install", *args], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    config = load_config(str(tmp_path), str(tmp_path / "csi-local-dhv"))
    assert (config.volume_group, config.thin_pool) == ("csilocal", "pool")
    volume = (NOMAD_DIR / "host-volume.hcl").read_text()
    assert 'plugin_id = "csi-local-dhv"' in volume
