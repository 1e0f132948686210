"""Snapshots: create, list, get, delete, paging; restore and clone with data checks."""

from __future__ import annotations

import os

import grpc
import pytest

from sanity import csi_pb2, paging
from sanity.csi import (
    Capabilities,
    Config,
    Stubs,
    Tracker,
    expect_code,
    list_all_snapshots,
    read_data,
    wait_ready,
    write_data,
)


@pytest.fixture
def snaps(caps: Capabilities) -> Capabilities:
    caps.require_controller("CREATE_DELETE_VOLUME", "CREATE_DELETE_SNAPSHOT")
    return caps


def test_create_snapshot_fields(snaps: Capabilities, tracker: Tracker) -> None:
    vol = tracker.create_volume()
    snap = tracker.create_snapshot(vol.volume_id)
    assert snap.source_volume_id == vol.volume_id, "Snapshot.source_volume_id is wrong"
    assert snap.HasField("creation_time") and snap.creation_time.seconds > 0, (
        "Snapshot.creation_time is REQUIRED")
    assert snap.size_bytes >= 0


def test_snapshot_name_reuse_other_source(snaps: Capabilities, tracker: Tracker) -> None:
    a = tracker.create_volume()
    b = tracker.create_volume()
    name = tracker.name("snap")
    tracker.create_snapshot(a.volume_id, name)
    try:
        snap = tracker.create_snapshot(b.volume_id, name)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS, (
            f"expected ALREADY_EXISTS, got {err.code().name}")
        return
    pytest.fail(f"snapshot name reused for another source volume gave {snap.snapshot_id}")


def test_list_snapshots_by_id_and_source(snaps: Capabilities, tracker: Tracker,
                                         stubs: Stubs) -> None:
    snaps.require_controller("LIST_SNAPSHOTS")
    vol = tracker.create_volume()
    other = tracker.create_volume()
    snap = tracker.create_snapshot(vol.volume_id)
    decoy = tracker.create_snapshot(other.volume_id)
    by_id = [s for p in list_all_snapshots(stubs, snapshot_id=snap.snapshot_id) for s in p]
    assert by_id == [snap.snapshot_id], f"list by snapshot_id gave {by_id}"
    by_src = [s for p in list_all_snapshots(stubs, source_volume_id=vol.volume_id) for s in p]
    assert by_src == [snap.snapshot_id], f"list by source_volume_id gave {by_src}"
    everything = [s for p in list_all_snapshots(stubs) for s in p]
    assert {snap.snapshot_id, decoy.snapshot_id} <= set(everything)


def test_get_snapshot(snaps: Capabilities, tracker: Tracker, stubs: Stubs) -> None:
    snaps.require_controller("GET_SNAPSHOT")
    vol = tracker.create_volume()
    snap = tracker.create_snapshot(vol.volume_id)
    got = stubs.controller.GetSnapshot(
        csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot
    assert got.snapshot_id == snap.snapshot_id
    assert got.source_volume_id == vol.volume_id


def test_delete_snapshot(snaps: Capabilities, tracker: Tracker, stubs: Stubs) -> None:
    vol = tracker.create_volume()
    snap = tracker.create_snapshot(vol.volume_id)
    tracker.delete_snapshot(snap.snapshot_id)
    checked = False
    if "LIST_SNAPSHOTS" in snaps.controller:
        ids = [s for p in list_all_snapshots(stubs) for s in p]
        assert snap.snapshot_id not in ids, "deleted snapshot is still listed"
        checked = True
    if "GET_SNAPSHOT" in snaps.controller:
        expect_code(grpc.StatusCode.NOT_FOUND, lambda: stubs.controller.GetSnapshot(
            csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)))
        checked = True
    if not checked:
        pytest.skip("plugin does not advertise LIST_SNAPSHOTS or GET_SNAPSHOT")


@pytest.mark.access_type
def test_snapshot_survives_source_deletion(snaps: Capabilities, tracker: Tracker,
                                           stubs: Stubs, cfg: Config) -> None:
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    payload = os.urandom(4096)
    write_data(target, cfg.access_type, payload)
    snap = wait_ready(stubs, snaps, tracker.create_snapshot(vol.volume_id))
    tracker.release(vol.volume_id, staging, target)
    try:
        tracker.delete_volume(vol.volume_id)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
            pytest.skip("plugin keeps volumes with snapshots (FAILED_PRECONDITION on delete)")
        raise
    restored = tracker.create_volume(source=_snap_source(snap.snapshot_id))
    _, target2 = tracker.make_available(restored.volume_id)
    assert read_data(target2, cfg.access_type, len(payload)) == payload


