"""Issue: data-safety and security defects, proven on the host with fake runners.

Each test here fails on the code before the fix: mkfs on an unreadable or used
device, a missing VG read as "LV gone", state files of the wrong shape,
hostile IDs reaching paths, symlinked and system paths, lock files any user
could hold, and mount options that turn mount into something else.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config
from csi_local.csi import validation
from csi_local.csi.controller_servicer import ControllerServicer
from csi_local.csi.dependencies import Backend
from csi_local.csi.node_servicer import NodeServicer
from csi_local.csi.pagination import Paginator
from csi_local.csi.rpc import InvalidArgument, status_of
from csi_local.dhv import request as dhv_request
from csi_local.dhv.request import DhvError, parse_mount_options
from csi_local.errors import (
    CommandError,
    FormatRefused,
    LockDirError,
    MountOptionError,
    VolumeGroupMissing,
)
from csi_local.host import filesystem_rules as fsrules
from csi_local.host import mounts
from csi_local.host.cgroups import Cgroups
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.nodestate.recovery import FOREIGN, PUBLISH, STAGING, UNKNOWN, classify, rebuild_state
from csi_local.nodestate.state_file import StateStore
from csi_local.storage.lvm import Lvm, check_name, check_tag
from csi_local.volumes import naming
from csi_local.volumes.device_classes import check_class_name
from csi_local.volumes.node_records import Publish
from csi_local.volumes.pool import Pool, Pools
from tests.unit.conftest import FakeRunner

VOL = "csi-v-" + "c" * 32
VG_MISSING = '  Volume group "vg0" not found\n  Cannot process volume group vg0\n'


# 1. mkfs only on a never-used, readable volume ------------------------------------------


def test_blkid_nothing_found_on_used_volume_never_formats(runner: FakeRunner) -> None:
    runner.on(["blkid"], rc=2)
    with pytest.raises(FormatRefused, match="used before"):
        Filesystems(runner, Kernel()).ensure_filesystem("/dev/vg0/x", "ext4", fresh=False)
    assert not [c for c in runner.calls if c[0].startswith(("mkfs", "wipefs"))]


def test_blkid_exit_2_on_unreadable_fresh_device_never_formats(
        runner: FakeRunner, tmp_path: Path) -> None:
    # blkid exits 2 for "cannot open/read" as for "nothing found".
    runner.on(["blkid"], rc=2)
    with pytest.raises(FormatRefused, match="cannot read"):
        Filesystems(runner, Kernel()).ensure_filesystem(str(tmp_path / "gone"), "ext4", fresh=True)
    assert not [c for c in runner.calls if c[0].startswith("mkfs")]


def test_blkid_timeout_never_formats(runner: FakeRunner) -> None:
    runner.replies[("blkid",)] = [CommandError(("blkid",), -9, "", "timed out", timed_out=True)]
    with pytest.raises(CommandError):
        Filesystems(runner, Kernel()).ensure_filesystem("/dev/vg0/x", "ext4", fresh=True)
    assert not [c for c in runner.calls if c[0].startswith("mkfs")]


def test_fresh_readable_blank_device_is_formatted(runner: FakeRunner, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_bytes(b"\0" * 4096)
    runner.on(["blkid"], rc=2)
    runner.on(["mkfs.ext4"])
    assert Filesystems(runner, Kernel()).ensure_filesystem(str(dev), "ext4", fresh=True) == "ext4"
    assert runner.calls[-1][0] == "mkfs.ext4"


def test_conflicting_signatures_on_used_volume_refused(runner: FakeRunner) -> None:
    runner.on(["blkid"], rc=8)
    with pytest.raises(FormatRefused, match="conflicting"):
        Filesystems(runner, Kernel()).ensure_filesystem("/dev/vg0/x", "ext4", fresh=False)
    assert len(runner.calls) == 1


# 4. a missing VG is never "LV already gone" --------------------------------------------


@pytest.mark.parametrize("call", ["get", "find", "remove", "list", "volume_group"])
def test_missing_vg_is_unavailable_not_not_found(runner: FakeRunner, call: str) -> None:
    for cmd in ("lvs", "lvremove", "vgs"):
        runner.on([cmd], rc=5, stderr=VG_MISSING)
    lvm = Lvm(runner, "vg0", "pool")
    fn: Any = getattr(lvm, call)
    with pytest.raises(VolumeGroupMissing) as info:
        fn(VOL) if call in ("get", "find", "remove") else fn()
    assert status_of("DeleteVolume", info.value)[0] == "UNAVAILABLE"


def test_missing_lv_is_still_not_found(runner: FakeRunner) -> None:
    runner.on(["lvs"], rc=5, stderr='  Failed to find logical volume "vg0/x"\n')
    runner.on(["lvremove"], rc=5, stderr='  Failed to find logical volume "vg0/x"\n')
    lvm = Lvm(runner, "vg0", "pool")
    assert lvm.find("x") is None
    assert lvm.remove("x") is False


# 5. a state file of the wrong shape is set aside and rebuilt ---------------------------


@pytest.mark.parametrize("text", [
    "null", "[]", "5", '"x"', '{"volumes": 5}', '{"version": 1, "volumes": []}',
    '{"version": 1, "volumes": {"v": 5}}', '{"version": 1, "volumes": {"v": {"staging": 3}}}',
    '{"version": 1, "volumes": {"v": {"publishes": {"/t": 5}}}}',
])
def test_wrong_shape_state_is_kept_aside_and_rebuilt(tmp_path: Path, text: str) -> None:
    (tmp_path / "state.json").write_text(text)
    store = StateStore(str(tmp_path), rebuild=lambda: {})
    assert store.all() == {}
    assert (tmp_path / "state.json.corrupt").read_text() == text
    store.close()


# 3. rebuild attributes mounts by the COs' path shapes -----------------------------------


@pytest.mark.parametrize(("path", "block", "want"), [
    ("/var/lib/kubelet/plugins/kubernetes.io/csi/lvm.csi-local.dev/0a1b/globalmount", False,
     STAGING),
    ("/var/lib/kubelet/plugins/kubernetes.io/csi/pv/pvc-1/globalmount", False, STAGING),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pvc-1/mount", False, PUBLISH),
    ("/var/lib/kubelet/pods/u1/volume-subpaths/pvc-1/c/0", False, FOREIGN),
    (f"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-1/{VOL}", True,
     STAGING),
    ("/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/u1", True, PUBLISH),
    ("/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/pvc-1/dev/u1", True, FOREIGN),
    ("/csi/staging/default/vol1/rw-file-system-single-node-writer", False, STAGING),
    ("/csi/per-alloc/a1/vol1/rw-file-system-single-node-writer", False, PUBLISH),
    ("/csi/per-alloc/a1/vol1/rw-block-device-single-node-writer", True, PUBLISH),
    ("/tmp/sanity/target", False, UNKNOWN),
])
def test_classify_by_co_path_shape(path: str, block: bool, want: str) -> None:
    assert classify(path, block_node=block, volume_id=VOL) == want


LVS = ('{"report": [{"lv": ['
       f'{{"lv_name":"{VOL}","vg_name":"vg0","lv_size":"100","lv_tags":"csi-local.kind=volume",'
       '"lv_attr":"Vwi-aotz--","pool_lv":"pool","origin":"","lv_path":"/dev/vg0/b",'
       '"data_percent":"1.00","metadata_percent":"","lv_time":"1700000000",'
       '"lv_health_status":"","lv_kernel_major":"253","lv_kernel_minor":"7"}]}]}')
K = "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices"
KUBELET_TABLE = f"""\
22 1 0:21 / / rw - ext4 /dev/vda rw
50 22 0:5 /dm-7 {K}/staging/pvc-1/{VOL} rw - devtmpfs udev rw
51 22 0:5 /dm-7 {K}/publish/pvc-1/uid-1 rw - devtmpfs udev rw
52 22 0:5 /dm-7 {K}/pvc-1/dev/uid-1 rw - devtmpfs udev rw
"""


def test_rebuild_ignores_kubelets_own_device_bind(runner: FakeRunner,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner.on(["lvs"], stdout=LVS)
    class TableHost(Kernel):
        def mounts(self) -> list[mounts.Mount]:
            return mounts.parse_mountinfo(KUBELET_TABLE)

        def device_numbers(self, path: str) -> tuple[int, int] | None:
            return (253, 7) if path == "/dev/dm-7" else (8, 0)

    recs = rebuild_state(
        Pools.of(Pool(Lvm(runner, "vg0", "pool"), Locks(tempfile.mkdtemp()), 1.0)), TableHost())
    rec = recs[VOL]
    assert rec.staging is not None and rec.staging.path == f"{K}/staging/pvc-1"
    assert rec.publishes == {f"{K}/publish/pvc-1/uid-1": Publish(readonly=False, flags_known=False)}


# 6. hostile IDs never reach a path, a lock or a command ---------------------------------

HOSTILE_IDS = ["../victim-file", "/abs/victim-file", "..", ".", "a/../../b", "x\x00y",
               "v" * 129, "new\nline"]


def _servicers(tmp_path: Path, runner: FakeRunner) -> tuple[ControllerServicer, NodeServicer]:
    config = Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="n1", volume_group="vg0",
                    thin_pool="pool", state_dir=str(tmp_path / "state"),
                    lock_dir=str(tmp_path / "locks"))
    lvm = Lvm(runner, "vg0", "pool")
    locks = Locks(config.lock_dir)
    backend = Backend(config=config, pools=Pools.of(Pool(lvm, locks, 1.0)),
                      fs=Filesystems(runner, Kernel()), host=Kernel(),
                      state=StateStore(config.state_dir), locks=locks,
                      paginator=Paginator(b"k" * 32),
                      cgroups=Cgroups(str(tmp_path / "cgroup")))  # never the host's
    return ControllerServicer(backend), NodeServicer(backend)


def _requests(vid: str, base: Path) -> list[tuple[str, str, Any]]:
    stage, target = str(base / "stage"), str(base / "target")
    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
                              access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
    rng = pb.CapacityRange(required_bytes=1 << 20)
    return [
        ("node", "NodeStageVolume", pb.NodeStageVolumeRequest(
            volume_id=vid, staging_target_path=stage, volume_capability=cap)),
        ("node", "NodeUnstageVolume", pb.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=stage)),
        ("node", "NodePublishVolume", pb.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=stage, target_path=target,
            volume_capability=cap)),
        ("node", "NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=target)),
        ("node", "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(
            volume_id=vid, volume_path=target)),
        ("node", "NodeExpandVolume", pb.NodeExpandVolumeRequest(
            volume_id=vid, volume_path=target, capacity_range=rng)),
        ("controller", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=vid)),
        ("controller", "ControllerGetVolume", pb.ControllerGetVolumeRequest(volume_id=vid)),
        ("controller", "ValidateVolumeCapabilities", pb.ValidateVolumeCapabilitiesRequest(
            volume_id=vid, volume_capabilities=[cap])),
        ("controller", "ControllerExpandVolume", pb.ControllerExpandVolumeRequest(
            volume_id=vid, capacity_range=rng)),
        ("controller", "CreateSnapshot", pb.CreateSnapshotRequest(
            source_volume_id=vid, name="s1")),
        ("controller", "DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=vid)),
        ("controller", "GetSnapshot", pb.GetSnapshotRequest(snapshot_id=vid)),
        ("controller", "CreateVolume(snapshot source)", pb.CreateVolumeRequest(
            name="n1", volume_capabilities=[cap], volume_content_source=pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=vid)))),
        ("controller", "CreateVolume(volume source)", pb.CreateVolumeRequest(
            name="n1", volume_capabilities=[cap], volume_content_source=pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id=vid)))),
    ]


@pytest.mark.parametrize("vid", HOSTILE_IDS)
@pytest.mark.parametrize("rpc", [name for _, name, _ in _requests("x", Path("/"))])
def test_hostile_ids_touch_nothing(tmp_path: Path, runner: FakeRunner, vid: str,
                                   rpc: str) -> None:
    base = tmp_path / "co"
    (base / "stage").mkdir(parents=True)
    victim = base / "victim-file"  # what "<staging>/../victim-file" names
    victim.write_text("precious")
    (tmp_path / "abs").mkdir()
    (tmp_path / "abs" / "victim-file").write_text("precious")
    controller, node = _servicers(tmp_path / "plugin", runner)
    service, _, request = next(r for r in _requests(vid, base) if r[1] == rpc)
    method = getattr(node if service == "node" else controller, rpc.split("(")[0])
    with pytest.raises(InvalidArgument, match="not a valid ID"):
        method(request, None)
    assert runner.calls == [], "a command ran"
    assert victim.read_text() == "precious"
    assert (tmp_path / "abs" / "victim-file").read_text() == "precious"
    assert not os.listdir(tmp_path / "plugin" / "locks"), "a lock file was made"


# 7. symlinked and system paths -----------------------------------------------------------


def test_symlinked_path_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InvalidArgument, match="symbolic link"):
        validation.path(str(tmp_path / "link"), "target_path")


def test_symlinked_parent_resolves(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    got = validation.path(str(tmp_path / "alias" / "pod"), "target_path")
    assert got == os.path.join(os.path.realpath(tmp_path / "real"), "pod")


@pytest.mark.parametrize("bad", ["/etc/x", "/dev/sda", "/proc/1/root", "/sys/kernel", "/etc", "/"])
def test_system_trees_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        validation.path(bad, "target_path")


def test_link_into_system_tree_refused(tmp_path: Path) -> None:
    (tmp_path / "alias").symlink_to("/etc")
    with pytest.raises(InvalidArgument, match="/etc"):
        validation.path(str(tmp_path / "alias" / "cron.d"), "target_path")


# 8. lock directory and files -------------------------------------------------------------


def test_lock_dir_is_private(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path / "locks"))
    assert stat.S_IMODE(os.stat(tmp_path / "locks").st_mode) == 0o700
    with locks.hold("pool"):
        files = list((tmp_path / "locks").iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_loose_lock_dir_of_ours_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir(mode=0o777)
    os.chmod(tmp_path / "locks", 0o777)
    Locks(str(tmp_path / "locks"))
    assert stat.S_IMODE(os.stat(tmp_path / "locks").st_mode) == 0o700


def test_lock_dir_of_another_user_refused(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir()
    os.chown(tmp_path / "locks", 4242, 4242)
    with pytest.raises(LockDirError, match="owned by uid 4242"):
        Locks(str(tmp_path / "locks"))


def test_symlinked_lock_dir_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "locks").symlink_to(tmp_path / "real")
    with pytest.raises(LockDirError, match="not a directory"):
        Locks(str(tmp_path / "locks"))


def test_planted_lock_file_symlink_not_followed(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path / "locks"))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, locks._path("pool"))
    with pytest.raises(LockDirError), locks.hold("pool"):
        pass
    assert victim.read_text() == "precious"


def test_lock_file_of_another_user_refused(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path / "locks"))
    path = locks._path("pool")
    Path(path).write_text("")
    os.chown(path, 4242, 4242)
    with pytest.raises(LockDirError, match="not a regular file of this user"), \
            locks.hold("pool"):
        pass


# 9. one mount-option rule for both plugins -----------------------------------------------


@pytest.mark.parametrize("flag", ["remount", "bind", "rbind", "move", "noatime,bind",
                                  "loop", "X-mount.mkdir", "rshared", "offset=0"])
def test_mount_flags_that_change_the_operation_are_refused_by_both(flag: str) -> None:
    with pytest.raises(MountOptionError):
        fsrules.check([flag])
    cap = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4", mount_flags=[flag]),
        access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
    assert (validation.capability_problem(cap, "ext4") is not None
            or not fsrules.mkfs_available("ext4"))
    with pytest.raises(DhvError):
        parse_mount_options(flag)


def test_ordinary_mount_flags_pass() -> None:
    assert fsrules.check(["noatime", "discard,nodev"]) == ["noatime", "discard", "nodev"]


SE_CONTEXT = 'context="system_u:object_r:container_file_t:s0:c10,c20"'


def test_a_quoted_selinux_context_is_one_option_for_both() -> None:
    # kubelet's seLinuxMount option: the comma between the MCS categories is
    # inside the quotes, so it does not split the list (as in libmount).
    listed = f"noatime,{SE_CONTEXT},ro"
    assert fsrules.check([listed]) == ["noatime", SE_CONTEXT, "ro"]
    assert parse_mount_options(listed) == ("noatime", SE_CONTEXT, "ro")
    for key in ("fscontext", "defcontext", "rootcontext"):
        opt = f'{key}="system_u:object_r:container_file_t:s0:c0,c1023"'
        assert fsrules.check([opt]) == [opt]


@pytest.mark.parametrize("flag", ['context="a:b:c:s0:c1,c2', 'nodev="x"', 'context=""',
                                  'context="a b"', 'context="a"x"', '"context=a"'])
def test_quotes_outside_a_whole_selinux_context_are_refused(flag: str) -> None:
    with pytest.raises(MountOptionError):
        fsrules.check([flag])


# Every validator of a name, tag or ID, with one value it accepts. Each must
# refuse that value with a line break, NUL or line separator in it: a pattern
# matched with `$` let a trailing newline through.
def _config_driver(name: str) -> object:
    return Config(endpoint="unix:///run/csi.sock", node_id="n1", volume_group="vg0",
                  thin_pool="pool", driver_name=name)


def _mark_key(lv_uuid: str) -> object:
    """The formatting mark's key (StateStore._mark_path) on a store that is
    never opened: the check needs only the directory."""
    store = StateStore.__new__(StateStore)
    store.directory = "/nonexistent"
    return store._mark_path(lv_uuid)


_HEX = "0123456789abcdef" * 2
VALIDATORS: list[tuple[str, Callable[[str], object], str]] = [
    ("naming.is_volume_id", naming.is_volume_id, "csi-v-" + _HEX),
    ("naming.is_snapshot_id", naming.is_snapshot_id, "csi-s-" + _HEX),
    ("naming.is_group_id", naming.is_group_id, "csi-g-" + _HEX),
    ("lvm.check_name", check_name, "vg0"),
    ("lvm.check_tag", check_tag, "csi-local.kind=volume"),
    ("device_classes.check_class_name", check_class_name, "fast"),
    ("dhv.check_volume_id", dhv_request.check_volume_id, "vol1"),
    ("dhv.check_snapshot_name", dhv_request.check_snapshot_name, "snap1"),
    ("config.driver_name", _config_driver, "local.csi.example.com"),
    ("state_file.mark_key", _mark_key, "aBc123-dEf456"),
    ("validation.object_id", lambda v: validation.object_id(v, "volume_id"), "csi-v-" + _HEX),
]
BREAKS = {"newline": "\n", "nul": "\x00", "line-separator": "\u2028",
          "paragraph-separator": "\u2029", "next-line": "\x85"}


def _accepts(check: Callable[[str], object], value: str) -> bool:
    try:
        return bool(check(value))
    except (ValueError, DhvError, InvalidArgument):
        return False


@pytest.mark.parametrize(("check", "good"), [pytest.param(c, g, id=i) for i, c, g in VALIDATORS])
@pytest.mark.parametrize("where", ["end", "middle"])
@pytest.mark.parametrize("brk", list(BREAKS.values()), ids=list(BREAKS))
def test_validators_refuse_line_breaks_and_nul(check: Callable[[str], object], good: str,
                                               where: str, brk: str) -> None:
    assert _accepts(check, good)
    half = len(good) // 2
    bad = good + brk if where == "end" else good[:half] + brk + good[half:]
    assert not _accepts(check, bad), repr(bad)


@pytest.mark.parametrize("path", [
    "/var/lib/kubelet/plugins/kubernetes.io/csi/d/h/globalmount\n",
    "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount\n",
    "/var/lib/nomad/csi/staging/ns/vol/rw-file-system-single-node-writer\n",
])
def test_classify_a_path_ending_in_newline_is_no_co_shape(path: str) -> None:
    assert classify(path, block_node=False, volume_id="csi-v-" + _HEX) == UNKNOWN
