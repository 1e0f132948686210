"""The fake host answers the real Lvm and Filesystems classes as the real tools
would: if these pass, servicer tests built on FakeHost test the plugin, not
the fake. Error classes are matched by name, as src/ is being refactored."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from csi_local.errors import CommandError
from csi_local.host import mounts
from csi_local.host.device_mapper import Target
from csi_local.host.filesystems import Filesystems
from csi_local.storage import lv_devices, vg_text
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import LogicalVolume, Lvm, find_in_vgs, list_vgs
from tests.unit.fakehost import FakeHost, GiB, MiB
from tests.unit.fakes import pv_metadata

VOL = "csi-v-" + "a" * 32
SNAP = "csi-s-" + "b" * 32
CLONE = "csi-v-" + "c" * 32


def _filesystems(host: FakeHost) -> Filesystems:
    try:
        return Filesystems(host, host)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        return Filesystems(host)  # type: ignore[call-arg,arg-type,unused-ignore]


def _raises(fn: Callable[[], Any], *names: str) -> Exception:
    """fn raises an exception whose class name contains one of `names`."""
    try:
        fn()
    except Exception as err:
        assert any(n in type(err).__name__ for n in names), repr(err)
        return err
    raise AssertionError(f"nothing raised; wanted {names}")


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def lvm(host: FakeHost) -> Lvm:
    return Lvm(host, "vg0", "pool0")


def _numbers(host: FakeHost, name: str) -> tuple[int, int]:
    found = host.device_numbers(host.lv_path(name))
    assert found is not None
    return found


# LVM -------------------------------------------------------------------------------


def test_report_parses(host: FakeHost, lvm: Lvm) -> None:
    made = lvm.create_thin(VOL, 100 * MiB + 1, ["csi-local.kind=volume", "csi-local.fresh"])
    report = lvm.report()
    assert report.extent_size == 4 * MiB
    lv = report.find(VOL)
    assert lv == made and lv is not None
    assert lv.size == 104 * MiB  # rounded up to whole extents
    assert lv.tags == {"csi-local.kind=volume", "csi-local.fresh"}
    assert lv.active and lv.is_thin_volume and not lv.activation_skip
    assert lv.pool == "pool0" and lv.path == "/dev/vg0/" + VOL and lv.created > 1_600_000_000
    assert (lv.kernel_major, lv.kernel_minor) == _numbers(host, VOL)
    assert lv.data_percent == 0.0 and lv.metadata_percent is None
    pool = lvm.thin_pool()
    assert pool.is_thin_pool and pool.size == 10 * GiB and pool.attr == "twi-aotz--"
    assert pool.metadata_percent == 0.0 and pool.path == ""
    vg = lvm.volume_group()
    # used: the pool's data and its 8 MiB of metadata
    assert (vg.name, vg.extent_size, vg.size - vg.free) == ("vg0", 4 * MiB, 10 * GiB + 8 * MiB)


def test_missing_lv(lvm: Lvm) -> None:
    assert lvm.find(VOL) is None
    _raises(lambda: lvm.get(VOL), "NotFound")
    assert lvm.remove(VOL) is False


def test_missing_vg_is_never_a_missing_lv() -> None:
    host = FakeHost(with_vg=False)
    lvm = Lvm(host, "vg0", "pool0")
    for call in (lvm.report, lvm.list, lvm.volume_group, lambda: lvm.find(VOL),
                 lambda: lvm.remove(VOL)):
        _raises(call, "VolumeGroup", "VgMissing")
    err = _raises(lambda: host.run(["lvs", "--reportformat", "json", "--units", "b",
                                    "--nosuffix", "--config", 'report/time_format="%s"', "-o",
                                    "lv_name", "vg0/x"]), "CommandError")
    assert isinstance(err, CommandError) and err.returncode == 5
    assert 'Volume group "vg0" not found' in err.stderr


def test_vg_without_pool(host: FakeHost) -> None:
    lvm = Lvm(FakeHost(with_pool=False, extent=8 * MiB), "vg0", "pool0")
    report = lvm.report()  # no LV at all: the extent size comes from vgs
    assert report.lvs == () and report.extent_size == 8 * MiB
    _raises(lvm.thin_pool, "VolumeGroup", "VgMissing")


def test_snapshots(host: FakeHost, lvm: Lvm) -> None:
    lvm.create_thin(VOL, 64 * MiB, [])
    host.set_content(VOL, fs="ext4")
    snap = lvm.snapshot(VOL, SNAP, ["csi-local.kind=snapshot"], writable_volume=False)
    assert not snap.active and snap.activation_skip and snap.origin == VOL
    assert snap.size == 64 * MiB and snap.pool == "pool0" and snap.kernel_major == -1
    assert snap.attr == "Vwi---tz-k"
    assert host.device_numbers(host.lv_path(SNAP)) is None
    _raises(lambda: host.wait_for_device(host.lv_path(SNAP)), "DeviceMissing")
    clone = lvm.snapshot(SNAP, CLONE, [], writable_volume=True)
    assert clone.active and not clone.activation_skip and clone.origin == SNAP
    assert _filesystems(host).probe(clone.path) == ("ext4", False)
    assert host.lv(CLONE).content.uuid == host.lv(VOL).content.uuid
    # `lvchange --activate y` alone leaves a skip-flagged LV inactive, as LVM does.
    host.run(["lvchange", "--activate", "y", "vg0/" + SNAP])
    assert not lvm.get(SNAP).active
    active = lvm.activate(snap)
    assert active.active and active.kernel_major == 253
    host.wait_for_device(active.path)
    assert lvm.remove(VOL) and lvm.get(SNAP).origin == ""


def test_extend_tags_remove(host: FakeHost, lvm: Lvm) -> None:
    lvm.create_thin(VOL, 8 * MiB, ["a=1"])
    assert lvm.extend(VOL, 4 * MiB).size == 8 * MiB and host.commands("lvextend") == []
    assert lvm.extend(VOL, 9 * MiB).size == 12 * MiB
    err = _raises(lambda: host.run(["lvextend", "--size", "12m", "vg0/" + VOL]), "CommandError")
    assert isinstance(err, CommandError) and err.returncode == 5
    lvm.add_tags(VOL, ["b=2", "c"])
    lvm.delete_tags(VOL, ["a=1", "absent"])
    assert lvm.get(VOL).tags == {"b=2", "c"}
    host.set_busy(VOL)
    assert lvm.get(VOL).attr[5] == "o"
    _raises(lambda: lvm.remove(VOL), "InUse")
    host.set_busy(VOL, False)
    assert lvm.remove(VOL) is True and lvm.find(VOL) is None


def test_create_thin_without_read_back_and_duplicates(host: FakeHost, lvm: Lvm) -> None:
    lv = lvm.create_thin(VOL, 8 * MiB, [], read_back=False)
    assert lv.kernel_major == -1 and lvm.get(VOL).active
    err = _raises(lambda: lvm.create_thin(VOL, 8 * MiB, []), "CommandError")
    assert "already exists" in str(err)
    assert len(host.commands("lvcreate")) == 2


def test_demo_backing_commands(tmp_path: Path) -> None:
    backing = tmp_path / "disk.img"
    with open(backing, "wb") as f:
        f.truncate(2 * GiB)
    host = FakeHost(with_vg=False)
    lvm = Lvm(host, "vg0", "pool0")
    assert host.run(["losetup", "--associated", str(backing)]).stdout == ""
    loop = host.run(["losetup", "--find", "--show", str(backing)]).stdout.strip()
    assert host.run(["losetup", "--associated", str(backing)]).stdout.startswith(loop + ":")
    lvm.create_volume_group(loop)
    # The demo's VG gets the metadata area the docs recommend, not LVM's default.
    assert ("vgcreate", "--yes", "--metadatasize", "16m", "vg0", loop) in host.calls
    assert lvm.report().metadata_area is None  # no LV yet: lvs reports no row
    lvm.activate_volume_group()
    lvm.create_thin_pool(80)
    area = lvm.report().metadata_area
    assert area is not None and area.size == 16 * MiB
    pool = lvm.thin_pool()
    assert pool.size == 2 * GiB * 80 // 100 // (4 * MiB) * (4 * MiB)


# file systems ----------------------------------------------------------------------


def test_ensure_filesystem_formats_only_fresh_volumes(host: FakeHost, lvm: Lvm) -> None:
    fs = _filesystems(host)
    lvm.create_thin(VOL, 64 * MiB, [])
    dev = host.lv_path(VOL)
    _raises(lambda: fs.ensure_filesystem(dev, "ext4", fresh=False), "Refused")
    assert host.commands("mkfs.ext4") == [] and host.lv(VOL).content.fs is None
    assert fs.ensure_filesystem(dev, "ext4", fresh=True) == "ext4"
    assert host.commands("mkfs.ext4")[0][-1] == dev
    assert fs.probe(dev) == ("ext4", False) and host.lv(VOL).content.fs_size == 64 * MiB
    assert fs.ensure_filesystem(dev, "ext4", fresh=False) == "ext4"
    assert len(host.commands("mkfs.ext4")) == 1
    _raises(lambda: fs.ensure_filesystem(dev, "xfs", fresh=True), "Refused")


def test_ensure_filesystem_stray_and_unreadable(host: FakeHost, lvm: Lvm) -> None:
    fs = _filesystems(host)
    lvm.create_thin(VOL, 512 * MiB, [])
    dev = host.lv_path(VOL)
    host.set_content(VOL, ambivalent=True)
    assert fs.probe(dev) == (None, True)
    _raises(lambda: fs.ensure_filesystem(dev, "xfs", fresh=False), "Refused")
    assert fs.ensure_filesystem(dev, "xfs", fresh=True) == "xfs"
    assert host.commands("wipefs") == [("wipefs", "--all", dev)]
    host.set_content(VOL, unreadable=True)
    _raises(lambda: fs.ensure_filesystem(dev, "ext4", fresh=True), "Refused")
    assert host.commands("mkfs.ext4") == []


def test_mkfs_like_the_real_tools(host: FakeHost, lvm: Lvm) -> None:
    fs = _filesystems(host)
    lvm.create_thin(VOL, 64 * MiB, [])
    _raises(lambda: fs.mkfs(host.lv_path(VOL), "xfs"), "CommandError")  # < 300 MiB
    host.set_content(VOL, fs="ext4")
    lvm.extend(VOL, 512 * MiB)
    err = _raises(lambda: fs.mkfs(host.lv_path(VOL), "xfs"), "CommandError")  # no -f
    assert "existing filesystem" in str(err)
    _raises(lambda: fs.mkfs("/dev/vg0/absent", "ext4"), "CommandError")


def test_mount_bind_umount(host: FakeHost, lvm: Lvm, tmp_path: Path) -> None:
    fs = _filesystems(host)
    lv = lvm.create_thin(VOL, 64 * MiB, [])
    fs.ensure_filesystem(lv.path, "ext4", fresh=True)
    staging, target = tmp_path / "staging", tmp_path / "target"
    staging.mkdir()
    target.mkdir()
    fs.mount(lv.path, str(staging), "ext4", ["noatime", "discard"])
    (m,) = host.mounts()
    major, minor = _numbers(host, VOL)
    assert (m.major, m.minor, m.fs_type, m.mount_point) == (major, minor, "ext4", str(staging))
    assert m.source == "/dev/mapper/vg0-csi--v--" + "a" * 32
    assert m.options == {"rw", "noatime"} and m.super_options == {"rw", "discard"}
    assert host.device_mounted_at(str(staging), major, minor)
    assert lvm.get(VOL).attr[5] == "o"
    _raises(lambda: lvm.remove(VOL), "InUse")
    _raises(lambda: fs.mkfs(lv.path, "ext4"), "CommandError")  # mounted

    fs.bind(str(staging), str(target), readonly=True)
    top = host.top_mount(str(target))
    assert top is not None and top.read_only and top.root == "/"
    assert host.shows_device(top, major, minor) and len(host.mounts_of(major, minor)) == 2
    fs.remount_bind(str(target), readonly=False)
    top = host.top_mount(str(target))
    assert top is not None and not top.read_only

    assert fs.umount(str(target), device=(major, minor))
    _raises(lambda: host.run(["umount", str(target)]), "CommandError")
    assert fs.umount(str(target)) == []
    fs.umount(str(staging))
    assert host.mounts() == [] and lvm.remove(VOL)


def test_mount_errors(host: FakeHost, lvm: Lvm, tmp_path: Path) -> None:
    fs = _filesystems(host)
    lv = lvm.create_thin(VOL, 64 * MiB, [])
    for device, where in ((lv.path, tmp_path / "missing"),  # no mount point
                          (lv.path, tmp_path),  # blank device
                          ("/dev/vg0/absent", tmp_path)):
        with pytest.raises(CommandError) as err:
            fs.mount(device, str(where), "ext4", [])
        assert err.value.returncode == 32
    host.set_content(VOL, fs="xfs")
    with pytest.raises(CommandError, match="wrong fs type"):
        fs.mount(lv.path, str(tmp_path), "ext4", [])
    with pytest.raises(CommandError, match="not mounted"):
        host.run(["umount", str(tmp_path)])
    parent, foreign = tmp_path / "parent", tmp_path / "foreign"
    (parent / "child").mkdir(parents=True)
    foreign.mkdir()
    host.add_mount(str(parent))
    fs.mount(lv.path, str(parent / "child"), "xfs", [])
    with pytest.raises(CommandError, match="target is busy"):
        host.run(["umount", str(parent)])
    host.add_mount(str(foreign))
    _raises(lambda: fs.umount(str(foreign), device=_numbers(host, VOL)), "StillMounted")
    assert host.is_mount_point(str(foreign))


def test_node_bind_and_readonly_loop(host: FakeHost, lvm: Lvm, tmp_path: Path) -> None:
    fs = _filesystems(host)
    lv = lvm.create_thin(VOL, 64 * MiB, [])
    major, minor = _numbers(host, VOL)
    rw_file, ro_file = tmp_path / "rw", tmp_path / "ro"
    rw_file.touch()
    ro_file.touch()
    fs.bind(lv.path, str(rw_file), readonly=False)
    m = host.top_mount(str(rw_file))
    assert m is not None and (m.major, m.minor, m.fs_type) == (0, 5, "devtmpfs")
    assert m.root == f"/dm-{minor}" and mounts.mount_node(m) == f"/dev/dm-{minor}"
    assert mounts.mount_is_device(m, major, minor, numbers=host._numbers,
                                  backing=host.loop_backing)
    assert host.device_mounted_at(str(rw_file), major, minor)
    assert host.device_numbers(str(rw_file)) == (major, minor)  # stat follows the bind
    assert host.device_size(str(rw_file)) == 64 * MiB

    loop = fs.readonly_loop(lv.path)
    assert loop == "/dev/loop0" and host.device_numbers(loop) == (7, 0)
    assert host.loop_backing(loop) == f"/dev/dm-{minor}"
    fs.bind(loop, str(ro_file), readonly=True)
    m = host.top_mount(str(ro_file))
    assert m is not None and m.root == "/loop0" and m.read_only
    assert host.shows_device(m, major, minor)
    assert [x.mount_point for x in host.mounts_of(major, minor)] == [str(rw_file), str(ro_file)]
    _raises(lambda: lvm.remove(VOL), "InUse")  # the loop device holds it open
    _raises(lambda: fs.mkfs(loop, "ext4"), "CommandError")  # read-only loop

    fs.umount(str(ro_file))
    fs.detach_loop(loop)
    fs.detach_loop(loop)  # exit 1, allowed
    assert host.loop_backing(loop) is None and host.device_numbers(loop) == (7, 0)
    assert lvm.remove(VOL)  # a node bind does not open the device
    assert not host.device_mounted_at(str(rw_file), major, minor)


def test_btrfs_shows_an_anonymous_device(host: FakeHost, lvm: Lvm, tmp_path: Path) -> None:
    fs = _filesystems(host)
    lv = lvm.create_thin(VOL, 256 * MiB, [])
    fs.ensure_filesystem(lv.path, "btrfs", fresh=True)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    fs.mount(lv.path, str(a), "btrfs", [])
    fs.mount(lv.path, str(b), "btrfs", [])
    ma, mb = host.mounts()
    assert ma.major == 0 and (ma.major, ma.minor) == (mb.major, mb.minor)
    assert host.device_mounted_at(str(a), *_numbers(host, VOL))
    # A clone has its origin's fsid: refused while the origin is mounted, until btrfstune.
    lvm.snapshot(VOL, CLONE, [], writable_volume=True)
    c = tmp_path / "c"
    c.mkdir()
    clone = host.lv_path(CLONE)
    _raises(lambda: fs.mount(clone, str(c), "btrfs", []), "CommandError")
    fs.new_fsid(clone, "btrfs")
    fs.mount(clone, str(c), "btrfs", [])
    assert host.device_mounted_at(str(c), *_numbers(host, CLONE))


def test_xfs_clone_and_grow(host: FakeHost, lvm: Lvm, tmp_path: Path) -> None:
    fs = _filesystems(host)
    lv = lvm.create_thin(VOL, 512 * MiB, [])
    fs.ensure_filesystem(lv.path, "xfs", fresh=True)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    fs.mount(lv.path, str(a), "xfs", [])
    clone = lvm.snapshot(VOL, CLONE, [], writable_volume=True)
    _raises(lambda: host.run(["mount", "-t", "xfs", clone.path, str(b)]), "CommandError")
    fs.mount(clone.path, str(b), "xfs", [])  # fs.mount adds nouuid
    lvm.extend(VOL, GiB)
    assert host.lv(VOL).content.fs_size == 512 * MiB
    fs.grow(lv.path, str(a), "xfs")
    assert host.lv(VOL).content.fs_size == GiB
    _raises(lambda: fs.grow(lv.path, str(tmp_path), "xfs"), "CommandError")  # not mounted
    fs.sync(str(a))


def test_resize2fs(host: FakeHost, lvm: Lvm) -> None:
    fs = _filesystems(host)
    lvm.create_thin(VOL, 64 * MiB, [])
    host.set_content(VOL, fs="ext4")
    lvm.extend(VOL, 128 * MiB)
    fs.grow(host.lv_path(VOL), "/unused", "ext4")
    assert host.lv(VOL).content.fs_size == 128 * MiB


# the harness itself ----------------------------------------------------------------


def test_fail_next_and_calls(host: FakeHost, lvm: Lvm) -> None:
    host.fail_next(["lvcreate", "--yes", "--thin"], rc=5, stderr="  Cannot create\n")
    err = _raises(lambda: lvm.create_thin(VOL, 8 * MiB, []), "CommandError")
    assert isinstance(err, CommandError) and err.returncode == 5
    assert lvm.find(VOL) is None  # the failure changed nothing
    host.run(["/usr/sbin/lvcreate", "--yes", "--thin", "vg0/pool0", "--virtualsize",
              f"{8 * MiB}b", "--name", VOL])
    assert lvm.get(VOL).active
    assert [c[:3] for c in host.commands("lvcreate")] == [("lvcreate", "--yes", "--thin")] * 2
    host.fail_next(["losetup"], rc=1)
    assert host.run(["losetup", "--detach", "/dev/loop9"], ok_codes=(0, 1)).returncode == 1
    host.fail_next(["blkid"], timed_out=True)
    err = _raises(lambda: host.run(["blkid"]), "CommandError")
    assert isinstance(err, CommandError) and err.timed_out


def test_unknown_commands_and_options_assert(host: FakeHost) -> None:
    with pytest.raises(AssertionError, match="fsck"):
        host.run(["fsck", "/dev/vg0/x"])
    with pytest.raises(AssertionError, match="--force"):
        host.run(["lvremove", "--force", "vg0/x"])
    with pytest.raises(AssertionError, match="JSON"):
        host.run(["lvs", "-o", "lv_name", "vg0"])
    assert host.calls[0] == ("fsck", "/dev/vg0/x")


def test_no_real_process_or_device_is_touched(host: FakeHost) -> None:
    host.add_lv(VOL, 8 * MiB, fs="ext4")
    assert host.device_size(host.lv_path(VOL)) == 8 * MiB
    assert host.read_error(host.lv_path(VOL)) is None
    assert host.read_error("/dev/vg0/absent") is not None
    assert not os.path.exists(host.lv_path(VOL))


# several volume groups and thin pools (device classes) ---------------------------

REPORT = ["--reportformat", "json", "--units", "b", "--nosuffix", "--config",
          'report/time_format="%s"']


def _two_vgs() -> FakeHost:
    """vg0/pool0 (10 GiB, 4 MiB extents) and vg1/pool1 (4 GiB, 8 MiB extents)."""
    host = FakeHost()
    host.add_vg("vg1", pool="pool1", pool_size=4 * GiB, extent=8 * MiB)
    return host


def _lvs(host: FakeHost, *operands: str, select: str | None = None,
         fields: str = "lv_name,vg_name,pool_lv") -> list[tuple[str, ...]]:
    """(lv_name, vg_name, pool_lv) of each row of a raw `lvs`, in LVM's order."""
    argv = ["lvs", *REPORT, "-o", fields, *(["--select", select] if select else []), *operands]
    out = host.run(argv).stdout
    return [tuple(r.values()) for r in json.loads(out)["report"][0]["lv"]]