def _snap_source(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id))


@pytest.mark.access_type
def test_restore_snapshot_data(snaps: Capabilities, tracker: Tracker, stubs: Stubs,
                               cfg: Config) -> None:
    vol = tracker.create_volume()
    _, target = tracker.make_available(vol.volume_id)
    original = b"snapshot-data:" + os.urandom(4082)
    write_data(target, cfg.access_type, original)
    snap = wait_ready(stubs, snaps, tracker.create_snapshot(vol.volume_id))
    overwritten = b"after-snapshot:" + os.urandom(4081)
    write_data(target, cfg.access_type, overwritten)
    restored = tracker.create_volume(source=_snap_source(snap.snapshot_id))
    assert restored.volume_id != vol.volume_id
    _, target2 = tracker.make_available(restored.volume_id)
    got = read_data(target2, cfg.access_type, len(original))
    assert got == original, (
        "restored volume does not hold the snapshot's data"
        + (" (it holds the source's later data)" if got == overwritten else ""))
    assert read_data(target, cfg.access_type, len(overwritten)) == overwritten


@pytest.mark.access_type
def test_clone_volume_data(caps: Capabilities, tracker: Tracker, cfg: Config) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME", "CLONE_VOLUME")
    vol = tracker.create_volume()
    _, target = tracker.make_available(vol.volume_id)
    payload = b"clone-data:" + os.urandom(4085)
    write_data(target, cfg.access_type, payload)
    src = csi_pb2.VolumeContentSource(
        volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=vol.volume_id))
    clone = tracker.create_volume(source=src)
    assert clone.volume_id != vol.volume_id
    write_data(target, cfg.access_type, b"changed-after-clone" + os.urandom(64))
    _, target2 = tracker.make_available(clone.volume_id)
    assert read_data(target2, cfg.access_type, len(payload)) == payload


def test_restore_smaller_than_snapshot(snaps: Capabilities, tracker: Tracker,
                                       cfg: Config) -> None:
    vol = tracker.create_volume(required=cfg.volume_size)
    snap = tracker.create_snapshot(vol.volume_id)
    if snap.size_bytes <= 0:
        pytest.skip("snapshot size_bytes unknown (0)")
    small = snap.size_bytes // 2
    req = tracker.create_request(required=small, limit=small,
                                 source=_snap_source(snap.snapshot_id))
    try:
        got = tracker.create(req)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT), (
            f"expected OUT_OF_RANGE, got {err.code().name}")
        return
    pytest.fail(f"restoring a {snap.size_bytes} B snapshot into {got.capacity_bytes} B worked")


# ---------------------------------------------------------------- ListSnapshots pagination


def _snapshots_page(stubs: Stubs) -> paging.ListPage:
    def list_page(max_entries: int, token: str) -> tuple[list[str], str]:
        resp = stubs.controller.ListSnapshots(
            csi_pb2.ListSnapshotsRequest(max_entries=max_entries, starting_token=token))
        return [e.snapshot.snapshot_id for e in resp.entries], resp.next_token
    return list_page


@pytest.fixture
def listed(snaps: Capabilities, tracker: Tracker) -> list[str]:
    snaps.require_controller("LIST_SNAPSHOTS")
    self_vol = tracker.create_volume()
    return [tracker.create_snapshot(self_vol.volume_id).snapshot_id for _ in range(5)]


def test_list_snapshots_max_entries(stubs: Stubs, listed: list[str]) -> None:
    paging.check_max_entries(_snapshots_page(stubs), listed)


def test_list_snapshots_walk_all_pages(stubs: Stubs, listed: list[str]) -> None:
    paging.check_walk(_snapshots_page(stubs), listed)


def test_list_snapshots_invalid_token(stubs: Stubs, caps: Capabilities) -> None:
    caps.require_controller("LIST_SNAPSHOTS")
    paging.check_invalid_token(_snapshots_page(stubs))


def test_list_snapshots_stable_while_changing(stubs: Stubs, listed: list[str],
                                              tracker: Tracker) -> None:
    src = next(iter(tracker.volumes))
    paging.check_stability(_snapshots_page(stubs), listed, tracker.delete_snapshot,
                           lambda: tracker.create_snapshot(src).snapshot_id)
