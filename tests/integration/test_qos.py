"""IO limits on a real kernel (docs/qos.md).

Cgroups are laid out as kubelet makes them (systemd and cgroupfs drivers) and
as Nomad makes them on cgroup v2. A volume is published into each; a process
in the workload's cgroup writes and reads with dd (direct IO, and buffered
writes that fsync), and the rate dd measures must be within 15 % of the
limit: as created, after a ControllerModifyVolume that halves it, after one
that doubles it, and after the plugin was killed and started again. An
encrypted volume is limited on its dm-crypt device; two pods sharing a volume
each get the limit; a volume without limits leaves its workload untouched;
and a workload whose cgroup is not there never fails the publish.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.volumes import encryption
from tests.integration.conftest import PluginProcess, mount_cap, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
ROOT = Path("/sys/fs/cgroup")
RATE = 4 * MiB  # bytes a second: a dd of 8 MiB at it takes 2 s
TOLERANCE = 0.15
KEY = "qos test passphrase"
ALL_MAX = {"rbps": "max", "wbps": "max", "riops": "max", "wiops": "max"}


@pytest.fixture(scope="module")
def cgroup2() -> Path:
    """The cgroup v2 hierarchy, with the io and memory controllers handed down
    from its root (memory too: buffered writes are charged to a cgroup's
    writeback only where both are on, as under kubelet and Nomad)."""
    if not (ROOT / "cgroup.controllers").exists():
        run("mount", "-t", "cgroup2", "none", str(ROOT))
    controllers = (ROOT / "cgroup.controllers").read_text().split()
    assert {"io", "memory"} <= set(controllers), f"controllers: {controllers}"
    (ROOT / "cgroup.subtree_control").write_text("+io +memory")
    return ROOT


def make_cgroup(relative: str) -> Path:
    """A cgroup and its parents, each handing the io and memory controllers down."""
    path = ROOT
    parts = relative.split("/")
    for i, part in enumerate(parts):
        path = path / part
        path.mkdir(exist_ok=True)
        if i < len(parts) - 1:
            (path / "cgroup.subtree_control").write_text("+io +memory")
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


def numbers_of(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def lv_numbers(p: PluginProcess, vid: str) -> str:
    return numbers_of(os.path.realpath(f"/dev/{p.vg.name}/{vid}"))


def dd(cgroup: Path, *args: str) -> float:
    """dd run by a process in `cgroup`; the rate it measured, in bytes a second
    (dd's own count and clock, so the start of the process is not counted)."""
    out = subprocess.run(
        ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec dd "$@"', "dd", *args],
        capture_output=True, text=True, timeout=300, check=True).stderr
    found = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", out, re.M)
    assert found, out
    return int(found.group(1)) / float(found.group(2))


def write_rate(cgroup: Path, path: str, mib: int, direct: bool = True) -> float:
    flags = ["oflag=direct"] if direct else ["conv=fsync"]
    return dd(cgroup, "if=/dev/zero", f"of={path}", "bs=256k", f"count={mib * 4}", *flags)


def read_rate(cgroup: Path, path: str, mib: int) -> float:
    return dd(cgroup, f"if={path}", "of=/dev/null", "bs=256k", f"count={mib * 4}",
              "iflag=direct")


def assert_near(measured: float, limit: float, what: str) -> None:
    assert abs(measured - limit) <= TOLERANCE * limit, (
        f"{what}: {measured / MiB:.2f} MiB/s measured, limit {limit / MiB:.2f} MiB/s")


def wait_for_line(cgroup: Path, device: str, want: dict[str, str] | None,
                  seconds: float = 15) -> None:
    """Until the reconcile (1 s here) wrote `want` for `device` (None: no line)."""
    deadline = time.monotonic() + seconds
    while io_max(cgroup).get(device) != want:
        assert time.monotonic() < deadline, (device, want, io_max(cgroup))
        time.sleep(0.2)


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


def kubelet_pod() -> tuple[str, str]:
    """A new pod's cgroup (cgroupfs driver) and a target path of its."""
    uid = str(uuid.uuid4())
    return (f"kubepods/burstable/pod{uid}",
            f"pods/{uid}/volumes/kubernetes.io~csi/pv-{uid[:8]}/mount")


@pytest.fixture
def qos_plugin(plugin_factory: Any, cgroup2: Path) -> Iterator[PluginProcess]:
    p: PluginProcess = plugin_factory("--qos-reconcile-interval", "1",
                                      "--cgroup-root", str(cgroup2))
    yield p


def make_volume(p: PluginProcess, name: str, params: dict[str, str],
                secrets: dict[str, str] | None = None,
                mode: Any = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER) -> str:
    vid: str = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap(mode=mode)], parameters=params),
        timeout=300).volume.volume_id
    stage = p.workdir / "paths" / f"stage-{name}"
    stage.mkdir(parents=True, exist_ok=True)
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(stage), volume_capability=mount_cap(mode=mode),
        secrets=secrets or {}), timeout=300)
    return vid