def test_same_lv_name_in_two_vgs() -> None:
    host = _two_vgs()
    lvm0, lvm1 = Lvm(host, "vg0", "pool0"), Lvm(host, "vg1", "pool1")
    a = lvm0.create_thin(VOL, 10 * MiB, ["in=vg0"])
    b = lvm1.create_thin(VOL, 10 * MiB, ["in=vg1"])
    # Each VG's own extent size; each LV its own path, mapper name and dm minor.
    assert (a.vg, a.pool, a.size, a.path) == ("vg0", "pool0", 12 * MiB, f"/dev/vg0/{VOL}")
    assert (b.vg, b.pool, b.size, b.path) == ("vg1", "pool1", 16 * MiB, f"/dev/vg1/{VOL}")
    assert lvm0.report().extent_size == 4 * MiB and lvm1.report().extent_size == 8 * MiB
    assert a.tags == {"in=vg0"} and b.tags == {"in=vg1"}
    assert host.device_numbers(a.path) != host.device_numbers(b.path)
    assert host.device_numbers(a.path) == (a.kernel_major, a.kernel_minor)
    assert host.device_numbers(b.path) == (b.kernel_major, b.kernel_minor)
    assert host.device_numbers(f"/dev/mapper/vg1-{VOL.replace('-', '--')}") == (
        b.kernel_major, b.kernel_minor)
    assert set(host.all_lvs()) == {("vg0", "pool0"), ("vg0", VOL), ("vg1", "pool1"),
                                   ("vg1", VOL)}
    assert host.lv(VOL, "vg1").size == 16 * MiB and host.lv_path(VOL, "vg1") == b.path
    assert host.lv(VOL) is host.lvs[VOL]  # the first VG's, without a vg
    # A thin pool is per VG: vg1's pool is not vg0's.
    with pytest.raises(CommandError, match="Failed to find"):
        host.run(["lvcreate", "--yes", "--thin", "vg0/pool1", "--virtualsize", "8m",
                  "--name", CLONE])


