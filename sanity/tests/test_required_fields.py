"""Every REQUIRED request field, left out one at a time, must give INVALID_ARGUMENT.

Each case builds an otherwise valid request (real volumes, staged where the RPC needs it),
clears exactly one field and expects INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import Capabilities, Stubs, Tracker


class Ctx:
    """Lazily creates what an otherwise valid request needs."""

    def __init__(self, tracker: Tracker, caps: Capabilities) -> None:
        self.t = tracker
        self.caps = caps
        self._vol: str | None = None
        self._staging: str | None = None

    def vol(self) -> str:
        if self._vol is None:
            if self.caps.ctrl("CREATE_DELETE_VOLUME"):
                self._vol = self.t.create_volume().volume_id
            else:
                self._vol = "sanity-nonexistent-volume"
        return self._vol

    def staged(self) -> str:
        """A volume that is staged (if the plugin stages); returns its staging path."""
        if self._staging is None:
            self._staging = self.t.stage(self.vol())
        return self._staging

    def cap(self) -> csi_pb2.VolumeCapability:
        return self.t.cap()

    def node_id(self) -> str:
        return self.t.node_id


@dataclass(frozen=True)
class Case:
    rpc: str
    field: str
    service: str  # "controller" or "node"
    ctrl_caps: tuple[str, ...]
    node_caps: tuple[str, ...]
    build: Callable[[Ctx], Any]

    @property
    def id(self) -> str:
        return f"{self.rpc}.{self.field}"


def _cv(c: Ctx, drop: str) -> csi_pb2.CreateVolumeRequest:
    req = c.t.create_request()
    if drop == "volume_capabilities[].access_mode":
        req.volume_capabilities[0].ClearField("access_mode")
    else:
        req.ClearField(drop)  # type: ignore[arg-type]
    return req


def _without(msg: Any, drop: str) -> Any:
    msg.ClearField(drop)
    return msg


CV = ("CREATE_DELETE_VOLUME",)
SNAP = ("CREATE_DELETE_SNAPSHOT",)
STAGE = ("STAGE_UNSTAGE_VOLUME",)

CASES: list[Case] = []


def case(rpc: str, fields: list[str], service: str, build: Callable[[Ctx, str], Any],
         ctrl: tuple[str, ...] = (), node: tuple[str, ...] = ()) -> None:
    for f in fields:
        CASES.append(Case(rpc, f, service, ctrl, node,
                          lambda c, f=f: build(c, f)))  # type: ignore[misc]


case("CreateVolume", ["name", "volume_capabilities", "volume_capabilities[].access_mode"],
     "controller", _cv, ctrl=CV)
case("DeleteVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.DeleteVolumeRequest(volume_id=c.vol()), f), ctrl=CV)
case("ControllerPublishVolume", ["volume_id", "node_id", "volume_capability"], "controller",
     lambda c, f: _without(csi_pb2.ControllerPublishVolumeRequest(
         volume_id=c.vol(), node_id=c.node_id(), volume_capability=c.cap()), f),
     ctrl=("PUBLISH_UNPUBLISH_VOLUME",))
case("ControllerUnpublishVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.ControllerUnpublishVolumeRequest(
         volume_id=c.vol(), node_id=c.node_id()), f),
     ctrl=("PUBLISH_UNPUBLISH_VOLUME",))
case("ValidateVolumeCapabilities", ["volume_id", "volume_capabilities"], "controller",
     lambda c, f: _without(csi_pb2.ValidateVolumeCapabilitiesRequest(
         volume_id=c.vol(), volume_capabilities=[c.cap()]), f))
case("ControllerGetVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.ControllerGetVolumeRequest(volume_id=c.vol()), f),
     ctrl=("GET_VOLUME",))
case("CreateSnapshot", ["source_volume_id", "name"], "controller",
     lambda c, f: _without(csi_pb2.CreateSnapshotRequest(
         source_volume_id=c.vol(), name=Tracker.name("snap"),
         parameters=c.t.cfg.snapshot_parameters), f), ctrl=SNAP)
case("DeleteSnapshot", ["snapshot_id"], "controller",
     lambda c, f: _without(csi_pb2.DeleteSnapshotRequest(snapshot_id="x"), f), ctrl=SNAP)
case("GetSnapshot", ["snapshot_id"], "controller",
     lambda c, f: _without(csi_pb2.GetSnapshotRequest(snapshot_id="x"), f),
     ctrl=("GET_SNAPSHOT",))
case("ControllerExpandVolume", ["volume_id", "capacity_range"], "controller",
     lambda c, f: _without(csi_pb2.ControllerExpandVolumeRequest(
         volume_id=c.vol(), capacity_range=csi_pb2.CapacityRange(
             required_bytes=c.t.cfg.expand_size), volume_capability=c.cap()), f),
     ctrl=("EXPAND_VOLUME",))
case("NodeStageVolume", ["volume_id", "staging_target_path", "volume_capability"], "node",
     lambda c, f: _without(c.t.stage_request(c.vol(), c.t.staging_path()), f), node=STAGE)
case("NodeUnstageVolume", ["volume_id", "staging_target_path"], "node",
     lambda c, f: _without(csi_pb2.NodeUnstageVolumeRequest(
         volume_id=c.vol(), staging_target_path=c.t.staging_path()), f), node=STAGE)
case("NodePublishVolume", ["volume_id", "target_path", "volume_capability"], "node",
     lambda c, f: _without(c.t.publish_request(c.vol(), c.staged(), c.t.target_path()), f))
case("NodeUnpublishVolume", ["volume_id", "target_path"], "node",
     lambda c, f: _without(csi_pb2.NodeUnpublishVolumeRequest(
         volume_id=c.vol(), target_path=c.t.target_path()), f))
case("NodeGetVolumeStats", ["volume_id", "volume_path"], "node",
     lambda c, f: _without(csi_pb2.NodeGetVolumeStatsRequest(
         volume_id=c.vol(), volume_path=c.t.target_path()), f), node=("GET_VOLUME_STATS",))
case("NodeExpandVolume", ["volume_id", "volume_path"], "node",
     lambda c, f: _without(csi_pb2.NodeExpandVolumeRequest(
         volume_id=c.vol(), volume_path=c.t.target_path(),
         capacity_range=csi_pb2.CapacityRange(required_bytes=c.t.cfg.expand_size)), f),
     node=("EXPAND_VOLUME",))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_missing_required_field(
    case: Case, stubs: Stubs, caps: Capabilities, tracker: Tracker
) -> None:
    if case.service == "controller" or case.ctrl_caps:
        caps.require_controller(*case.ctrl_caps)
    caps.require_node(*case.node_caps)
    # Staging a real volume for the node RPCs needs the controller to create one.
    if case.service == "node" and not caps.ctrl("CREATE_DELETE_VOLUME"):
        pytest.skip("plugin does not advertise CREATE_DELETE_VOLUME (needed for a real volume)")
    req = case.build(Ctx(tracker, caps))
    stub = stubs.controller if case.service == "controller" else stubs.node
    method = getattr(stub, case.rpc)
    try:
        resp = method(req)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"{case.id} missing: expected INVALID_ARGUMENT, got {err.code().name}: "
            f"{err.details()}"
        )
        return
    _track_unexpected(tracker, case, req, resp)
    pytest.fail(f"{case.rpc} without {case.field} succeeded; expected INVALID_ARGUMENT")


def _track_unexpected(tracker: Tracker, case: Case, req: Any, resp: Any) -> None:
    """Whatever a wrongly accepted request created is cleaned up at teardown."""
    if case.rpc == "CreateVolume" and resp.volume.volume_id:
        tracker.volumes[resp.volume.volume_id] = resp.volume
    elif case.rpc == "CreateSnapshot" and resp.snapshot.snapshot_id:
        tracker.snapshots.append(resp.snapshot.snapshot_id)
    elif case.rpc == "NodeStageVolume" and req.volume_id and req.staging_target_path:
        tracker.staged.append((req.volume_id, req.staging_target_path))
    elif case.rpc == "NodePublishVolume" and req.volume_id and req.target_path:
        tracker.published.append((req.volume_id, req.target_path))
    elif case.rpc == "ControllerPublishVolume" and req.volume_id and req.node_id:
        tracker.attached.append(req.volume_id)
