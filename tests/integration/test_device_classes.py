"""Device classes against real LVM: two VGs on two loop devices, one of them
with two thin pools, served by one plugin from a configuration file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from csi_local.host.runner import ProcessRunner
from csi_local.storage.lvm import Lvm
from csi_local.storage.lvm_config import backup_dir
from csi_local.volumes import device_classes as classes_mod
from tests.integration.conftest import (
    SCRATCH,
    LoopVG,
    PluginProcess,
    expect_code,
    make_vg,
    mount_cap,
    run,
    unmount_under,
)

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode


@dataclass
class Classes:
    fast: LoopVG  # class "fast": its pool; ext4 by default, readahead 1024 sectors
    big: LoopVG  # class "big" (pool, xfs by default, ratio 2) and "archive" (pool2)
    plugin: PluginProcess

    def all_lvs(self) -> set[tuple[str, str, str]]:
        """(vg, lv, pool) of every LV in both VGs but the pools."""
        out = run("lvs", "--noheadings", "--separator", "|", "-o", "vg_name,lv_name,pool_lv",
                  self.fast.name, self.big.name).stdout
        rows = {tuple(x.strip() for x in line.split("|")) for line in out.splitlines()
                if line.strip()}
        return {r for r in rows if r[1] not in ("pool", "pool2")}  # type: ignore[misc]

    def where(self, lv: str) -> tuple[str, str]:
        """(vg, pool) of an LV, which must exist exactly once."""
        found = [(vg, pool) for vg, name, pool in self.all_lvs() if name == lv]
        assert len(found) == 1, (lv, found)
        return found[0]


CONFIG = """\
# two VGs, one of them with two pools
default = "fast"

[classes.fast]
volume_group = "{fast}"
thin_pool = "pool"

[classes.fast.lvcreate]
readahead = 1024

[classes.big]
volume_group = "{big}"
thin_pool = "pool"
overprovision_ratio = 2.0
default_fs_type = "xfs"