def test_writes_go_to_the_named_vg() -> None:
    host = _two_vgs()
    lvm0, lvm1 = Lvm(host, "vg0", "pool0"), Lvm(host, "vg1", "pool1")
    lvm0.create_thin(VOL, 8 * MiB, [])
    lvm1.create_thin(VOL, 8 * MiB, [])
    assert lvm1.extend(VOL, 20 * MiB).size == 24 * MiB  # vg1's 8 MiB extents
    assert lvm0.get(VOL).size == 8 * MiB
    lvm1.add_tags(VOL, ["x=1"])
    assert lvm1.get(VOL).tags == {"x=1"} and lvm0.get(VOL).tags == frozenset()
    snap = lvm1.snapshot(VOL, SNAP, [], writable_volume=False)
    assert (snap.vg, snap.pool, snap.origin) == ("vg1", "pool1", VOL)
    assert lvm0.find(SNAP) is None
    host.set_busy(VOL, vg="vg0")
    _raises(lambda: lvm0.remove(VOL), "InUse")
    assert lvm1.remove(VOL) is True  # vg1's, not busy
    assert lvm1.find(VOL) is None and lvm0.get(VOL).size == 8 * MiB
    assert lvm1.get(SNAP).origin == ""  # the snapshot outlives its origin, in its VG
    assert ("lvremove", "--yes", f"vg1/{VOL}") in host.calls
    # Pool growth takes from its own VG: vg1 has 1 GiB free, vg0 its own.
    lvm1.extend_pool(GiB - 8 * MiB)
    _raises(lambda: lvm1.extend_pool(8 * MiB), "CommandError")
    lvm0.extend_pool(512 * MiB)
    assert lvm0.volume_group().free == GiB - 512 * MiB - 8 * MiB


