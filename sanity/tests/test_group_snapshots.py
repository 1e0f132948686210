"""GroupController: volume group snapshots, their members, idempotency, deletion and errors.

Runs when the plugin advertises GROUP_CONTROLLER_SERVICE and its GroupControllerGetCapabilities
lists CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT. Write-order consistency across the members
cannot be observed cheaply from outside the plugin and is not tested here.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import (
    READY_TIMEOUT,
    Capabilities,
    Config,
    Stubs,
    Tracker,
    expect_code,
    list_all_snapshots,
    read_data,
    write_data,
)

GROUP_CAP = "CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT"
UNKNOWN_VOLUME = "sanity-unknown-volume-0000"
UNKNOWN_SNAPSHOT = "sanity-unknown-snapshot-0000"
UNKNOWN_GROUP = "sanity-unknown-group-snapshot-0000"
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def group_caps(stubs: Stubs, caps: Capabilities) -> set[str]:
    caps.require_plugin("GROUP_CONTROLLER_SERVICE")
    try:
        resp = stubs.group_controller.GroupControllerGetCapabilities(
            csi_pb2.GroupControllerGetCapabilitiesRequest())
    except grpc.RpcError as err:
        # The plugin capability says the service is there; the spec requires this RPC of it.
        pytest.fail(f"the plugin advertises GROUP_CONTROLLER_SERVICE, but "
                    f"GroupControllerGetCapabilities gives {err.code().name}: {err.details()}",
                    pytrace=False)
    return {csi_pb2.GroupControllerServiceCapability.RPC.Type.Name(c.rpc.type)
           for c in resp.capabilities}


@pytest.fixture
def groups(caps: Capabilities, group_caps: set[str]) -> Capabilities:
    if GROUP_CAP not in group_caps:
        pytest.skip(f"plugin does not advertise group controller capability {GROUP_CAP}")
    caps.require_controller("CREATE_DELETE_VOLUME")
    return caps


def _ids(group: csi_pb2.VolumeGroupSnapshot) -> list[str]:
    return [s.snapshot_id for s in group.snapshots]


def get_group(stubs: Stubs, group_id: str, snapshot_ids: list[str]) -> csi_pb2.VolumeGroupSnapshot:
    group: csi_pb2.VolumeGroupSnapshot = stubs.group_controller.GetVolumeGroupSnapshot(
        csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=group_id,
                                              snapshot_ids=snapshot_ids)).group_snapshot
    return group


def wait_group_ready(stubs: Stubs,
                     group: csi_pb2.VolumeGroupSnapshot) -> csi_pb2.VolumeGroupSnapshot:
    deadline = time.monotonic() + READY_TIMEOUT
    while not (group.ready_to_use or all(s.ready_to_use for s in group.snapshots)):
        if time.monotonic() > deadline:
            pytest.fail(f"group snapshot {group.group_snapshot_id} not ready_to_use after "
                        f"{READY_TIMEOUT}s")
        time.sleep(1)
        group = get_group(stubs, group.group_snapshot_id, _ids(group))
    return group


def check_group(group: csi_pb2.VolumeGroupSnapshot, sources: list[str], what: str) -> None:
    gid = group.group_snapshot_id
    assert gid, f"{what}: group_snapshot_id is REQUIRED"
    assert group.HasField("creation_time") and group.creation_time.seconds > 0, (
        f"{what}: creation_time is REQUIRED")
    got_sources = sorted(s.source_volume_id for s in group.snapshots)
    assert got_sources == sorted(sources), (
        f"{what}: members are snapshots of {got_sources}, the group was made of {sorted(sources)}")
    ids = _ids(group)
    assert all(ids) and len(set(ids)) == len(ids), f"{what}: member snapshot ids {ids}"
    for s in group.snapshots:
        assert s.group_snapshot_id == gid, (
            f"{what}: member {s.snapshot_id} has group_snapshot_id {s.group_snapshot_id!r}, "
            f"the group is {gid!r}")
        assert s.HasField("creation_time") and s.creation_time.seconds > 0, (
            f"{what}: member {s.snapshot_id} has no creation_time")
    if not all(s.ready_to_use for s in group.snapshots):
        assert not group.ready_to_use, (
            f"{what}: group is ready_to_use while a member is not (the spec says MUST be false)")


def _snapshot_ids(stubs: Stubs, snapshot_id: str = "", source_volume_id: str = "") -> set[str]:
    return {s for page in list_all_snapshots(stubs, snapshot_id=snapshot_id,
                                             source_volume_id=source_volume_id) for s in page}


def _volumes(tracker: Tracker, n: int) -> list[str]:
    return [tracker.create_volume().volume_id for _ in range(n)]


def test_group_controller_capabilities_are_known(stubs: Stubs, group_caps: set[str]) -> None:
    resp = stubs.group_controller.GroupControllerGetCapabilities(
        csi_pb2.GroupControllerGetCapabilitiesRequest())
    for cap in resp.capabilities:
        assert cap.WhichOneof("type") == "rpc" and cap.rpc.type != 0, f"bad capability {cap}"


def test_create_group_snapshot_fields(groups: Capabilities, tracker: Tracker) -> None:
    sources = _volumes(tracker, 2)
    group = tracker.create_group_snapshot(sources)
    check_group(group, sources, "CreateVolumeGroupSnapshot")


def test_create_group_snapshot_repeated(groups: Capabilities, tracker: Tracker, stubs: Stubs,
                                        cfg: Config) -> None:
    sources = _volumes(tracker, 2)
    req = tracker.group_snapshot_request(sources)
    first = tracker.create_group(req)
    for i in range(1, cfg.repeats):
        again = tracker.create_group(req)
        assert again.group_snapshot_id == first.group_snapshot_id, (
            f"retry {i} of CreateVolumeGroupSnapshot({req.name}) returned group "
            f"{again.group_snapshot_id}, the first call {first.group_snapshot_id}")
        assert sorted(_ids(again)) == sorted(_ids(first)), (
            f"retry {i} returned members {_ids(again)}, the first call {_ids(first)}")
    if "LIST_SNAPSHOTS" in groups.controller:
        for s in first.snapshots:
            listed = _snapshot_ids(stubs, source_volume_id=s.source_volume_id)
            assert listed == {s.snapshot_id}, (
                f"{cfg.repeats} identical CreateVolumeGroupSnapshot calls left snapshots "
                f"{sorted(listed)} of volume {s.source_volume_id}")


def test_group_snapshot_name_reuse_other_members(groups: Capabilities,
                                                 tracker: Tracker) -> None:
    a, b, c = _volumes(tracker, 3)
    name = tracker.name("group")
    tracker.create_group_snapshot([a, b], name)
    try:
        other = tracker.create_group_snapshot([a, c], name)
    except grpc.RpcError as err:
        assert err.code() == Code.ALREADY_EXISTS, (
            f"expected ALREADY_EXISTS, got {err.code().name}: {err.details()}")
        return
    pytest.fail(f"group snapshot name {name} reused for other volumes gave "
                f"{other.group_snapshot_id}")


def test_get_volume_group_snapshot(groups: Capabilities, tracker: Tracker,
                                   stubs: Stubs) -> None:
    sources = _volumes(tracker, 2)
    group = tracker.create_group_snapshot(sources)
    got = get_group(stubs, group.group_snapshot_id, _ids(group))
    assert got.group_snapshot_id == group.group_snapshot_id
    assert sorted(_ids(got)) == sorted(_ids(group)), (
        f"GetVolumeGroupSnapshot lists members {_ids(got)}, CreateVolumeGroupSnapshot "
        f"returned {_ids(group)}")
    check_group(got, sources, "GetVolumeGroupSnapshot")


@pytest.mark.parametrize("mismatch", ["missing-member", "unknown-member"])
def test_get_volume_group_snapshot_mismatched_ids(groups: Capabilities, tracker: Tracker,
                                                  stubs: Stubs, mismatch: str) -> None:
    group = tracker.create_group_snapshot(_volumes(tracker, 2))
    ids = _ids(group)
    wrong = ids[:1] if mismatch == "missing-member" else [*ids, UNKNOWN_SNAPSHOT]
    expect_code(Code.INVALID_ARGUMENT,
                lambda: get_group(stubs, group.group_snapshot_id, wrong))


def test_group_members_are_snapshots(groups: Capabilities, tracker: Tracker,
                                     stubs: Stubs) -> None:
    if not {"GET_SNAPSHOT", "LIST_SNAPSHOTS"} & groups.controller:
        pytest.skip("plugin does not advertise GET_SNAPSHOT or LIST_SNAPSHOTS")
    group = tracker.create_group_snapshot(_volumes(tracker, 2))
    for member in group.snapshots:
        found: list[csi_pb2.Snapshot] = []
        if "GET_SNAPSHOT" in groups.controller:
            found.append(stubs.controller.GetSnapshot(
                csi_pb2.GetSnapshotRequest(snapshot_id=member.snapshot_id)).snapshot)
        if "LIST_SNAPSHOTS" in groups.controller:
            entries = stubs.controller.ListSnapshots(
                csi_pb2.ListSnapshotsRequest(snapshot_id=member.snapshot_id)).entries
            assert len(entries) == 1, (
                f"ListSnapshots by the id of member {member.snapshot_id} gave {len(entries)}")
            found.append(entries[0].snapshot)
        for snap in found:
            assert snap.snapshot_id == member.snapshot_id
            assert snap.source_volume_id == member.source_volume_id
            assert snap.group_snapshot_id == group.group_snapshot_id, (
                f"member {member.snapshot_id} shows group_snapshot_id "
                f"{snap.group_snapshot_id!r} outside its group")


@pytest.mark.access_type
def test_restore_group_member_data(groups: Capabilities, tracker: Tracker, stubs: Stubs,
                                   cfg: Config) -> None:
    """Each member restores its own volume's data as of the group snapshot.

    The volumes are written, then released (unpublished and unstaged), so
    that any plugin can snapshot them together; in-use volumes are the next
    test's."""
    sources = _volumes(tracker, 2)
    payloads: dict[str, bytes] = {}
    for i, vid in enumerate(sources):
        staging, target = tracker.make_available(vid)
        payloads[vid] = f"group-member-{i}:".encode() + os.urandom(4080)
        write_data(target, cfg.access_type, payloads[vid])
        tracker.release(vid, staging, target)
    group = wait_group_ready(stubs, tracker.create_group_snapshot(sources))
    for vid in sources:
        _, target = tracker.make_available(vid)
        write_data(target, cfg.access_type, b"after-group-snapshot:" + os.urandom(4075))
    _check_restores(tracker, cfg, group, payloads)


