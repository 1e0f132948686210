"""IO limits on a real kernel (docs/qos.md): cgroups laid out as kubelet makes
them (systemd and cgroupfs drivers) and as Nomad makes them on cgroup v2, a
volume published into each, its limits read back from io.max, a direct-IO dd
inside the workload's cgroup taking as long as the limit says, a
ControllerModifyVolume reaching io.max through the reconcile, and the line
gone after the unpublish."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import PluginProcess, mount_cap, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
ROOT = Path("/sys/fs/cgroup")
WBPS = 2 * MiB  # a dd of 8 MiB at this takes about 4 s


@pytest.fixture(scope="module")
def cgroup2() -> Path:
    """The cgroup v2 hierarchy, with the io controller handed down from its root."""
    if not (ROOT / "cgroup.controllers").exists():
        run("mount", "-t", "cgroup2", "none", str(ROOT))
    assert "io" in (ROOT / "cgroup.controllers").read_text().split(), "no io controller"
    (ROOT / "cgroup.subtree_control").write_text("+io")
    return ROOT


def make_cgroup(relative: str) -> Path:
    """A cgroup and its parents, each handing the io controller down."""
    path = ROOT
    for part in relative.split("/"):
        path = path / part
        path.mkdir(exist_ok=True)
        if part != relative.rsplit("/", 1)[-1]:
            (path / "cgroup.subtree_control").write_text("+io")
    return path


def remove_cgroup(relative: str) -> None:
    parts = relative.split("/")
    for i in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:i])
        if path.exists() and not any(p.is_dir() for p in path.iterdir()):
            path.rmdir()


def io_max(cgroup: Path) -> dict[str, dict[str, str]]:
    out = {}
    for line in (cgroup / "io.max").read_text().splitlines():
        device, *keys = line.split()
        out[device] = dict(k.split("=", 1) for k in keys)
    return out


def device_of(p: PluginProcess, vid: str) -> str:
    lv = run("lvs", "--noheadings", "-o", "lv_kernel_major,lv_kernel_minor",
             f"{p.vg.name}/{vid}").stdout.split()
    return f"{lv[0]}:{lv[1]}"


def dd_seconds(cgroup: Path, path: str) -> float:
    """A direct-IO write of 8 MiB to `path` by a process in `cgroup`."""
    start = time.monotonic()
    subprocess.run(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec dd if=/dev/zero '
                    f'of={path} bs=1M count=8 oflag=direct status=none'], check=True,
                   timeout=120)
    return time.monotonic() - start


UID = str(uuid.uuid4())
ALLOC = str(uuid.uuid4())
LAYOUTS = {
    "kubelet-systemd": (
        f"kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{UID.replace('-', '_')}.slice",
        f"pods/{UID}/volumes/kubernetes.io~csi/pv-qos/mount"),
    "kubelet-cgroupfs": (f"kubepods/besteffort/pod{UID}",
                         f"pods/{UID}/volumes/kubernetes.io~csi/pv-qos/mount"),
    "nomad": (f"nomad.slice/share.slice/{ALLOC}.app.scope",
              f"per-alloc/{ALLOC}/data/rw-file-system-single-node-writer"),
}


@pytest.fixture
def qos_plugin(plugin_factory: Any, cgroup2: Path) -> Iterator[PluginProcess]:
    p: PluginProcess = plugin_factory("--qos-reconcile-interval", "1",
                                      "--cgroup-root", str(cgroup2))
    yield p


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_publish_limits_the_workload(qos_plugin: PluginProcess, layout: str) -> None:
    p = qos_plugin
    relative, target_shape = LAYOUTS[layout]
    cgroup = make_cgroup(relative)
    try:
        vid = p.controller.CreateVolume(pb.CreateVolumeRequest(
            name=f"qos-{layout}", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
            volume_capabilities=[mount_cap()],
            parameters={"writeBps": str(WBPS), "readIops": "100"})).volume.volume_id
        paths = p.workdir / "paths"
        stage, target = paths / "stage", paths / target_shape
        stage.mkdir(parents=True, exist_ok=True)
        p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=vid, staging_target_path=str(stage), volume_capability=mount_cap()))
        p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=str(stage), target_path=str(target),
            volume_capability=mount_cap()))
        device = device_of(p, vid)
        assert io_max(cgroup)[device] == {"rbps": "max", "wbps": str(WBPS), "riops": "100",
                                          "wiops": "max"}
        seconds = dd_seconds(cgroup, f"{target}/data")
        assert seconds >= 8 * MiB / WBPS * 0.75, seconds  # throttled
        assert seconds < 8 * MiB / WBPS * 4, seconds

        # A modify reaches io.max through the reconcile (interval 1 s here).
        p.controller.ControllerModifyVolume(pb.ControllerModifyVolumeRequest(
            volume_id=vid, mutable_parameters={"writeBps": "max", "writeIops": "50"}))
        deadline = time.monotonic() + 10
        while io_max(cgroup).get(device, {}).get("wiops") != "50":
            assert time.monotonic() < deadline, io_max(cgroup)
            time.sleep(0.2)
        assert io_max(cgroup)[device]["wbps"] == "max"

        status = run("csi-local", "status", "--volume-group", p.vg.name, "--thin-pool",
                     p.vg.pool, "--state-dir", str(p.state_dir)).stdout
        assert f"IO limits enforced on {relative}" in status, status

        p.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(target)))
        assert device not in io_max(cgroup)
        p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=str(stage)))
    finally:
        remove_cgroup(relative)


def test_no_cgroup_never_fails_the_publish(qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    vid = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name="qos-nowhere", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap()], parameters={"readBps": "1Mi"})).volume.volume_id
    paths = p.workdir / "paths"
    stage = paths / "stage-nowhere"
    target = paths / f"pods/{uuid.uuid4()}/volumes/kubernetes.io~csi/pv-x/mount"
    stage.mkdir(parents=True, exist_ok=True)
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(stage), volume_capability=mount_cap()))
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(stage), target_path=str(target),
        volume_capability=mount_cap()))
    assert os.path.ismount(target)
    assert "not enforced: no cgroup of pod" in p.log()