def test_volume_group_reports_per_vg() -> None:
    host = _two_vgs()
    vg0, vg1 = Lvm(host, "vg0", "pool0").volume_group(), Lvm(host, "vg1", "pool1").volume_group()
    assert (vg0.name, vg0.size, vg0.extent_size) == ("vg0", 11 * GiB, 4 * MiB)
    assert (vg1.name, vg1.size, vg1.extent_size) == ("vg1", 5 * GiB, 8 * MiB)
    assert vg1.free == GiB - 8 * MiB  # less the pool's data and metadata


def test_lvs_of_several_vgs_and_select() -> None:
    host = _two_vgs()
    host.add_lv(CLONE, 8 * MiB, vg="vg1")
    host.add_lv(VOL, 8 * MiB, vg="vg1")
    host.add_lv(VOL, 8 * MiB)
    # Rows sorted by VG, then LV, as LVM sorts them; each VG named once is enough.
    assert _lvs(host, "vg1", "vg0", "vg1") == [
        (VOL, "vg0", "pool0"), ("pool0", "vg0", ""),
        (VOL, "vg1", "pool1"), (CLONE, "vg1", "pool1"), ("pool1", "vg1", "")]
    assert _lvs(host, "vg0", "vg1", select=f'lv_name="{VOL}"') == [
        (VOL, "vg0", "pool0"), (VOL, "vg1", "pool1")]
    assert _lvs(host, "vg0", "vg1", select=f'lv_name="{CLONE}" || lv_name="{SNAP}"') == [
        (CLONE, "vg1", "pool1")]
    assert _lvs(host, "vg1", select=f'lv_name="{VOL}" || lv_name="pool1"') == [
        (VOL, "vg1", "pool1"), ("pool1", "vg1", "")]
    # The library functions the plugin uses.
    lvs, missing = find_in_vgs(host, ["vg0", "vg1"], [CLONE, VOL])
    assert [(lv.vg, lv.name) for lv in lvs] == [("vg0", VOL), ("vg1", VOL), ("vg1", CLONE)]
    assert missing == []
    lvs, missing = list_vgs(host, ["vg0", "vg1"])
    assert len(lvs) == 5 and missing == []
    assert len(host.commands("lvs")) == 6


