"""Every REQUIRED request field, left out one at a time, must give INVALID_ARGUMENT.

Each case is sent twice. Once as an otherwise valid request (real volumes, staged where the
RPC needs it) with exactly one field cleared. Once bare: only the RPC's other REQUIRED
fields, naming objects that do not exist, and none of its optional fields (upstream
csi-sanity's requests look like this). A missing required field is checked before anything
that depends on state (NOT_FOUND, "not staged") and before optional or conditional fields
(NodePublishVolume's FAILED_PRECONDITION for a missing `staging_target_path`): the full
request alone cannot tell the order, since there only the dropped field is wrong.
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
    bare: Callable[[Ctx], Any]

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


UNKNOWN_VOLUME = "sanity-unknown-volume-0000"
UNKNOWN_SNAPSHOT = "sanity-unknown-snapshot-0000"
Bare = Callable[[Ctx, str], Any]


def _bare(cls: Any, **fields: Callable[[Ctx], Any]) -> Bare:
    """A request of `cls` with only the REQUIRED `fields` but the dropped one."""
    return lambda c, drop: cls(**{f: make(c) for f, make in fields.items() if f != drop})


def _bare_cv(c: Ctx, drop: str) -> csi_pb2.CreateVolumeRequest:
    req = csi_pb2.CreateVolumeRequest(name=Tracker.name(), volume_capabilities=[c.cap()])
    if drop == "volume_capabilities[].access_mode":
        req.volume_capabilities[0].ClearField("access_mode")
    else:
        req.ClearField(drop)  # type: ignore[arg-type]
    return req


def _unknown_volume(c: Ctx) -> str:
    return UNKNOWN_VOLUME


def _unknown_snapshot(c: Ctx) -> str:
    return UNKNOWN_SNAPSHOT


def _cap(c: Ctx) -> csi_pb2.VolumeCapability:
    return c.cap()


def _caps(c: Ctx) -> list[csi_pb2.VolumeCapability]:
    return [c.cap()]


def _staging(c: Ctx) -> str:
    return c.t.staging_path()


def _target(c: Ctx) -> str:
    return c.t.target_path()


def _capacity(c: Ctx) -> csi_pb2.CapacityRange:
    return csi_pb2.CapacityRange(required_bytes=c.t.cfg.expand_size)


CV = ("CREATE_DELETE_VOLUME",)
SNAP = ("CREATE_DELETE_SNAPSHOT",)
STAGE = ("STAGE_UNSTAGE_VOLUME",)

CASES: list[Case] = []


def case(rpc: str, fields: list[str], service: str, build: Callable[[Ctx, str], Any],
         bare: Bare, ctrl: tuple[str, ...] = (), node: tuple[str, ...] = ()) -> None:
    for f in fields:
        CASES.append(Case(rpc, f, service, ctrl, node,
                          lambda c, f=f: build(c, f),  # type: ignore[misc]
                          lambda c, f=f: bare(c, f)))  # type: ignore[misc]


case("CreateVolume", ["name", "volume_capabilities", "volume_capabilities[].access_mode"],
     "controller", _cv, _bare_cv, ctrl=CV)
case("DeleteVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.DeleteVolumeRequest(volume_id=c.vol()), f),
     _bare(csi_pb2.DeleteVolumeRequest, volume_id=_unknown_volume), ctrl=CV)
case("ControllerPublishVolume", ["volume_id", "node_id", "volume_capability"], "controller",
     lambda c, f: _without(csi_pb2.ControllerPublishVolumeRequest(
         volume_id=c.vol(), node_id=c.node_id(), volume_capability=c.cap()), f),
     _bare(csi_pb2.ControllerPublishVolumeRequest, volume_id=_unknown_volume,
           node_id=Ctx.node_id, volume_capability=_cap),
     ctrl=("PUBLISH_UNPUBLISH_VOLUME",))
case("ControllerUnpublishVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.ControllerUnpublishVolumeRequest(
         volume_id=c.vol(), node_id=c.node_id()), f),
     _bare(csi_pb2.ControllerUnpublishVolumeRequest, volume_id=_unknown_volume),
     ctrl=("PUBLISH_UNPUBLISH_VOLUME",))
case("ValidateVolumeCapabilities", ["volume_id", "volume_capabilities"], "controller",
     lambda c, f: _without(csi_pb2.ValidateVolumeCapabilitiesRequest(
         volume_id=c.vol(), volume_capabilities=[c.cap()]), f),
     _bare(csi_pb2.ValidateVolumeCapabilitiesRequest, volume_id=_unknown_volume,
           volume_capabilities=_caps))
case("ControllerGetVolume", ["volume_id"], "controller",
     lambda c, f: _without(csi_pb2.ControllerGetVolumeRequest(volume_id=c.vol()), f),
     _bare(csi_pb2.ControllerGetVolumeRequest, volume_id=_unknown_volume),
     ctrl=("GET_VOLUME",))
case("CreateSnapshot", ["source_volume_id", "name"], "controller",
     lambda c, f: _without(csi_pb2.CreateSnapshotRequest(
         source_volume_id=c.vol(), name=Tracker.name("snap"),
         parameters=c.t.cfg.snapshot_parameters), f),
     _bare(csi_pb2.CreateSnapshotRequest, source_volume_id=_unknown_volume,
           name=lambda c: Tracker.name("snap")), ctrl=SNAP)
case("DeleteSnapshot", ["snapshot_id"], "controller",
     lambda c, f: _without(csi_pb2.DeleteSnapshotRequest(snapshot_id="x"), f),
     _bare(csi_pb2.DeleteSnapshotRequest, snapshot_id=_unknown_snapshot), ctrl=SNAP)
case("GetSnapshot", ["snapshot_id"], "controller",
     lambda c, f: _without(csi_pb2.GetSnapshotRequest(snapshot_id="x"), f),
     _bare(csi_pb2.GetSnapshotRequest, snapshot_id=_unknown_snapshot),
     ctrl=("GET_SNAPSHOT",))
case("ControllerExpandVolume", ["volume_id", "capacity_range"], "controller",
     lambda c, f: _without(csi_pb2.ControllerExpandVolumeRequest(
         volume_id=c.vol(), capacity_range=csi_pb2.CapacityRange(
             required_bytes=c.t.cfg.expand_size), volume_capability=c.cap()), f),
     _bare(csi_pb2.ControllerExpandVolumeRequest, volume_id=_unknown_volume,
           capacity_range=_capacity),
     ctrl=("EXPAND_VOLUME",))
case("NodeStageVolume", ["volume_id", "staging_target_path", "volume_capability"], "node",
     lambda c, f: _without(c.t.stage_request(c.vol(), c.t.staging_path()), f),
     _bare(csi_pb2.NodeStageVolumeRequest, volume_id=_unknown_volume,
           staging_target_path=_staging, volume_capability=_cap), node=STAGE)
case("NodeUnstageVolume", ["volume_id", "staging_target_path"], "node",
     lambda c, f: _without(csi_pb2.NodeUnstageVolumeRequest(
         volume_id=c.vol(), staging_target_path=c.t.staging_path()), f),
     _bare(csi_pb2.NodeUnstageVolumeRequest, volume_id=_unknown_volume,
           staging_target_path=_staging), node=STAGE)
# `staging_target_path` is not REQUIRED ("for backwards compatibility"): the bare request
# leaves it out, as upstream does.
case("NodePublishVolume", ["volume_id", "target_path", "volume_capability"], "node",
     lambda c, f: _without(c.t.publish_request(c.vol(), c.staged(), c.t.target_path()), f),
     _bare(csi_pb2.NodePublishVolumeRequest, volume_id=_unknown_volume, target_path=_target,
           volume_capability=_cap))
case("NodeUnpublishVolume", ["volume_id", "target_path"], "node",
     lambda c, f: _without(csi_pb2.NodeUnpublishVolumeRequest(
         volume_id=c.vol(), target_path=c.t.target_path()), f),
     _bare(csi_pb2.NodeUnpublishVolumeRequest, volume_id=_unknown_volume,
           target_path=_target))
case("NodeGetVolumeStats", ["volume_id", "volume_path"], "node",
     lambda c, f: _without(csi_pb2.NodeGetVolumeStatsRequest(
         volume_id=c.vol(), volume_path=c.t.target_path()), f),
     _bare(csi_pb2.NodeGetVolumeStatsRequest, volume_id=_unknown_volume,
           volume_path=_target), node=("GET_VOLUME_STATS",))
case("NodeExpandVolume", ["volume_id", "volume_path"], "node",
     lambda c, f: _without(csi_pb2.NodeExpandVolumeRequest(
         volume_id=c.vol(), volume_path=c.t.target_path(),
         capacity_range=csi_pb2.CapacityRange(required_bytes=c.t.cfg.expand_size)), f),
     _bare(csi_pb2.NodeExpandVolumeRequest, volume_id=_unknown_volume, volume_path=_target),
     node=("EXPAND_VOLUME",))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_missing_required_field(
    case: Case, stubs: Stubs, caps: Capabilities, tracker: Tracker
) -> None:
    _require(case, caps)
    # Staging a real volume for the node RPCs needs the controller to create one.
    if case.service == "node" and not caps.ctrl("CREATE_DELETE_VOLUME"):
        pytest.skip("plugin does not advertise CREATE_DELETE_VOLUME (needed for a real volume)")
    _expect_invalid(case, case.build(Ctx(tracker, caps)), stubs, tracker)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_missing_required_field_bare(
    case: Case, stubs: Stubs, caps: Capabilities, tracker: Tracker
) -> None:
    """Only the other REQUIRED fields, for objects that do not exist: the missing field
    is INVALID_ARGUMENT before NOT_FOUND, FAILED_PRECONDITION or any optional field."""
    _require(case, caps)
    _expect_invalid(case, case.bare(Ctx(tracker, caps)), stubs, tracker)


def _require(case: Case, caps: Capabilities) -> None:
    if case.service == "controller" or case.ctrl_caps:
        caps.require_controller(*case.ctrl_caps)
    caps.require_node(*case.node_caps)


def _expect_invalid(case: Case, req: Any, stubs: Stubs, tracker: Tracker) -> None:
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
