"""CSI GroupController service: snapshots of several volumes at one instant.

Thin: each RPC validates its request, takes the locks, and asks the group
layer (csi_local.volumes.group_snapshots), which says how the instant is made. A group's ID and
membership are LVM tags on its member snapshots, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi import validation
from csi_local.csi.dependencies import Backend
from csi_local.csi.messages import snapshot_message
from csi_local.csi.rpc import AlreadyExists, InvalidArgument, NotFound
from csi_local.volumes import naming
from csi_local.volumes.group_snapshots import Group, GroupSnapshots
from csi_local.volumes.lock_keys import volume_key

log = logging.getLogger(__name__)
RPC = pb.GroupControllerServiceCapability.RPC


def group_message(group: Group, order: Iterable[str] = ()) -> pb.VolumeGroupSnapshot:
    """The reply's group: members in the order of `order` (source volume IDs)
    where given, else by snapshot ID."""
    rank = {vid: i for i, vid in enumerate(order)}
    members = sorted(group.members, key=lambda lv: (
        rank.get(getattr(naming.source_of(lv), "id", ""), len(rank)), lv.name))
    return pb.VolumeGroupSnapshot(
        group_snapshot_id=group.group_id,
        snapshots=[snapshot_message(lv) for lv in members],
        creation_time=Timestamp(seconds=group.created),
        ready_to_use=True,
    )


def _check_members(group: Group, snapshot_ids: Iterable[str]) -> None:
    """The tables' "snapshot list mismatch": the CO's list names other members."""
    asked = set(snapshot_ids)
    have = {lv.name for lv in group.members}
    if asked and asked != have:
        raise InvalidArgument(
            f"snapshot_ids {sorted(asked)} are not the members of group snapshot "
            f"{group.group_id} ({sorted(have)})")


class GroupControllerServicer(csi_pb2_grpc.GroupControllerServicer):
    def __init__(self, backend: Backend, groups: GroupSnapshots) -> None:
        self.pools = backend.pools
        self.locks = backend.locks
        self.groups = groups

    def GroupControllerGetCapabilities(
        self, request: pb.GroupControllerGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GroupControllerGetCapabilitiesResponse:
        return pb.GroupControllerGetCapabilitiesResponse(capabilities=[
            pb.GroupControllerServiceCapability(rpc=RPC(
                type=RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT)),
        ])

    def CreateVolumeGroupSnapshot(
        self, request: pb.CreateVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.CreateVolumeGroupSnapshotResponse:
        name = validation.required(request.name, "name")
        if not request.source_volume_ids:
            raise InvalidArgument("source_volume_ids is required")
        sources = [validation.object_id(v, "source_volume_ids")
                   for v in request.source_volume_ids]
        if len(set(sources)) != len(sources):
            raise InvalidArgument(f"source_volume_ids names a volume twice: {sources}")
        own = validation.parameters(request.parameters, (naming.DEVICE_CLASS_PARAMETER,))
        asked = own.get(naming.DEVICE_CLASS_PARAMETER) or None
        if asked is not None:
            self.pools.select(asked)  # an unknown class: INVALID_ARGUMENT
        group_id = naming.group_id_for(name)
        # Lock order: the group, then its volumes by ID (CreateSnapshot takes a
        # snapshot's, then its source's: a member ID is never a group ID, so
        # the orders cannot cross). The volumes' locks keep each member staged
        # or unstaged as it is while the group is taken.
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.locks.hold(volume_key(group_id)))
            for vid in sorted(sources):
                stack.enter_context(self.locks.hold(volume_key(vid)))
            # UNAVAILABLE, before anything is deleted or made, while a VG that
            # may hold members the lookup does not see is missing.
            existing = self.groups.find(group_id)
            if existing is not None and existing.complete:
                for member in existing.members:  # a retry's answer reads their tags
                    naming.check_format(member)
                if existing.sources() != set(sources):
                    raise AlreadyExists(
                        f"group snapshot {name!r} exists with other volumes "
                        f"({sorted(existing.sources())})")
                return pb.CreateVolumeGroupSnapshotResponse(
                    group_snapshot=group_message(existing, sources))
            if existing is not None:
                # What a take that failed part-way left: its instant is gone, so
                # the group is taken anew.
                log.warning("group snapshot %s: removing %d member(s) of an unfinished take",
                            group_id, len(existing.members))
                self.groups.delete(existing)
            found = self.pools.locate(*sources)
            for vid in sources:
                if vid not in found or not naming.is_csi_volume(found[vid][1]):
                    raise NotFound(f"volume {vid!r} not found")
                pool = found[vid][0]
                if asked is not None and pool.class_name != asked:
                    raise InvalidArgument(
                        f"volume {vid} is in device class {pool.class_name!r}, and its "
                        f"snapshot stays there, but the request asks for class {asked!r}")
            taken = self.groups.take(group_id, [found[vid] for vid in sources])
        log.info("group snapshot %s of %d volume(s) taken; writes held for %.3f s",
                 group_id, len(sources), taken.freeze_seconds)
        return pb.CreateVolumeGroupSnapshotResponse(
            group_snapshot=group_message(taken.group, sources))

    def DeleteVolumeGroupSnapshot(
        self, request: pb.DeleteVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeGroupSnapshotResponse:
        group_id = validation.object_id(request.group_snapshot_id, "group_snapshot_id")
        if not naming.is_group_id(group_id):
            return pb.DeleteVolumeGroupSnapshotResponse()
        with self.locks.hold(volume_key(group_id)):
            group = self.groups.find(group_id)
            if group is not None:
                _check_members(group, request.snapshot_ids)
                self.groups.delete(group)
        return pb.DeleteVolumeGroupSnapshotResponse()

    def GetVolumeGroupSnapshot(
        self, request: pb.GetVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GetVolumeGroupSnapshotResponse:
        group_id = validation.object_id(request.group_snapshot_id, "group_snapshot_id")
        group = self.groups.find(group_id) if naming.is_group_id(group_id) else None
        if group is None or not group.complete:
            raise NotFound(f"group snapshot {group_id!r} not found")
        _check_members(group, request.snapshot_ids)
        return pb.GetVolumeGroupSnapshotResponse(group_snapshot=group_message(group))