def test_a_missing_vg_among_several() -> None:
    host = _two_vgs()
    host.add_lv(VOL, 8 * MiB, vg="vg1")
    host.add_lv(CLONE, 8 * MiB)
    host.set_vg_present("vg1", False)
    argv = ["lvs", *REPORT, "-o", "lv_name,vg_name", "vg0", "vg1", "gone"]
    with pytest.raises(CommandError) as caught:
        host.run(argv)
    err = caught.value
    # LVM reports the VGs it found, then exits 5 naming each missing one.
    assert err.returncode == 5
    assert 'Volume group "vg1" not found' in err.stderr
    assert 'Volume group "gone" not found' in err.stderr
    rows = json.loads(err.stdout)["report"][0]["lv"]
    assert [(r["lv_name"], r["vg_name"]) for r in rows] == [(CLONE, "vg0"), ("pool0", "vg0")]
    lvs, missing = find_in_vgs(host, ["vg0", "vg1"], [VOL, CLONE])
    assert [(lv.vg, lv.name) for lv in lvs] == [("vg0", CLONE)] and missing == ["vg1"]
    lvs, missing = list_vgs(host, ["vg0", "vg1"])
    assert {lv.name for lv in lvs} == {CLONE, "pool0"} and missing == ["vg1"]
    # Every command on the missing VG says so; the other VG works.
    lvm1 = Lvm(host, "vg1", "pool1")
    for fn in (lvm1.report, lvm1.list, lvm1.volume_group, lambda: lvm1.find(VOL),
               lambda: lvm1.remove(VOL)):
        _raises(fn, "VolumeGroup")
    assert Lvm(host, "vg0", "pool0").get(CLONE).vg == "vg0"
    with pytest.raises(CommandError) as caught:
        host.run(["vgs", *REPORT, "-o", "vg_name", "vg0", "vg1"])
    assert caught.value.returncode == 5 and 'Volume group "vg1" not found' in caught.value.stderr
    assert json.loads(caught.value.stdout)["report"][0]["vg"] == [{"vg_name": "vg0"}]
    # Back: its LVs are still there.
    host.set_vg_present("vg1", True)
    assert lvm1.get(VOL).vg == "vg1"


