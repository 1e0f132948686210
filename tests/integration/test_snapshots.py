"""Snapshots, restore, clone and expansion against real LVM."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, expect_code, mount_cap, run
from tests.integration.test_node import create, publish, stage, unpublish, unstage

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode


def snap(p: PluginProcess, name: str, source: str) -> pb.Snapshot:
    return p.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name=name, source_volume_id=source)).snapshot


def restore(p: PluginProcess, name: str, *, snapshot: str = "", volume: str = "",
            size: int = 32 * MiB, limit: int = 0,
            cap: pb.VolumeCapability | None = None) -> pb.Volume:
    src = pb.VolumeContentSource()
    if snapshot:
        src.snapshot.snapshot_id = snapshot
    else:
        src.volume.volume_id = volume
    return p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size, limit_bytes=limit),
        volume_capabilities=[cap or mount_cap()], volume_content_source=src)).volume


def write(path: str, data: str) -> None:
    with open(path, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.report
def test_snapshot_restore_holds_exactly_the_first_data(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "origin")
    staging, target = plugin.path("s-origin"), plugin.path("t-origin")
    stage(plugin, vid, staging)
    publish(plugin, vid, staging, target)
    write(f"{target}/a", "first")
    t0 = time.monotonic()
    s = snap(plugin, "snap-1", vid)
    snap_seconds = time.monotonic() - t0
    assert s.ready_to_use and s.size_bytes == 32 * MiB and s.source_volume_id == vid
    assert s.creation_time.seconds > 0
    # The fs was frozen and thawed: writes go on.
    write(f"{target}/a", "second")
    write(f"{target}/b", "later")
    assert snap(plugin, "snap-1", vid) == s  # idempotent
    other = create(plugin, "other")
    expect_code(Code.ALREADY_EXISTS, snap, plugin, "snap-1", other)
    t0 = time.monotonic()
    rid = restore(plugin, "restored", snapshot=s.snapshot_id).volume_id
    restore_seconds = time.monotonic() - t0
    assert restore(plugin, "restored", snapshot=s.snapshot_id).volume_id == rid
    # Clean, not merely crash-consistent: the source was frozen for the snapshot,
    # which flushes ext4's journal and clears needs_recovery (a mounted ext4
    # otherwise carries it, so a crash-consistent copy would need a replay).
    live = run("dumpe2fs", "-h", f"/dev/{vg.name}/{vid}").stdout
    assert "needs_recovery" in live
    features = run("dumpe2fs", "-h", f"/dev/{vg.name}/{rid}").stdout
    assert "needs_recovery" not in features
    rs, rt = plugin.path("s-restored"), plugin.path("t-restored")
    stage(plugin, rid, rs)
    publish(plugin, rid, rs, rt)
    assert open(f"{rt}/a").read() == "first"
    assert not os.path.exists(f"{rt}/b")
    print(f"snapshot: CreateSnapshot {snap_seconds:.2f}s, restore CreateVolume "
          f"{restore_seconds:.2f}s")
    for v, st, tg in ((rid, rs, rt), (vid, staging, target)):
        unpublish(plugin, v, tg)
        unstage(plugin, v, st)


def test_list_get_delete_snapshots(plugin: PluginProcess) -> None:
    a, b = create(plugin, "la"), create(plugin, "lb")
    snaps = [snap(plugin, f"ls-{i}", a if i < 3 else b) for i in range(4)]
    got = plugin.controller.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=snaps[0].snapshot_id))
    assert got.snapshot == snaps[0]
    by_src = plugin.controller.ListSnapshots(pb.ListSnapshotsRequest(source_volume_id=b))
    assert [e.snapshot.snapshot_id for e in by_src.entries] == [snaps[3].snapshot_id]
    by_id = plugin.controller.ListSnapshots(pb.ListSnapshotsRequest(
        snapshot_id=snaps[1].snapshot_id))
    assert [e.snapshot for e in by_id.entries] == [snaps[1]]
    seen, token = [], ""
    while True:
        page = plugin.controller.ListSnapshots(pb.ListSnapshotsRequest(
            max_entries=3, starting_token=token))
        assert len(page.entries) <= 3
        seen += [e.snapshot.snapshot_id for e in page.entries]
        token = page.next_token
        if not token:
            break
    assert sorted(seen) == sorted(s.snapshot_id for s in snaps)
    expect_code(Code.ABORTED, plugin.controller.ListSnapshots,
                pb.ListSnapshotsRequest(starting_token="bogus"))
    # ListVolumes shows volumes only.
    vols = plugin.controller.ListVolumes(pb.ListVolumesRequest())
    assert sorted(e.volume.volume_id for e in vols.entries) == sorted([a, b])
    for s in snaps:
        plugin.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s.snapshot_id))
        plugin.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s.snapshot_id))
    expect_code(Code.NOT_FOUND, plugin.controller.GetSnapshot,
                pb.GetSnapshotRequest(snapshot_id=snaps[0].snapshot_id))
    expect_code(Code.NOT_FOUND, snap, plugin, "orphan", "csi-v-" + "3" * 32)


def test_origin_deleted_then_restore(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "doomed", cap=block_cap())
    run("dd", "if=/dev/urandom", "of=/run/csi-local-tests/doomed.bin", "bs=1M", "count=2")
    blob = open("/run/csi-local-tests/doomed.bin", "rb").read()
    with open(f"/dev/{vg.name}/{vid}", "r+b") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    s = snap(plugin, "keep-me", vid)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert vid not in vg.lv_names() and s.snapshot_id in vg.lv_names()
    listed = plugin.controller.ListSnapshots(pb.ListSnapshotsRequest(
        snapshot_id=s.snapshot_id)).entries
    assert listed[0].snapshot.source_volume_id == vid
    rid = restore(plugin, "reborn", snapshot=s.snapshot_id, size=64 * MiB,
                  cap=block_cap()).volume_id
    with open(f"/dev/{vg.name}/{rid}", "rb") as f:
        assert f.read(len(blob)) == blob
        assert f.seek(0, os.SEEK_END) == 64 * MiB


def test_clone_of_live_mounted_volume(plugin: PluginProcess) -> None:
    vid = create(plugin, "live")
    staging, target = plugin.path("s-live"), plugin.path("t-live")
    stage(plugin, vid, staging)
    publish(plugin, vid, staging, target)
    write(f"{target}/data", "cloned")
    cid = restore(plugin, "clone", volume=vid, size=64 * MiB).volume_id
    cs = plugin.path("s-clone")
    stage(plugin, cid, cs)
    assert open(f"{cs}/data").read() == "cloned"
    # Grown past its source: the fs was grown at the first stage.
    assert os.statvfs(cs).f_blocks * os.statvfs(cs).f_frsize > 48 * MiB
    unstage(plugin, cid, cs)
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_restore_and_clone_errors(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "src", size=64 * MiB)
    s = snap(plugin, "src-snap", vid)
    expect_code(Code.OUT_OF_RANGE, restore, plugin, "small", snapshot=s.snapshot_id,
                size=16 * MiB, limit=16 * MiB)
    expect_code(Code.NOT_FOUND, restore, plugin, "nosrc", snapshot="csi-s-" + "4" * 32)
    expect_code(Code.NOT_FOUND, restore, plugin, "nosrc2", volume="csi-v-" + "5" * 32)
    first = restore(plugin, "r1", snapshot=s.snapshot_id, size=64 * MiB)
    expect_code(Code.ALREADY_EXISTS, restore, plugin, "r1", volume=vid, size=64 * MiB)
    assert sorted(vg.lv_names()) == sorted([vid, s.snapshot_id, first.volume_id])
    assert first.content_source.snapshot.snapshot_id == s.snapshot_id


def test_kill_during_create_snapshot_then_retry_converges(plugin: PluginProcess,
                                                          vg: LoopVG) -> None:
    vid = create(plugin, "k-src")
    staging = plugin.path("s-k")
    stage(plugin, vid, staging)
    before = set(vg.lv_names())
    fut = plugin.controller.CreateSnapshot.future(pb.CreateSnapshotRequest(
        name="k-snap", source_volume_id=vid))
    # Kill as soon as the lvcreate is under way (or done).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "CreateSnapshot request" in plugin.log() or "lvcreate" in plugin.log():
            break
        time.sleep(0.05)
    plugin.kill()
    with pytest.raises(grpc.RpcError):
        fut.result()
    plugin.start()
    s = snap(plugin, "k-snap", vid)
    after = set(vg.lv_names())
    assert after - before == {s.snapshot_id}
    # The fs is not left frozen: a write completes.
    write(f"{staging}/after-kill", "ok")
    unstage(plugin, vid, staging)


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_online_expansion_while_published(plugin: PluginProcess, fs_type: str) -> None:
    size = 320 * MiB
    cap = mount_cap(fs_type)
    vid = create(plugin, f"grow-{fs_type}", size=size, cap=cap)
    staging, target = plugin.path(f"s-g-{fs_type}"), plugin.path(f"t-g-{fs_type}")
    stage(plugin, vid, staging, cap)
    publish(plugin, vid, staging, target, cap)
    write(f"{target}/keep", "kept")
    before = os.statvfs(target).f_blocks * os.statvfs(target).f_frsize
    resp = plugin.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size + 128 * MiB),
        volume_capability=cap))
    assert resp.capacity_bytes == size + 128 * MiB and resp.node_expansion_required
    again = plugin.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size + 128 * MiB)))
    assert again.capacity_bytes == resp.capacity_bytes
    node = plugin.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=target,
        capacity_range=pb.CapacityRange(required_bytes=size + 128 * MiB)))
    assert node.capacity_bytes == size + 128 * MiB
    after = os.statvfs(target).f_blocks * os.statvfs(target).f_frsize
    assert after - before > 100 * MiB
    assert open(f"{target}/keep").read() == "kept"
    # Node-only growth (what --node-expansion-only relies on): LV and fs in one call.
    node = plugin.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=target,
        capacity_range=pb.CapacityRange(required_bytes=size + 256 * MiB)))
    assert node.capacity_bytes == size + 256 * MiB
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize - after > 100 * MiB
    expect_code(Code.OUT_OF_RANGE, plugin.controller.ControllerExpandVolume,
                pb.ControllerExpandVolumeRequest(volume_id=vid, capacity_range=pb.CapacityRange(
                    required_bytes=size, limit_bytes=size)))
    expect_code(Code.NOT_FOUND, plugin.controller.ControllerExpandVolume,
                pb.ControllerExpandVolumeRequest(volume_id="csi-v-" + "6" * 32,
                                                 capacity_range=pb.CapacityRange(
                                                     required_bytes=size)))
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_block_volume_growth(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "grow-blk", cap=block_cap())
    staging, target = plugin.path("s-gb"), plugin.path("dev", "gb")
    stage(plugin, vid, staging, block_cap())
    publish(plugin, vid, staging, target, block_cap())
    resp = plugin.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capability=block_cap()))
    assert resp.capacity_bytes == 64 * MiB and not resp.node_expansion_required
    node = plugin.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=target))
    assert node.capacity_bytes == 64 * MiB
    with open(target, "rb") as f:
        assert f.seek(0, os.SEEK_END) == 64 * MiB
    assert mounts.is_mount_point(target)
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)
