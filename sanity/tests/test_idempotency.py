"""Every mutating call repeated N times (--idempotency-repeats) gives the same result once."""

from __future__ import annotations

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import (
    Capabilities,
    Config,
    Stubs,
    Tracker,
    is_mount_point,
    list_all_snapshots,
    list_all_volumes,
    mount_points,
    mounts_under,
)


@pytest.fixture
def cv(caps: Capabilities) -> Capabilities:
    caps.require_controller("CREATE_DELETE_VOLUME")
    return caps


def _volume_ids(stubs: Stubs) -> set[str]:
    return {v for page in list_all_volumes(stubs) for v in page}


def test_create_volume_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                cfg: Config) -> None:
    listing = "LIST_VOLUMES" in cv.controller
    before = _volume_ids(stubs) if listing else set()
    req = tracker.create_request()
    first = tracker.create(req)
    for i in range(1, cfg.repeats):
        again = tracker.create(req)
        assert again.volume_id == first.volume_id, (
            f"retry {i} of CreateVolume({req.name}) returned volume {again.volume_id}, "
            f"first call returned {first.volume_id}")
        assert again.capacity_bytes == first.capacity_bytes
    if listing:
        new = _volume_ids(stubs) - before
        assert new == {first.volume_id}, f"{cfg.repeats} identical CreateVolume calls made {new}"


def test_delete_volume_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                cfg: Config) -> None:
    vol = tracker.create_volume()
    for _ in range(cfg.repeats):
        tracker.delete_volume(vol.volume_id)
    if "LIST_VOLUMES" in cv.controller:
        assert vol.volume_id not in _volume_ids(stubs)


@pytest.mark.access_type
def test_node_stage_unstage_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                     cfg: Config) -> None:
    cv.require_node("STAGE_UNSTAGE_VOLUME")
    vol = tracker.create_volume()
    staging = tracker.stage(vol.volume_id)
    req = tracker.stage_request(vol.volume_id, staging)
    mounted_once = sorted(mounts_under(staging))
    for _ in range(1, cfg.repeats):
        stubs.node.NodeStageVolume(req)
    assert sorted(mounts_under(staging)) == mounted_once, (
        f"repeated NodeStageVolume stacked mounts: {mounts_under(staging)}")
    for _ in range(cfg.repeats):
        tracker.unstage(vol.volume_id, staging)
        assert not mounts_under(staging), f"mounts left under {staging}"


@pytest.mark.access_type
def test_node_publish_unpublish_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                         cfg: Config) -> None:
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    req = tracker.publish_request(vol.volume_id, staging, target)
    for _ in range(1, cfg.repeats):
        stubs.node.NodePublishVolume(req)
    count = mount_points().count(target)
    assert count == 1, f"{target} is mounted {count} times after repeated NodePublishVolume"
    for _ in range(cfg.repeats):
        tracker.unpublish(vol.volume_id, target)
        assert not is_mount_point(target)


def test_create_snapshot_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                  cfg: Config) -> None:
    cv.require_controller("CREATE_DELETE_SNAPSHOT")
    vol = tracker.create_volume()
    name = tracker.name("snap")
    first = tracker.create_snapshot(vol.volume_id, name)
    for i in range(1, cfg.repeats):
        again = tracker.create_snapshot(vol.volume_id, name)
        assert again.snapshot_id == first.snapshot_id, (
            f"retry {i} of CreateSnapshot({name}) returned {again.snapshot_id}, "
            f"first call returned {first.snapshot_id}")
    if "LIST_SNAPSHOTS" in cv.controller:
        ids = [s for p in list_all_snapshots(stubs, source_volume_id=vol.volume_id) for s in p]
        assert ids == [first.snapshot_id], f"snapshots of the source after retries: {ids}"


def test_delete_snapshot_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                  cfg: Config) -> None:
    cv.require_controller("CREATE_DELETE_SNAPSHOT")
    vol = tracker.create_volume()
    snap = tracker.create_snapshot(vol.volume_id)
    for _ in range(cfg.repeats):
        tracker.delete_snapshot(snap.snapshot_id)
    if "LIST_SNAPSHOTS" in cv.controller:
        ids = [s for p in list_all_snapshots(stubs, snapshot_id=snap.snapshot_id) for s in p]
        assert not ids, f"deleted snapshot still listed: {ids}"


@pytest.mark.access_type
def test_controller_expand_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                    cfg: Config) -> None:
    cv.require_controller("EXPAND_VOLUME")
    vol = tracker.create_volume()
    online_only = "ONLINE" in cv.expansion and "OFFLINE" not in cv.expansion
    if online_only:
        tracker.make_available(vol.volume_id)
    req = csi_pb2.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, volume_capability=tracker.cap(),
        capacity_range=csi_pb2.CapacityRange(required_bytes=cfg.expand_size))
    results = [stubs.controller.ControllerExpandVolume(req) for _ in range(cfg.repeats)]
    for r in results:
        assert r.capacity_bytes >= cfg.expand_size, f"expanded to {r.capacity_bytes} only"
    assert len({r.capacity_bytes for r in results}) == 1, "repeats report different capacities"


@pytest.mark.access_type
def test_node_expand_repeated(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                              cfg: Config) -> None:
    cv.require_controller("EXPAND_VOLUME")
    cv.require_node("EXPAND_VOLUME")
    if "ONLINE" not in cv.expansion:
        pytest.skip("plugin does not advertise ONLINE volume expansion")
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    stubs.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, volume_capability=tracker.cap(),
        capacity_range=csi_pb2.CapacityRange(required_bytes=cfg.expand_size)))
    req = csi_pb2.NodeExpandVolumeRequest(
        volume_id=vol.volume_id, volume_path=target, staging_target_path=staging,
        volume_capability=tracker.cap(),
        capacity_range=csi_pb2.CapacityRange(required_bytes=cfg.expand_size))
    sizes = set()
    for _ in range(cfg.repeats):
        try:
            sizes.add(stubs.node.NodeExpandVolume(req).capacity_bytes)
        except grpc.RpcError as err:
            pytest.fail(f"repeated NodeExpandVolume failed: {err.code().name}: {err.details()}")
    assert len(sizes) == 1, f"repeats report different capacities: {sizes}"
    assert is_mount_point(target) or cfg.access_type == "block"