def test_two_pools_in_one_vg() -> None:
    host = FakeHost(pool_size=4 * GiB, vg_size=20 * GiB)
    host.add_pool("vg0", "pool1", 8 * GiB)
    a, b = Lvm(host, "vg0", "pool0"), Lvm(host, "vg0", "pool1")
    a.create_thin(VOL, 8 * MiB, [])
    b.create_thin(CLONE, 8 * MiB, [])
    host.add_lv(SNAP, 8 * MiB, pool="pool1")
    report = a.report()  # one VG: both pools' LVs
    assert {(lv.name, lv.pool) for lv in report.lvs} == {
        ("pool0", ""), ("pool1", ""), (VOL, "pool0"), (CLONE, "pool1"), (SNAP, "pool1")}
    assert b.thin_pool().size == 8 * GiB and a.thin_pool().size == 4 * GiB
    # vgs counts both pools, data and metadata.
    assert a.volume_group().free == 20 * GiB - 12 * GiB - 16 * MiB
    host.add_lv("other", 8 * MiB)  # without a pool: the first VG's first pool
    assert host.lv("other").pool == "pool0"


def test_extra_lvcreate_options() -> None:
    host = _two_vgs()
    lvm = Lvm(host, "vg1", "pool1", ("--readahead", "256"))
    lvm.create_thin(VOL, 8 * MiB, [])
    (argv,) = host.commands("lvcreate")
    assert argv[argv.index("--readahead") + 1] == "256"
    lv = host.lv(VOL, "vg1")
    assert (lv.readahead, lv.active) == ("256", True)
    clone = lvm.snapshot(VOL, CLONE, [], writable_volume=True)
    assert clone.active and host.lv(CLONE, "vg1").readahead == "256"
    snap = lvm.snapshot(VOL, SNAP, [], writable_volume=False)  # no extra options
    assert not snap.active and host.lv(SNAP, "vg1").readahead == "auto"
    assert "--readahead" not in host.commands("lvcreate")[-1]
    with pytest.raises(CommandError, match="Invalid argument") as err:
        host.run(["lvcreate", "--yes", "--thin", "vg1/pool1", "--virtualsize", "8m",
                  "--name", "x", "--readahead", "fast"])
    assert err.value.returncode == 3
    # As lvm2 2.03 answers: no --setautoactivation for a thin volume or a snapshot.
    runs: tuple[tuple[list[str], str], ...] = (
        (["--thin", "vg1/pool1", "--virtualsize", "8m"], "thins"),
        (["--snapshot", f"vg1/{VOL}"], "snapshots"))
    for args, kind in runs:
        with pytest.raises(CommandError, match=f"unsupported with {kind}") as err:
            host.run(["lvcreate", "--yes", *args, "--name", "x", "--setautoactivation", "y"])
        assert err.value.returncode == 3
    assert "x" not in host.vgs["vg1"].lvs
    none = Lvm(host, "vg0", "pool0", ("--readahead", "none"))
    none.create_thin(VOL, 8 * MiB, [])
    assert host.lv(VOL, "vg0").readahead == "none"


def test_vgcreate_and_vgchange_of_another_vg(tmp_path: Path) -> None:
    backing = tmp_path / "disk.img"
    with open(backing, "wb") as f:
        f.truncate(2 * GiB)
    host = FakeHost()
    loop = host.run(["losetup", "--find", "--show", str(backing)]).stdout.strip()
    lvm = Lvm(host, "vg9", "pool9")
    lvm.create_volume_group(loop)
    lvm.activate_volume_group()
    lvm.create_thin_pool(50)
    assert lvm.thin_pool().size == GiB and lvm.volume_group().size == 2 * GiB
    assert ("lvchange", "--errorwhenfull", "y", "vg9/pool9") in host.calls
    assert Lvm(host, "vg0", "pool0").thin_pool().size == 10 * GiB  # untouched
    _raises(lambda: lvm.create_volume_group(loop), "CommandError")  # exists now


