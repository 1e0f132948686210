"""Unknown IDs: NOT_FOUND where the spec's error tables say so, OK where deletion is idempotent."""

from __future__ import annotations

import os

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import Capabilities, Stubs, Tracker, expect_code

UNKNOWN_VOLUME = "sanity-unknown-volume-0000"
UNKNOWN_SNAPSHOT = "sanity-unknown-snapshot-0000"
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def test_controller_get_volume_unknown(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("GET_VOLUME")
    expect_code(NOT_FOUND, lambda: stubs.controller.ControllerGetVolume(
        csi_pb2.ControllerGetVolumeRequest(volume_id=UNKNOWN_VOLUME)))


def test_validate_volume_capabilities_unknown(stubs: Stubs, tracker: Tracker,
                                              controller: Capabilities) -> None:
    expect_code(NOT_FOUND, lambda: stubs.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(
            volume_id=UNKNOWN_VOLUME, volume_capabilities=[tracker.cap()])))


def test_controller_expand_unknown(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("EXPAND_VOLUME")
    expect_code(NOT_FOUND, lambda: stubs.controller.ControllerExpandVolume(
        csi_pb2.ControllerExpandVolumeRequest(
            volume_id=UNKNOWN_VOLUME,
            capacity_range=csi_pb2.CapacityRange(required_bytes=1 << 30))))


def test_create_volume_from_unknown_snapshot(stubs: Stubs, caps: Capabilities,
                                             tracker: Tracker) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME", "CREATE_DELETE_SNAPSHOT")
    src = csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=UNKNOWN_SNAPSHOT))
    expect_code(NOT_FOUND, lambda: tracker.create_volume(source=src))


def test_create_volume_from_unknown_volume(stubs: Stubs, caps: Capabilities,
                                           tracker: Tracker) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME", "CLONE_VOLUME")
    src = csi_pb2.VolumeContentSource(
        volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=UNKNOWN_VOLUME))
    expect_code(NOT_FOUND, lambda: tracker.create_volume(source=src))


def test_create_snapshot_of_unknown_volume(stubs: Stubs, caps: Capabilities,
                                           tracker: Tracker) -> None:
    caps.require_controller("CREATE_DELETE_SNAPSHOT")
    expect_code(NOT_FOUND, lambda: tracker.create_snapshot(UNKNOWN_VOLUME))


def test_get_snapshot_unknown(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("GET_SNAPSHOT")
    expect_code(NOT_FOUND, lambda: stubs.controller.GetSnapshot(
        csi_pb2.GetSnapshotRequest(snapshot_id=UNKNOWN_SNAPSHOT)))


# The volume_path of NodeGetVolumeStats and NodeExpandVolume names where the
# volume should be; when it is not there, the spec's error tables prescribe
# NOT_FOUND ("volume does not exist on the specified path"). Upstream csi-sanity
# sends the relative "some/path"; an absolute path is checked as well.
VOLUME_PATHS = ["relative", "absolute"]


def _volume_path(kind: str, tracker: Tracker) -> str:
    return "some/path" if kind == "relative" else tracker.target_path()


@pytest.mark.parametrize("kind", VOLUME_PATHS)
def test_node_get_volume_stats_unknown(stubs: Stubs, caps: Capabilities,
                                       tracker: Tracker, kind: str) -> None:
    caps.require_node("GET_VOLUME_STATS")
    path = _volume_path(kind, tracker)
    expect_code(NOT_FOUND, lambda: stubs.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id=UNKNOWN_VOLUME, volume_path=path)))


@pytest.mark.parametrize("kind", VOLUME_PATHS)
def test_node_expand_unknown(stubs: Stubs, caps: Capabilities, tracker: Tracker,
                             kind: str) -> None:
    caps.require_node("EXPAND_VOLUME")
    path = _volume_path(kind, tracker)
    expect_code(NOT_FOUND, lambda: stubs.node.NodeExpandVolume(
        csi_pb2.NodeExpandVolumeRequest(
            volume_id=UNKNOWN_VOLUME, volume_path=path,
            capacity_range=csi_pb2.CapacityRange(required_bytes=1 << 30))))


def test_delete_volume_unknown_is_ok(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME")
    stubs.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=UNKNOWN_VOLUME))


def test_delete_snapshot_unknown_is_ok(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("CREATE_DELETE_SNAPSHOT")
    stubs.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=UNKNOWN_SNAPSHOT))


def test_node_unstage_unknown_is_ok(stubs: Stubs, caps: Capabilities, tracker: Tracker) -> None:
    """Spec: not staged to staging_target_path -> the Plugin MUST reply 0 OK."""
    caps.require_node("STAGE_UNSTAGE_VOLUME")
    path = tracker.staging_path()
    stubs.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
        volume_id=UNKNOWN_VOLUME, staging_target_path=path))


def test_node_unpublish_unknown(stubs: Stubs, tracker: Tracker) -> None:
    """Unpublishing what is not published is OK; NOT_FOUND is tolerated (spec error table)."""
    path = tracker.target_path()
    try:
        stubs.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=UNKNOWN_VOLUME, target_path=path))
    except grpc.RpcError as err:
        assert err.code() == NOT_FOUND, f"expected OK or NOT_FOUND, got {err.code().name}"
    assert not os.path.exists(path) or not os.path.ismount(path)


def test_list_snapshots_unknown_id_is_empty(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("LIST_SNAPSHOTS")
    resp = stubs.controller.ListSnapshots(
        csi_pb2.ListSnapshotsRequest(snapshot_id=UNKNOWN_SNAPSHOT))
    ids = [e.snapshot.snapshot_id for e in resp.entries]
    assert UNKNOWN_SNAPSHOT not in ids and not ids, f"unexpected snapshots listed: {ids}"


def test_node_stage_unknown(stubs: Stubs, caps: Capabilities, tracker: Tracker) -> None:
    caps.require_node("STAGE_UNSTAGE_VOLUME")
    req = tracker.stage_request(UNKNOWN_VOLUME, tracker.staging_path())
    try:
        stubs.node.NodeStageVolume(req)
    except grpc.RpcError as err:
        assert err.code() == NOT_FOUND, f"expected NOT_FOUND, got {err.code().name}"
        return
    tracker.staged.append((UNKNOWN_VOLUME, req.staging_target_path))
    pytest.fail("NodeStageVolume of an unknown volume succeeded")
