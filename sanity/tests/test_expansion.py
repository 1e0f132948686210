"""Volume expansion: ControllerExpandVolume (node_expansion_required honoured), NodeExpandVolume."""

from __future__ import annotations

import os

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import Capabilities, Config, Stubs, Tracker, device_size, read_data, write_data

pytestmark = pytest.mark.access_type


def _fs_total(target: str) -> int:
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


def _observed_size(target: str, cfg: Config) -> int:
    return device_size(target) if cfg.access_type == "block" else _fs_total(target)


def _stats_total(stubs: Stubs, vol_id: str, target: str, staging: str) -> int | None:
    resp = stubs.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vol_id, volume_path=target, staging_target_path=staging))
    by = [u.total for u in resp.usage if u.unit == csi_pb2.VolumeUsage.BYTES]
    return by[0] if by else None


def _expand_flow(stubs: Stubs, caps: Capabilities, tracker: Tracker, cfg: Config,
                 online: bool) -> None:
    vol = tracker.create_volume()
    payload = os.urandom(4096)
    staging, target = tracker.make_available(vol.volume_id)
    write_data(target, cfg.access_type, payload)
    before = _observed_size(target, cfg)
    if not online:
        tracker.release(vol.volume_id, staging, target)
    resp = stubs.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, volume_capability=tracker.cap(),
        capacity_range=csi_pb2.CapacityRange(required_bytes=cfg.expand_size)))
    assert resp.capacity_bytes >= cfg.expand_size, (
        f"ControllerExpandVolume to {cfg.expand_size} reported {resp.capacity_bytes}")
    if not online:
        staging, target = tracker.make_available(vol.volume_id)
    if resp.node_expansion_required:
        assert "EXPAND_VOLUME" in caps.node, (
            "node_expansion_required=true but the node does not advertise EXPAND_VOLUME")
        stubs.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
            volume_id=vol.volume_id, volume_path=target, staging_target_path=staging,
            volume_capability=tracker.cap(),
            capacity_range=csi_pb2.CapacityRange(required_bytes=cfg.expand_size)))
    after = _observed_size(target, cfg)
    if cfg.access_type == "block":
        assert after >= cfg.expand_size, f"block device is {after} B after expansion"
    else:
        assert after > before, f"file system is {after} B after expansion (before: {before} B)"
        if "GET_VOLUME_STATS" in caps.node:
            total = _stats_total(stubs, vol.volume_id, target, staging)
            assert total is not None and total > before, (
                f"NodeGetVolumeStats total {total} does not show the expansion from {before}")
    assert read_data(target, cfg.access_type, len(payload)) == payload, "data lost by expansion"


def test_controller_expand_offline(stubs: Stubs, caps: Capabilities, tracker: Tracker,
                                   cfg: Config) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME", "EXPAND_VOLUME")
    if "ONLINE" in caps.expansion and "OFFLINE" not in caps.expansion:
        pytest.skip("plugin does not advertise OFFLINE volume expansion")
    _expand_flow(stubs, caps, tracker, cfg, online=False)


def test_expand_online(stubs: Stubs, caps: Capabilities, tracker: Tracker,
                       cfg: Config) -> None:
    caps.require_controller("CREATE_DELETE_VOLUME", "EXPAND_VOLUME")
    if "ONLINE" not in caps.expansion:
        pytest.skip("plugin does not advertise ONLINE volume expansion")
    _expand_flow(stubs, caps, tracker, cfg, online=True)


def test_expand_below_current_size(stubs: Stubs, caps: Capabilities, tracker: Tracker,
                                   cfg: Config) -> None:
    """Shrinking is no expansion: the volume must not get smaller."""
    caps.require_controller("CREATE_DELETE_VOLUME", "EXPAND_VOLUME")
    vol = tracker.create_volume(required=cfg.expand_size)
    small = cfg.volume_size
    try:
        resp = stubs.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=vol.volume_id, volume_capability=tracker.cap(),
            capacity_range=csi_pb2.CapacityRange(required_bytes=small)))
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT), (
            f"expected OK, OUT_OF_RANGE or INVALID_ARGUMENT, got {err.code().name}")
        return
    assert resp.capacity_bytes >= cfg.expand_size, (
        f"volume shrank from {cfg.expand_size} to {resp.capacity_bytes}")