def test_helpers_with_several_vgs() -> None:
    host = _two_vgs()
    host.add_lv(VOL, 8 * MiB, vg="vg1", fs="ext4")
    assert host.lv(VOL).vg == "vg1"  # only there: found without a vg
    assert host.lv_path(VOL) == f"/dev/vg1/{VOL}"
    assert host.lv(VOL).pool == "pool1" and host.lv(VOL).content.fs == "ext4"
    host.set_content(VOL, fs="xfs")
    host.set_busy(VOL)
    assert host.lv(VOL).busy and host.lv(VOL).content.fs == "xfs"
    host.add_vg("vg2", pool="pool2")
    host.add_lv(VOL, 8 * MiB, vg="vg2")
    with pytest.raises(AssertionError, match="pass vg="):  # in two VGs, neither the first
        host.lv(VOL)
    assert host.lv(VOL, "vg2").pool == "pool2"
    host.add_lv(VOL, 8 * MiB)
    assert host.lv(VOL) is host.lvs[VOL]  # the first VG's comes first
    with pytest.raises(AssertionError, match="exists already"):
        host.add_lv(VOL, 8 * MiB, vg="vg1")
    with pytest.raises(KeyError):
        host.lv("absent")


@pytest.mark.parametrize("argv", [
    pytest.param(["--select", "lv_tags=x", "vg0"], id="select-other-field"),
    pytest.param(["--select", 'lv_name="a" && lv_name="b"', "vg0"], id="select-and"),
    pytest.param(["--select", 'lv_name=~"a"', "vg0"], id="select-regex"),
    pytest.param(["--select", 'lv_name="a"', "vg0/a"], id="select-of-one-lv"),
    pytest.param(["vg0/a", "vg1"], id="lv-among-vgs"),
    pytest.param([], id="no-operand"),
])
def test_lvs_forms_not_simulated_assert(argv: list[str]) -> None:
    host = _two_vgs()
    with pytest.raises(AssertionError, match="FakeHost"):
        host.run(["lvs", *REPORT, "-o", "lv_name", *argv])


def test_vgs_select_is_not_simulated() -> None:
    with pytest.raises(AssertionError, match="FakeHost"):
        _two_vgs().run(["vgs", *REPORT, "-o", "vg_name", "--select", 'lv_name="a"', "vg0"])


# what is read without a process: the PVs' metadata and device-mapper -------------

CAPTURE = json.loads((Path(__file__).parent / "data" / "lvm-metadata.json").read_text())
CAPTURED_HEAD = base64.b64decode(CAPTURE["head_b64"])  # sectors 0-8, as LVM wrote them


def test_the_label_and_the_area_header_are_lvms_byte_for_byte() -> None:
    """The fake writes the label sector and the metadata area's header as LVM
    2.03 did in the test VM, given what that PV held: its ID, its size, its
    data and metadata areas, where its text was, how long, its checksum."""
    text = CAPTURE["text"].encode()
    assert pv_metadata.lvm_crc(text) == vg_text.lvm_crc(text)
    label = pv_metadata.label("SE9X3R-UzHd-Fwaw-g6Gb-3BIl-WU9F-IQF0cw", 1 << 30, 1 << 20,
                              0xFF000)
    assert label == CAPTURED_HEAD[512:1024]
    header = pv_metadata.mda_header(4096, 0xFF000, 0x5400, len(text), vg_text.lvm_crc(text))
    assert header == CAPTURED_HEAD[4096:4608]


def _keys(tree: object) -> list[tuple[str, object]]:
    """A parsed section's layout: its keys in order, and each subsection's."""
    assert isinstance(tree, dict)
    return [(k, _keys(v) if isinstance(v, dict) else None) for k, v in tree.items()]


def test_the_text_is_laid_out_as_lvm_lays_it_out() -> None:
    """Section by section (the VG, its PV, a thin pool, a thin volume, a thin
    snapshot with activation skip, a pool's hidden metadata LV), the fake's
    text has the keys LVM 2.03 wrote in the capture, in its order."""
    host = FakeHost(vg="vg-cap", pool="po-ol")
    host.add_lv("csi-v-abc", 64 * MiB, tags=["csi-local.kind=volume"])
    host.add_lv("csi-s-snap", 64 * MiB, tags=["csi-local.kind=snapshot"], origin="csi-v-abc",
                active=False, skip=True)
    fake = vg_text.parse_text(pv_metadata.vg_text(host.vgs["vg-cap"]))
    real = vg_text.parse_text(CAPTURE["text"].encode())
    assert _keys(fake)[1:] == _keys(real)[1:]  # contents, version, description, host, time
    fake_vg, real_vg = fake["vg-cap"], real["vg-cap"]
    assert isinstance(fake_vg, dict) and isinstance(real_vg, dict)
    assert [k for k, _ in _keys(fake_vg)] == [k for k, _ in _keys(real_vg)]
    for section, name in (("physical_volumes", "pv0"), ("logical_volumes", "po-ol"),
                          ("logical_volumes", "csi-v-abc"), ("logical_volumes", "csi-s-snap"),
                          ("logical_volumes", "po-ol_tmeta"),
                          ("logical_volumes", "po-ol_tdata")):
        fake_part, real_part = fake_vg[section], real_vg[section]
        assert isinstance(fake_part, dict) and isinstance(real_part, dict)
        assert _keys(fake_part[name]) == _keys(real_part[name]), name


def _projection(lv: LogicalVolume) -> tuple[object, ...]:
    """What the committed metadata and the kernel tell of an LV, as `lvs` does
    (not whether it is open, nor a thin volume's data_percent: not read)."""
    return (lv.name, lv.vg, lv.size, lv.tags, lv.pool, lv.origin, lv.active,
            lv.activation_skip, lv.kernel_major, lv.kernel_minor, lv.thin_id, lv.uuid,
            lv.created, lv.chunk_size, lv.metadata_size, lv.is_thin_pool,
            lv.data_percent if lv.is_thin_pool else None,
            lv.metadata_percent if lv.is_thin_pool else None)