@pytest.mark.access_type
def test_group_snapshot_of_volumes_in_use(groups: Capabilities, tracker: Tracker,
                                          stubs: Stubs, cfg: Config) -> None:
    """Volumes published and written to: the group holds the data written before
    it, or the plugin refuses with FAILED_PRECONDITION (the spec: a group
    snapshot "MUST give a write-order consistency guarantee or fail if that's
    not possible"), which is reported as a skip with the plugin's reason."""
    sources = _volumes(tracker, 2)
    targets: dict[str, str] = {}
    payloads: dict[str, bytes] = {}
    for i, vid in enumerate(sources):
        _, targets[vid] = tracker.make_available(vid)
        payloads[vid] = f"in-use-member-{i}:".encode() + os.urandom(4078)
        write_data(targets[vid], cfg.access_type, payloads[vid])
    try:
        group = wait_group_ready(stubs, tracker.create_group_snapshot(sources))
    except grpc.RpcError as err:
        if err.code() == Code.FAILED_PRECONDITION:
            pytest.skip(f"the plugin cannot snapshot these in-use volumes together here "
                        f"(FAILED_PRECONDITION: {err.details()})")
        raise
    for vid in sources:
        write_data(targets[vid], cfg.access_type, b"after-group-snapshot:" + os.urandom(4075))
    _check_restores(tracker, cfg, group, payloads)