def publish(p: PluginProcess, vid: str, name: str, target_shape: str,
            mode: Any = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER) -> Path:
    target = p.workdir / "paths" / target_shape
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(p.workdir / "paths" / f"stage-{name}"),
        target_path=str(target), volume_capability=mount_cap(mode=mode)))
    return target


def modify(p: PluginProcess, vid: str, **limits: str) -> None:
    p.controller.ControllerModifyVolume(pb.ControllerModifyVolumeRequest(
        volume_id=vid, mutable_parameters=limits))


def line(rbps: int | str = "max", wbps: int | str = "max", riops: int | str = "max",
         wiops: int | str = "max") -> dict[str, str]:
    return {"rbps": str(rbps), "wbps": str(wbps), "riops": str(riops), "wiops": str(wiops)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_limits_hold_follow_modify_and_survive_a_restart(qos_plugin: PluginProcess,
                                                         layout: str) -> None:
    p = qos_plugin
    relative, target_shape = LAYOUTS[layout]
    cgroup = make_cgroup(relative)
    try:
        vid = make_volume(p, f"qos-{layout}", {"readBps": str(RATE), "writeBps": str(RATE)})
        target = publish(p, vid, f"qos-{layout}", target_shape)
        device = lv_numbers(p, vid)
        assert io_max(cgroup)[device] == line(rbps=RATE, wbps=RATE)
        data = f"{target}/data"
        assert_near(write_rate(cgroup, data, 8), RATE, "direct write")
        assert_near(read_rate(cgroup, data, 8), RATE, "direct read")
        # Buffered: the page cache takes the data at once, and the fsync's
        # writeback, charged to the cgroup, goes at the limit. Its journal
        # commit is a fixed cost (some 0.5 s measured): 24 MiB makes it small.
        assert_near(write_rate(cgroup, f"{target}/buffered", 24, direct=False), RATE,
                    "buffered write + fsync")

        modify(p, vid, readBps=str(RATE // 2), writeBps=str(RATE // 2))  # halved
        wait_for_line(cgroup, device, line(rbps=RATE // 2, wbps=RATE // 2))
        assert_near(write_rate(cgroup, data, 4), RATE // 2, "direct write, halved")
        assert_near(read_rate(cgroup, data, 4), RATE // 2, "direct read, halved")

        modify(p, vid, readBps=str(RATE * 2), writeBps=str(RATE * 2))  # doubled
        wait_for_line(cgroup, device, line(rbps=RATE * 2, wbps=RATE * 2))
        assert_near(write_rate(cgroup, data, 16), RATE * 2, "direct write, doubled")

        # Killed; its line lost meanwhile (a cgroup write by someone else): the
        # new process's reconcile puts it back from the tags, no call needed.
        p.kill()
        (cgroup / "io.max").write_text(f"{device} rbps=max wbps=max riops=max wiops=max")
        assert device not in io_max(cgroup)
        p.start()
        wait_for_line(cgroup, device, line(rbps=RATE * 2, wbps=RATE * 2), seconds=60)
        assert_near(write_rate(cgroup, data, 16), RATE * 2, "direct write, after a restart")

        status = run("csi-local", "status", "--volume-group", p.vg.name, "--thin-pool",
                     p.vg.pool, "--state-dir", str(p.state_dir)).stdout
        assert f"IO limits enforced on {relative}" in status, status

        p.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(target)))
        assert device not in io_max(cgroup)
        p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=str(p.workdir / "paths" / f"stage-qos-{layout}")))
    finally:
        remove_cgroup(relative)


def test_operations_per_second(qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    relative, target_shape = kubelet_pod()
    cgroup = make_cgroup(relative)
    try:
        vid = make_volume(p, "qos-iops", {"writeIops": "100", "readIops": "200"})
        target = publish(p, vid, "qos-iops", target_shape)
        assert io_max(cgroup)[lv_numbers(p, vid)] == line(riops=200, wiops=100)
        data = f"{target}/data"
        # 4 KiB a write: 300 writes at 100 a second.
        rate = dd(cgroup, "if=/dev/zero", f"of={data}", "bs=4k", "count=300", "oflag=direct")
        assert_near(rate / 4096, 100, "writes a second (as MiB: x 4096)")
        rate = dd(cgroup, f"if={data}", "of=/dev/null", "bs=4k", "count=600", "iflag=direct")
        assert_near(rate / 4096, 200, "reads a second")
    finally:
        remove_cgroup(relative)


def test_an_encrypted_volume_is_limited_on_its_dm_crypt_device(
        qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    relative, target_shape = kubelet_pod()
    cgroup = make_cgroup(relative)
    try:
        vid = make_volume(p, "qos-crypt", {encryption.PARAMETER: encryption.LUKS2,
                                           "writeBps": str(RATE)},
                          secrets={encryption.SECRET_KEY: KEY})
        target = publish(p, vid, "qos-crypt", target_shape)
        top = numbers_of(f"/dev/mapper/{encryption.mapper_name(vid)}")
        assert io_max(cgroup) == {top: line(wbps=RATE)}  # the device the workload uses
        assert_near(write_rate(cgroup, f"{target}/data", 8), RATE, "direct write, encrypted")
    finally:
        remove_cgroup(relative)


def test_two_pods_sharing_a_volume_each_get_the_limit(qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    mode = pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER
    (first, first_target), (second, second_target) = kubelet_pod(), kubelet_pod()
    a, b = make_cgroup(first), make_cgroup(second)
    try:
        vid = make_volume(p, "qos-shared", {"writeBps": str(RATE)}, mode=mode)
        ta = publish(p, vid, "qos-shared", first_target, mode)
        tb = publish(p, vid, "qos-shared", second_target, mode)
        device = lv_numbers(p, vid)
        assert io_max(a)[device] == io_max(b)[device] == line(wbps=RATE)
        assert_near(write_rate(a, f"{ta}/a", 8), RATE, "first pod")
        assert_near(write_rate(b, f"{tb}/b", 8), RATE, "second pod")
        p.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(ta)))
        assert device not in io_max(a)
        assert io_max(b)[device] == line(wbps=RATE)  # the other pod keeps its limit
    finally:
        remove_cgroup(first)
        remove_cgroup(second)


def test_a_volume_without_limits_leaves_its_workload_untouched(
        qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    relative, target_shape = kubelet_pod()
    cgroup = make_cgroup(relative)
    try:
        vid = make_volume(p, "qos-none", {})
        target = publish(p, vid, "qos-none", target_shape)
        time.sleep(3)  # three reconcile rounds
        assert io_max(cgroup) == {}
        free = write_rate(cgroup, f"{target}/data", 16)
        assert free > 2 * RATE, f"{free / MiB:.1f} MiB/s without a limit"
        assert "not enforced" not in p.log()
    finally:
        remove_cgroup(relative)


def test_no_cgroup_never_fails_the_publish(qos_plugin: PluginProcess) -> None:
    p = qos_plugin
    vid = make_volume(p, "qos-nowhere", {"readBps": "1Mi"})
    target = publish(p, vid, "qos-nowhere",
                     f"pods/{uuid.uuid4()}/volumes/kubernetes.io~csi/pv-x/mount")
    assert os.path.ismount(target)
    assert "not enforced: no cgroup of pod" in p.log()