def _busy_host() -> FakeHost:
    """Two VGs, three pools, active, inactive and skipped volumes, tags, a pool
    with no active volume (not stacked) and one filled part-way."""
    host = FakeHost(vg="vg-a")
    host.add_pool("vg-a", "cold", 2 * GiB)
    host.add_vg("vg-b", pool="po-ol", extent=8 * MiB)
    host.add_lv(VOL, GiB, tags=["csi-local.kind=volume", "a=b"])
    host.add_lv(SNAP, GiB, origin=VOL, active=False, skip=True, tags=["csi-local.kind=snapshot"])
    host.add_lv("inactive", 3 * GiB, active=False)
    host.add_lv(CLONE, 5 * GiB, vg="vg-b")
    host.lv("pool0").data_percent, host.lv("pool0").metadata_percent = 42.5, 80.0
    host.write(VOL, 0, 3 * MiB)
    return host


def test_the_committed_reader_reads_what_lvs_reports() -> None:
    """The plugin's own reader over the fake's PVs and device-mapper lists
    every LV as the fake's `lvs` does: the fake's two ways agree."""
    host = _busy_host()
    reader = CommittedMetadata(host, host)
    listed = reader.listing(["vg-a", "vg-b"])
    assert listed is not None
    by_lvs, missing = list_vgs(host, ["vg-a", "vg-b"])
    assert missing == [] and sorted(map(_projection, listed)) == sorted(map(_projection, by_lvs))
    assert {lv.name for lv in listed} == {"pool0", "cold", VOL, SNAP, "inactive", "po-ol", CLONE}
    for vg, pool in (("vg-a", "pool0"), ("vg-a", "cold"), ("vg-b", "po-ol")):
        # A report reads no LV's device: what it says of each is the listing's less that.
        report = reader.report(vg, pool)
        lvm_report = Lvm(host, vg, pool).report()
        assert report is not None and report.extent_size == lvm_report.extent_size
        # The text's size; `lvs` says what is left in whole sectors (vg_mda_free).
        area, lvm_area = report.metadata_area, lvm_report.metadata_area
        assert area is not None and lvm_area is not None and area.size == lvm_area.size
        assert 0 <= lvm_area.used - area.used < 512
        # and only the pool asked for has its status read.
        assert sorted(_projection(lv)[:6] + _projection(lv)[10:16] for lv in report.lvs) == \
            sorted(_projection(lv)[:6] + _projection(lv)[10:16] for lv in lvm_report.lvs)
        assert _projection(report.find(pool))[16:] == _projection(  # type: ignore[arg-type]
            lvm_report.find(pool))[16:]  # type: ignore[arg-type]
        assert reader.space(vg) == Lvm(host, vg, pool).volume_group()
    thin = reader.thin_volume("vg-a", VOL)
    assert thin is not None and thin.active and (thin.kernel_major, thin.kernel_minor) == \
        _numbers(host, VOL)
    assert reader.problems("vg-a") == ()


def test_each_change_is_a_new_version_written_after_the_last() -> None:
    """A change is a new seqno, its text placed after the last one's; once the
    area's end is reached it wraps to its start, split in two where it must,
    and the reader still reads it whole."""
    host = FakeHost()
    fvg = host.vgs["vg0"]
    fvg.mda_size = 16 * 1024  # a small area: the text wraps within a few changes
    reader = CommittedMetadata(host, host)
    seen, offsets = [], []
    for i in range(12):
        host.run(["lvcreate", "--thin", "--virtualsize", "1g", "--name", f"v{i}", "vg0/pool0"])
        host.run(["lvremove", "--yes", f"vg0/v{i}"])
        meta = reader.volume_group("vg0")
        assert meta is not None and f"v{i}" not in meta.lvs
        seen.append(meta.seqno)
        offsets.append(fvg.committed.offset)
    assert seen == sorted(seen) and len(set(seen)) == 12
    assert min(offsets) < offsets[0] + 512  # wrapped round
    size = len(fvg.committed.text)
    assert any(o + size > fvg.mda_size for o in offsets), offsets  # and split at least once


def test_a_detached_vgs_pv_cannot_be_read_and_no_pv_is_listed_when_asked() -> None:
    host = FakeHost()
    reader = CommittedMetadata(host, host)
    assert reader.volume_group("vg0") is not None
    host.vg_present = False
    assert reader.volume_group("vg0") is None
    with pytest.raises(FileNotFoundError):
        host.read_device("/dev/fake-pv-vg0", 0, 512)
    host.vg_present = True
    host.pv_metadata = False  # `pvs` lists none: every read is LVM's
    assert CommittedMetadata(host, host).volume_group("vg0") is None


def test_device_mapper_as_lvm_stacks_it(host: FakeHost) -> None:
    """A pool with no active volume carries its thin-pool target itself; with
    one, under a linear layer of its name; a thin volume's status counts its
    mapped sectors; an inactive LV has no device."""
    assert lv_devices.pool_usage(host, "vg0", "pool0") is not None
    assert [t.target_type for t in host.dm_status("vg0-pool0") or []] == ["thin-pool"]
    host.add_lv(VOL, GiB)
    assert [t.target_type for t in host.dm_status("vg0-pool0") or []] == ["linear"]
    assert [t.target_type for t in host.dm_status("vg0-pool0-tpool") or []] == ["thin-pool"]
    assert lv_devices.thin_mapped_sectors(host, "vg0", VOL) == 0
    host.write(VOL, 64 * 1024, 1)  # the second chunk
    assert lv_devices.thin_mapped_sectors(host, "vg0", VOL) == 128
    assert host.dm_status(f"vg0-{VOL.replace('-', '--')}") == [
        Target(0, GiB // 512, "thin", "128 255")]
    host.thin_status_error = True
    assert lv_devices.thin_mapped_sectors(host, "vg0", VOL) is None
    host.run(["lvchange", "--activate", "n", f"vg0/{VOL}"])
    assert host.dm_device(f"vg0-{VOL.replace('-', '--')}") is None