def _check_restores(tracker: Tracker, cfg: Config, group: csi_pb2.VolumeGroupSnapshot,
                    payloads: dict[str, bytes]) -> None:
    for member in group.snapshots:
        restored = tracker.create_volume(source=csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=member.snapshot_id)))
        _, target = tracker.make_available(restored.volume_id)
        want = payloads[member.source_volume_id]
        got = read_data(target, cfg.access_type, len(want))
        others = [v for v, p in payloads.items() if p == got and v != member.source_volume_id]
        assert got == want, (
            f"volume restored from member {member.snapshot_id} does not hold the data of "
            f"{member.source_volume_id} at the group snapshot"
            + (f" (it holds {others[0]}'s)" if others else ""))


def test_delete_group_snapshot(groups: Capabilities, tracker: Tracker, stubs: Stubs,
                               cfg: Config) -> None:
    sources = _volumes(tracker, 2)
    group = tracker.create_group_snapshot(sources)
    gid, ids = group.group_snapshot_id, _ids(group)
    tracker.delete_group_snapshot(gid)
    expect_code(Code.NOT_FOUND, lambda: get_group(stubs, gid, ids))
    for sid in ids:
        if "GET_SNAPSHOT" in groups.controller:
            _expect_no_snapshot(stubs, sid)
        if "LIST_SNAPSHOTS" in groups.controller:
            assert not _snapshot_ids(stubs, snapshot_id=sid), (
                f"member {sid} of the deleted group is still listed")
    if "LIST_SNAPSHOTS" in groups.controller:
        for vid in sources:
            left = _snapshot_ids(stubs, source_volume_id=vid) & set(ids)
            assert not left, f"members {sorted(left)} are still listed for volume {vid}"
    for _ in range(1, cfg.repeats):
        tracker.delete_group_snapshot(gid, ids)  # deleting again MUST be OK