[classes.archive]
volume_group = "{big}"
thin_pool = "pool2"
"""


def _config(workdir: Path, text: str) -> Path:
    path = workdir / "classes.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def classes() -> Iterator[Classes]:
    fast = make_vg(1 << 30)
    big = make_vg(3 << 30, pool_percent=40)
    run("lvcreate", "--yes", "--type", "thin-pool", "--extents", "40%VG", "--name", "pool2",
        big.name)
    workdir = SCRATCH / f"dc-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    plugin = PluginProcess(vg=fast, workdir=workdir,
                           config_file=_config(workdir, CONFIG.format(fast=fast.name,
                                                                        big=big.name)))
    plugin.start()
    yield Classes(fast, big, plugin)
    plugin.stop()
    unmount_under(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    fast.destroy()
    big.destroy()


@pytest.fixture
def dc(classes: Classes, request: pytest.FixtureRequest) -> Iterator[Classes]:
    mark = len(classes.plugin.log())
    yield classes
    if getattr(request.node, "rep_call_failed", False):
        print(f"--- plugin log (this test) ---\n{classes.plugin.log()[mark:][-20000:]}")
    # Whatever a test left: unmounted and removed behind the plugin's back,
    # then a restart (its state file is rebuilt from what is left: nothing).
    unmount_under(classes.plugin.workdir / "paths")
    for vg in (classes.fast, classes.big):
        run("lvremove", "--yes", "--select", "lv_name!=pool && lv_name!=pool2", vg.name,
            check=False)
    if classes.plugin.proc is None or classes.plugin.proc.poll() is not None:
        classes.plugin.start()


def create(p: PluginProcess, name: str, size: int = 32 * MiB, device_class: str = "",
           source: pb.VolumeContentSource | None = None,
           cap: pb.VolumeCapability | None = None) -> pb.Volume:
    params = {"deviceClass": device_class} if device_class else {}
    return p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size), parameters=params,
        volume_capabilities=[cap or mount_cap()], volume_content_source=source)).volume


def capacity(p: PluginProcess, device_class: str = "") -> int:
    params = {"deviceClass": device_class} if device_class else {}
    return p.controller.GetCapacity(pb.GetCapacityRequest(parameters=params)).available_capacity


def from_snapshot(snapshot_id: str) -> pb.VolumeContentSource:
    return pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
        snapshot_id=snapshot_id))


def from_volume(volume_id: str) -> pb.VolumeContentSource:
    return pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(
        volume_id=volume_id))


def pool_room(vg: LoopVG, pool: str, ratio: float) -> int:
    """What GetCapacity must answer for a pool: its size times the ratio, less
    the virtual sizes in it, whole extents."""
    out = run("lvs", "--noheadings", "--units", "b", "--nosuffix", "--separator", "|", "-o",
              "lv_name,lv_size,pool_lv,vg_extent_size", vg.name).stdout
    rows = [line.strip().split("|") for line in out.splitlines() if line.strip()]
    size = next(int(r[1]) for r in rows if r[0] == pool)
    used = sum(int(r[1]) for r in rows if r[2] == pool)
    extent = int(rows[0][3])
    return max(0, (int(size * ratio) - used) // extent * extent)


def test_volumes_land_in_their_class_and_capacity_is_per_class(dc: Classes) -> None:
    p = dc.plugin
    before = dc.all_lvs()
    assert capacity(p) == capacity(p, "fast") == pool_room(dc.fast, "pool", 1.0)
    assert capacity(p, "big") == pool_room(dc.big, "pool", 2.0)
    assert capacity(p, "archive") == pool_room(dc.big, "pool2", 1.0)
    assert capacity(p, "big") != capacity(p, "fast")
    assert capacity(p, "nvme-elsewhere") == 0  # a class of other nodes
    default = create(p, "dc-default")
    fast = create(p, "dc-fast", device_class="fast")
    big = create(p, "dc-big", size=320 * MiB, device_class="big")
    archive = create(p, "dc-archive", device_class="archive")
    assert dc.where(default.volume_id) == (dc.fast.name, "pool")
    assert dc.where(fast.volume_id) == (dc.fast.name, "pool")
    assert dc.where(big.volume_id) == (dc.big.name, "pool")
    assert dc.where(archive.volume_id) == (dc.big.name, "pool2")
    # The class's lvcreate options: readahead 1024 sectors on fast only (the
    # kernel's default is 256).
    ra = run("lvs", "--noheadings", "--units", "s", "--nosuffix", "-o", "lv_read_ahead",
             f"{dc.fast.name}/{fast.volume_id}").stdout.strip()
    assert float(ra) == 1024, ra
    assert run("blockdev", "--getra", f"/dev/{dc.fast.name}/{fast.volume_id}"
               ).stdout.strip() == "1024"
    ra = run("lvs", "--noheadings", "-o", "lv_read_ahead",
             f"{dc.big.name}/{big.volume_id}").stdout.strip()
    assert ra == "auto", ra
    # Room is taken from each class's own pool.
    assert capacity(p, "big") == pool_room(dc.big, "pool", 2.0)
    assert capacity(p, "archive") == pool_room(dc.big, "pool2", 1.0)
    # Idempotent in its class; the same name in another class is another volume's.
    assert create(p, "dc-big", size=320 * MiB, device_class="big") == big
    err = expect_code(Code.ALREADY_EXISTS, create, p, "dc-big", 320 * MiB, "archive")
    assert "'big'" in (err.details() or "")
    expect_code(Code.ALREADY_EXISTS, create, p, "dc-fast", 32 * MiB, "big")
    # An unknown class: INVALID_ARGUMENT naming the known ones, nothing made.
    err = expect_code(Code.INVALID_ARGUMENT, create, p, "dc-unknown", 32 * MiB, "ssd")
    assert "archive, big, fast" in (err.details() or "")
    assert dc.all_lvs() - before == {(dc.fast.name, default.volume_id, "pool"),
                                     (dc.fast.name, fast.volume_id, "pool"),
                                     (dc.big.name, big.volume_id, "pool"),
                                     (dc.big.name, archive.volume_id, "pool2")}
    # ListVolumes: every class, one list.
    listed = {e.volume.volume_id for e in p.controller.ListVolumes(pb.ListVolumesRequest()).entries}
    assert {default.volume_id, fast.volume_id, big.volume_id, archive.volume_id} <= listed
    # DeleteVolume finds each in its class.
    for v in (default, fast, big, archive):
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=v.volume_id))
    assert dc.all_lvs() == before


def test_snapshots_restores_and_clones_stay_in_their_class(dc: Classes) -> None:
    p = dc.plugin
    big = create(p, "dc-src", size=320 * MiB, device_class="big")
    snap = p.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="dc-snap", source_volume_id=big.volume_id)).snapshot
    assert dc.where(snap.snapshot_id) == (dc.big.name, "pool")
    # Naming another class for a snapshot, a restore or a clone: refused, nothing made.
    before = dc.all_lvs()
    err = expect_code(Code.INVALID_ARGUMENT, p.controller.CreateSnapshot,
                      pb.CreateSnapshotRequest(name="dc-snap2", source_volume_id=big.volume_id,
                                               parameters={"deviceClass": "fast"}))
    assert "'big'" in (err.details() or "")
    err = expect_code(Code.INVALID_ARGUMENT, create, p, "dc-restore", 320 * MiB, "fast",
                      from_snapshot(snap.snapshot_id))
    assert "'big'" in (err.details() or "") and "'fast'" in (err.details() or "")
    expect_code(Code.INVALID_ARGUMENT, create, p, "dc-clone", 320 * MiB, "archive",
                from_volume(big.volume_id))
    assert dc.all_lvs() == before
    # Naming the source's class, or none: made in the source's class.
    restored = create(p, "dc-restore", 320 * MiB, "big", from_snapshot(snap.snapshot_id))
    clone = create(p, "dc-clone", 320 * MiB, "", from_volume(big.volume_id))
    assert create(p, "dc-clone", 320 * MiB, "", from_volume(big.volume_id)) == clone
    assert dc.where(restored.volume_id) == (dc.big.name, "pool")
    assert dc.where(clone.volume_id) == (dc.big.name, "pool")
    assert restored.content_source.snapshot.snapshot_id == snap.snapshot_id
    listed = p.controller.ListSnapshots(pb.ListSnapshotsRequest()).entries
    assert snap.snapshot_id in {e.snapshot.snapshot_id for e in listed}
    assert p.controller.GetSnapshot(pb.GetSnapshotRequest(
        snapshot_id=snap.snapshot_id)).snapshot.source_volume_id == big.volume_id
    p.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    for v in (restored, clone, big):
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=v.volume_id))
    assert not {name for _, name, _ in dc.all_lvs()} & {
        snap.snapshot_id, restored.volume_id, clone.volume_id, big.volume_id}


def _fs_at(path: str) -> str:
    top = [m for m in mounts.read_mounts() if m.mount_point == path]
    assert top, f"nothing mounted at {path}"
    return top[-1].fs_type


def test_stage_uses_the_class_file_system_and_a_restart_keeps_everything(dc: Classes) -> None:
    p = dc.plugin
    big = create(p, "dc-stage-big", size=320 * MiB, device_class="big")
    fast = create(p, "dc-stage-fast")
    cap = mount_cap(fs_type="")  # no fs_type: the class's default
    staged = {}
    for v in (big, fast):
        staging, target = p.path(f"s-{v.volume_id}"), p.path(f"t-{v.volume_id}")
        p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=v.volume_id, staging_target_path=staging, volume_capability=cap))
        p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=staging, target_path=target,
            volume_capability=cap))
        staged[v.volume_id] = (staging, target)
    assert _fs_at(staged[big.volume_id][0]) == "xfs"
    assert _fs_at(staged[fast.volume_id][0]) == "ext4"
    with open(f"{staged[big.volume_id][1]}/kept", "w") as f:
        f.write("big")
    # kill -9 and start again: the state file and LVM give every volume its class.
    p.restart(kill=True)
    listed = {e.volume.volume_id: e for e in
              p.controller.ListVolumes(pb.ListVolumesRequest()).entries}
    assert {big.volume_id, fast.volume_id} <= set(listed)
    assert not listed[big.volume_id].status.volume_condition.abnormal
    for vid, (_staging, target) in staged.items():
        stats = p.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
            volume_id=vid, volume_path=target))
        assert not stats.volume_condition.abnormal, stats.volume_condition.message
        # Still staged and published: DeleteVolume refuses.
        expect_code(Code.FAILED_PRECONDITION, p.controller.DeleteVolume,
                    pb.DeleteVolumeRequest(volume_id=vid))
    # Online growth inside its own class's pool.
    grown = p.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=big.volume_id, capacity_range=pb.CapacityRange(required_bytes=400 * MiB),
        volume_capability=cap))
    assert grown.capacity_bytes >= 400 * MiB
    p.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=big.volume_id, volume_path=staged[big.volume_id][1]))
    assert dc.where(big.volume_id) == (dc.big.name, "pool")
    assert open(f"{staged[big.volume_id][1]}/kept").read() == "big"
    for vid, (staging, target) in staged.items():
        p.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid,
                                                                 target_path=target))
        p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid,
                                                             staging_target_path=staging))
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert not {name for _, name, _ in dc.all_lvs()} & set(staged)


def test_a_class_whose_volume_group_is_missing(dc: Classes) -> None:
    """A class on a VG that is not there (a disk not attached yet): the node
    is ready and serves the other classes; that class has room for nothing,
    and no volume may look deleted because of it."""
    workdir = SCRATCH / f"dc-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    text = CONFIG.format(fast=dc.fast.name, big=dc.big.name) + (
        '\n[classes.gone]\nvolume_group = "csitestnotattached"\nthin_pool = "pool"\n')
    p = PluginProcess(vg=dc.fast, workdir=workdir, config_file=_config(workdir, text))
    p.start()
    try:
        assert p.identity.Probe(pb.ProbeRequest()).ready.value
        assert "csitestnotattached" in p.log() and "gone" in p.log()
        assert capacity(p, "gone") == 0
        assert capacity(p, "fast") > 0
        expect_code(Code.UNAVAILABLE, create, p, "dc-gone", 32 * MiB, "gone")
        # A VG this node never had holds nothing: an ID found nowhere else is gone
        # (a VG it had: test_a_volume_group_the_node_had_goes_missing).
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id="csi-v-" + "0" * 32))
        expect_code(Code.NOT_FOUND, p.controller.ControllerGetVolume,
                    pb.ControllerGetVolumeRequest(volume_id="csi-v-" + "0" * 32))
        v = create(p, "dc-present", device_class="big")
        assert dc.where(v.volume_id) == (dc.big.name, "pool")
        # A pool this node never had holds nothing: the lists of the other
        # classes go on (LVM keeps no metadata backup of a VG never here).
        snap = p.controller.CreateSnapshot(pb.CreateSnapshotRequest(
            source_volume_id=v.volume_id, name="dc-present-snap")).snapshot
        listed = p.controller.ListVolumes(pb.ListVolumesRequest())
        assert [e.volume.volume_id for e in listed.entries] == [v.volume_id]
        snaps = p.controller.ListSnapshots(pb.ListSnapshotsRequest())
        assert [e.snapshot.snapshot_id for e in snaps.entries] == [snap.snapshot_id]
        assert (p.state_dir / "volume-groups.json").exists()
        p.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=v.volume_id))
        assert v.volume_id not in {name for _, name, _ in dc.all_lvs()}
    finally:
        p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_volume_group_the_node_had_goes_missing(dc: Classes) -> None:
    """A VG with a volume, then detached: listing answers UNAVAILABLE (its volumes may
    be there), after a restart too, and after the record is lost as well. Attached
    again, everything is back."""
    third = make_vg(512 * MiB)
    workdir = SCRATCH / f"dc-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    text = CONFIG.format(fast=dc.fast.name, big=dc.big.name) + (
        f'\n[classes.third]\nvolume_group = "{third.name}"\nthin_pool = "pool"\n')
    p = PluginProcess(vg=dc.fast, workdir=workdir, config_file=_config(workdir, text))
    p.start()
    try:
        v = create(p, "dc-third", device_class="third")
        other = create(p, "dc-fast")
        run("vgchange", "--activate", "n", third.name)
        run("losetup", "--detach", third.loop)  # the disk is gone
        assert run("vgs", third.name, check=False).returncode == 5
        record = p.state_dir / "volume-groups.json"
        # As it is; after a restart; after a restart with the record lost (then
        # it is made again from LVM).
        for when in ("running", "restarted", "record-lost"):
            if when == "record-lost":
                # Held either way: LVM's metadata backup of the VG says so, or,
                # where LVM keeps none it can show, nothing says otherwise. Which
                # of the two decides is tested in tests/unit (test_device_class_servicers).
                found = backup_dir(ProcessRunner())
                print(f"LVM's metadata backups: {found}; of {third.name}: "
                      f"{found is not None and (Path(found) / third.name).is_file()}")
                record.unlink()
            if when != "running":
                p.restart(kill=False)
            assert third.name in record.read_text(), when
            expect_code(Code.UNAVAILABLE, p.controller.ListVolumes, pb.ListVolumesRequest())
            expect_code(Code.UNAVAILABLE, p.controller.ListSnapshots,
                        pb.ListSnapshotsRequest())
            expect_code(Code.UNAVAILABLE, p.controller.DeleteVolume,
                        pb.DeleteVolumeRequest(volume_id=v.volume_id))
            # Nor is a new volume made in another class: its name may be in the
            # missing VG (volumes/placement.py).
            expect_code(Code.UNAVAILABLE, create, p, f"dc-new-{when}", 32 * MiB, "fast")
        third.loop = run("losetup", "--find", "--show", str(third.image)).stdout.strip()
        run("vgchange", "--activate", "y", third.name)  # LVM reads the devices again
        listed = p.controller.ListVolumes(pb.ListVolumesRequest())
        assert sorted(e.volume.volume_id for e in listed.entries) == sorted(
            [v.volume_id, other.volume_id])
        for vol in (v, other):
            p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    finally:
        p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        third.destroy()


BAD = [
    ("unknown-key", "[classes.fast]\nvolume_group = \"vg\"\nthin_pool = \"pool\"\n"
     "stripes = 2\n", ":4:", "stripes"),
    ("not-allowed", "[classes.fast]\nvolume_group = \"vg\"\nthin_pool = \"pool\"\n\n"
     "[classes.fast.lvcreate]\nstripesize = 64\n", ":6:", "thin pool"),
    ("no-default", "[classes.a]\nvolume_group = \"vg\"\nthin_pool = \"p1\"\n"
     "[classes.b]\nvolume_group = \"vg\"\nthin_pool = \"p2\"\n", "", "no default"),
    ("syntax", "[classes.fast\nvolume_group = \"vg\"\n", ":1:", "TOML syntax"),
]


def test_bad_configuration_is_refused_at_start(tmp_path: Path) -> None:
    for name, text, where, words in BAD:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        proc = subprocess.run(
            [sys.executable, "-m", "csi_local", "serve", "--node-id", "n1",
             "--endpoint", f"unix://{tmp_path}/{name}.sock", "--config", str(path),
             "--state-dir", str(tmp_path / "state"), "--lock-dir", str(tmp_path / "locks")],
            capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode != 0, name
        assert str(path) + where in proc.stderr and words in proc.stderr, (name, proc.stderr)
        assert not (tmp_path / f"{name}.sock").exists()
    # Both ways at once.
    (tmp_path / "x.toml").write_text('[classes.a]\nvolume_group = "vg"\nthin_pool = "p"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "csi_local", "serve", "--node-id", "n1",
         "--endpoint", f"unix://{tmp_path}/both.sock", "--config", str(tmp_path / "x.toml"),
         "--volume-group", "vg", "--thin-pool", "pool"],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "not both" in proc.stderr, proc.stderr


# Every lvcreate option docs/device-classes.md documents, with each kind of value, and
# the read-ahead in sectors that `lvs -o lv_read_ahead` shows for it.
CLASS_OPTIONS = [
    ('readahead = "auto"', "auto"),
    ('readahead = "none"', "0"),
    ("readahead = 1024", "1024"),
    ("readahead = 8", "8"),
]


def _read_ahead(vg: str, lv: str) -> str:
    shown = run("lvs", "--noheadings", "--units", "s", "--nosuffix", "-o", "lv_read_ahead",
                f"{vg}/{lv}").stdout.strip()
    return shown if shown == "auto" else str(int(float(shown)))


@pytest.mark.parametrize(("option", "shown"), CLASS_OPTIONS, ids=[o for o, _ in CLASS_OPTIONS])
def test_every_documented_lvcreate_option_with_real_lvm(vg: LoopVG, option: str,
                                                        shown: str) -> None:
    """The class's options as the plugin reads them from the file, given to a real
    lvcreate of a volume and of a clone (both take them), and read back through lvs."""
    text = (f'[classes.c]\nvolume_group = "{vg.name}"\nthin_pool = "{vg.pool}"\n\n'
            f"[classes.c.lvcreate]\n{option}\n")
    (cls,) = classes_mod.parse_classes(text, source="t.toml").classes
    lvm = Lvm(ProcessRunner(), vg.name, vg.pool, cls.lvcreate_args)
    lvm.create_thin("opt-vol", 32 * MiB, [])
    lvm.snapshot("opt-vol", "opt-clone", [], writable_volume=True)
    assert _read_ahead(vg.name, "opt-vol") == shown
    assert _read_ahead(vg.name, "opt-clone") == shown


def test_autoactivation_is_refused_as_lvm_refuses_it(vg: LoopVG) -> None:
    """`autoactivation` is no class option: real lvcreate refuses --setautoactivation for
    thin volumes and thin snapshots, so the file is refused at start instead of every
    CreateVolume of the class failing; and the way the message points to works."""
    for value in ("y", "n"):
        thin = run("lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}", "--virtualsize",
                   "32m", "--name", "aa-vol", "--setautoactivation", value, check=False)
        assert thin.returncode == 3 and "unsupported with thins" in thin.stderr, thin
    run("lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}", "--virtualsize", "32m",
        "--name", "aa-vol")
    snap = run("lvcreate", "--yes", "--snapshot", "--name", "aa-snap",
               "--setautoactivation", "n", f"{vg.name}/aa-vol", check=False)
    assert snap.returncode == 3 and "unsupported with snapshots" in snap.stderr, snap
    assert vg.lv_names() == ["aa-vol"]
    text = (f'[classes.c]\nvolume_group = "{vg.name}"\nthin_pool = "{vg.pool}"\n\n'
            "[classes.c.lvcreate]\nautoactivation = false\n")
    with pytest.raises(classes_mod.ClassConfigError, match="vgchange --setautoactivation"):
        classes_mod.parse_classes(text, source="t.toml")
    run("vgchange", "--setautoactivation", "n", vg.name)
    try:
        shown = run("vgs", "--noheadings", "-o", "autoactivation", vg.name).stdout.strip()
        assert shown == "", shown  # LVM shows "enabled" only while it is on
    finally:
        run("vgchange", "--setautoactivation", "y", vg.name)
    assert run("vgs", "--noheadings", "-o", "autoactivation",
               vg.name).stdout.strip() == "enabled"
