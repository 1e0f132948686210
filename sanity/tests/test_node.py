"""Node service with real paths: stage, publish, read-only, access modes, stats, unstage."""

from __future__ import annotations

import errno
import os
import stat

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import (
    READONLY_ERRNOS,
    Capabilities,
    Config,
    Stubs,
    Tracker,
    expect_code,
    is_mount_point,
    mounts_under,
    read_data,
    write_data,
    write_fails_readonly,
)

pytestmark = pytest.mark.access_type


@pytest.fixture
def cv(caps: Capabilities) -> Capabilities:
    caps.require_controller("CREATE_DELETE_VOLUME")
    return caps


def assert_published(target: str, cfg: Config) -> None:
    if cfg.access_type == "block":
        assert stat.S_ISBLK(os.stat(target).st_mode), f"{target} is not a block device"
    else:
        assert os.path.isdir(target), f"{target} is not a directory"
        assert is_mount_point(target), f"{target} is not a mount point"


def assert_unpublished(target: str) -> None:
    assert not is_mount_point(target), f"{target} is still a mount point after unpublish"
    assert not os.path.lexists(target), f"SP MUST delete the target path it created: {target}"


def assert_unstaged(staging: str) -> None:
    left = mounts_under(staging)
    assert not left, f"mounts left under the staging path after NodeUnstageVolume: {left}"


def test_stage_publish_unpublish_unstage(cv: Capabilities, tracker: Tracker,
                                         cfg: Config) -> None:
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    assert_published(target, cfg)
    payload = os.urandom(4096)
    write_data(target, cfg.access_type, payload)
    assert read_data(target, cfg.access_type, len(payload)) == payload
    tracker.unpublish(vol.volume_id, target)
    assert_unpublished(target)
    if staging:
        tracker.unstage(vol.volume_id, staging)
        assert_unstaged(staging)


def test_unstage_leaves_no_mount(cv: Capabilities, tracker: Tracker) -> None:
    cv.require_node("STAGE_UNSTAGE_VOLUME")
    vol = tracker.create_volume()
    staging = tracker.stage(vol.volume_id)
    tracker.unstage(vol.volume_id, staging)
    assert_unstaged(staging)


def test_readonly_publish(cv: Capabilities, tracker: Tracker, cfg: Config) -> None:
    vol = tracker.create_volume()
    staging = tracker.stage(vol.volume_id)
    target = tracker.publish(vol.volume_id, staging, readonly=True)
    assert_published(target, cfg)
    err = write_fails_readonly(target, cfg.access_type)
    if cfg.access_type == "mount":
        assert err == errno.EROFS, f"write failed with {errno.errorcode.get(err)}, not EROFS"
    else:
        assert err in READONLY_ERRNOS, f"write failed with {errno.errorcode.get(err)}"


def test_publish_same_target_different_readonly(cv: Capabilities, tracker: Tracker,
                                                stubs: Stubs) -> None:
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    req = tracker.publish_request(vol.volume_id, staging, target, readonly=True)
    expect_code(grpc.StatusCode.ALREADY_EXISTS, lambda: stubs.node.NodePublishVolume(req))


def _multi_writer(caps: Capabilities) -> None:
    caps.require_node("SINGLE_NODE_MULTI_WRITER")
    caps.require_controller("SINGLE_NODE_MULTI_WRITER")


def test_single_node_single_writer_second_target(cv: Capabilities, tracker: Tracker,
                                                 stubs: Stubs) -> None:
    _multi_writer(cv)
    cap = tracker.cap("SINGLE_NODE_SINGLE_WRITER")
    vol = tracker.create_volume(caps=[cap])
    staging, _ = tracker.make_available(vol.volume_id, cap=cap)
    second = tracker.target_path()
    req = tracker.publish_request(vol.volume_id, staging, second, cap=cap)
    try:
        stubs.node.NodePublishVolume(req)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (
            f"expected FAILED_PRECONDITION, got {err.code().name}")
        return
    tracker.published.append((vol.volume_id, second))
    pytest.fail("SINGLE_NODE_SINGLE_WRITER volume was published to a second target path")


def test_single_node_multi_writer_second_target(cv: Capabilities, tracker: Tracker,
                                                cfg: Config) -> None:
    _multi_writer(cv)
    cap = tracker.cap("SINGLE_NODE_MULTI_WRITER")
    vol = tracker.create_volume(caps=[cap])
    staging, first = tracker.make_available(vol.volume_id, cap=cap)
    second = tracker.publish(vol.volume_id, staging, cap=cap)
    assert_published(first, cfg)
    assert_published(second, cfg)


def test_node_get_volume_stats(cv: Capabilities, tracker: Tracker, stubs: Stubs,
                               cfg: Config) -> None:
    cv.require_node("GET_VOLUME_STATS")
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    resp = stubs.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=target, staging_target_path=staging))
    for u in resp.usage:
        assert u.unit != csi_pb2.VolumeUsage.UNKNOWN, "VolumeUsage.unit is REQUIRED"
        assert u.total >= 0 and u.used >= 0 and u.available >= 0
    if cfg.access_type == "mount":
        by = [u for u in resp.usage if u.unit == csi_pb2.VolumeUsage.BYTES]
        assert by, "no BYTES usage for a mounted volume"
        assert 0 < by[0].total <= max(cfg.volume_size, vol.capacity_bytes)
        assert by[0].used <= by[0].total
    if "VOLUME_CONDITION" in cv.node:
        assert resp.HasField("volume_condition"), "VOLUME_CONDITION advertised, none reported"
        assert not resp.volume_condition.abnormal, resp.volume_condition.message


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_node_get_volume_stats_wrong_path(cv: Capabilities, tracker: Tracker,
                                          stubs: Stubs, kind: str) -> None:
    """A published volume asked about at a path it is not at: NOT_FOUND, for
    upstream csi-sanity's relative "some/path" and for an absolute path alike."""
    cv.require_node("GET_VOLUME_STATS")
    vol = tracker.create_volume()
    tracker.make_available(vol.volume_id)
    wrong = "some/path" if kind == "relative" else tracker.target_path()
    expect_code(grpc.StatusCode.NOT_FOUND, lambda: stubs.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=wrong)))