def _expect_no_snapshot(stubs: Stubs, snapshot_id: str) -> None:
    expect_code(Code.NOT_FOUND, lambda: stubs.controller.GetSnapshot(
        csi_pb2.GetSnapshotRequest(snapshot_id=snapshot_id)))


def test_delete_member_snapshot_alone(groups: Capabilities, tracker: Tracker,
                                      stubs: Stubs) -> None:
    """A member "CAN NOT be deleted stand alone": DeleteSnapshot gives INVALID_ARGUMENT."""
    groups.require_controller("CREATE_DELETE_SNAPSHOT")
    group = tracker.create_group_snapshot(_volumes(tracker, 2))
    member = group.snapshots[0].snapshot_id
    expect_code(Code.INVALID_ARGUMENT, lambda: stubs.controller.DeleteSnapshot(
        csi_pb2.DeleteSnapshotRequest(snapshot_id=member)))
    got = get_group(stubs, group.group_snapshot_id, _ids(group))
    assert sorted(_ids(got)) == sorted(_ids(group)), (
        f"the group lost members after a refused DeleteSnapshot: {_ids(got)}")


def test_unknown_group_snapshot(groups: Capabilities, stubs: Stubs) -> None:
    expect_code(Code.NOT_FOUND, lambda: get_group(stubs, UNKNOWN_GROUP, [UNKNOWN_SNAPSHOT]))
    stubs.group_controller.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=UNKNOWN_GROUP, snapshot_ids=[UNKNOWN_SNAPSHOT]))


@pytest.mark.parametrize("field", ["Create.name", "Create.source_volume_ids",
                                   "Get.group_snapshot_id", "Delete.group_snapshot_id"])
def test_group_missing_required_field(groups: Capabilities, tracker: Tracker, stubs: Stubs,
                                      field: str) -> None:
    gc = stubs.group_controller
    if field.startswith("Create."):
        req = tracker.group_snapshot_request(_volumes(tracker, 2))
        req.ClearField(field.removeprefix("Create."))  # type: ignore[arg-type]
        try:
            group = gc.CreateVolumeGroupSnapshot(req).group_snapshot
        except grpc.RpcError as err:
            assert err.code() == Code.INVALID_ARGUMENT, (
                f"CreateVolumeGroupSnapshot without {field}: expected INVALID_ARGUMENT, got "
                f"{err.code().name}: {err.details()}")
            return
        tracker.track_group(group)
        pytest.fail(f"CreateVolumeGroupSnapshot without {field} succeeded")
    group = tracker.create_group_snapshot(_volumes(tracker, 1))
    if field.startswith("Get."):
        expect_code(Code.INVALID_ARGUMENT, lambda: get_group(stubs, "", _ids(group)))
    else:
        expect_code(Code.INVALID_ARGUMENT, lambda: gc.DeleteVolumeGroupSnapshot(
            csi_pb2.DeleteVolumeGroupSnapshotRequest(snapshot_ids=_ids(group))))


def test_group_snapshot_unknown_member(groups: Capabilities, tracker: Tracker,
                                       stubs: Stubs) -> None:
    """An unknown source volume fails the whole group, and leaves no member behind."""
    (vid,) = _volumes(tracker, 1)
    listing = "LIST_SNAPSHOTS" in groups.controller
    before = _snapshot_ids(stubs) if listing else set()
    try:
        group = tracker.create_group_snapshot([vid, UNKNOWN_VOLUME])
    except grpc.RpcError as err:
        assert err.code() in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), (
            f"expected NOT_FOUND or INVALID_ARGUMENT, got {err.code().name}: {err.details()}")
    else:
        pytest.fail(f"a group with unknown volume {UNKNOWN_VOLUME} was created: "
                    f"{group.group_snapshot_id}")
    if listing:
        left = _snapshot_ids(stubs) - before
        assert not left, f"the failed CreateVolumeGroupSnapshot left snapshots {sorted(left)}"
