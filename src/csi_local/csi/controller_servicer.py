"""CSI Controller service: volumes and snapshots as thin LVs in one pool.

Thin: each RPC validates its request into plain values, makes one call
into the volume layer (CreateVolume, DeleteVolume and CreateSnapshot:
volumes.provisioning.Provisioner) and builds the reply. Storage errors pass
through; the server maps them to codes (csi_local.csi.rpc).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi import validation
from csi_local.csi.dependencies import Backend
from csi_local.csi.messages import snapshot_message
from csi_local.csi.rpc import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unimplemented,
)
from csi_local.errors import VolumeGroupMissing
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption, naming, qos
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.naming import Source, SourceKind
from csi_local.volumes.pool import Pool
from csi_local.volumes.provisioning import Provisioner, VolumeRequest

log = logging.getLogger(__name__)
RPC = pb.ControllerServiceCapability.RPC


def condition_message(cond: naming.Condition) -> pb.VolumeCondition:
    return pb.VolumeCondition(abnormal=cond.abnormal, message=cond.message)


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, backend: Backend) -> None:
        self.config = backend.config
        self.pools = backend.pools
        self.locks = backend.locks
        self.paginator = backend.paginator
        # Read once: a reply must not go back to the configuration for them.
        self.topology_key = backend.config.topology_key
        self.node_id = backend.config.node_id
        # ListVolumes' entries as wire bytes, by volume ID, with the LV and the
        # condition each was made from: at thousands of volumes, making each
        # entry anew is most of a listing's own work, and the committed
        # metadata's reader gives the same LV object again while nothing of it
        # changed (committed_vg._listed_lvs). Taken again only for that very
        # object and an equal condition; the topology is fixed for our life.
        # Listings run side by side (gRPC's thread pool): the lock keeps one
        # listing's insertions out of another's pruning, which iterates the map.
        self._listed_entries: dict[str, tuple[LogicalVolume, naming.Condition, bytes]] = {}
        self._listed_lock = threading.Lock()
        self.volumes = Provisioner(
            backend.pools, backend.locks,
            VolumeSteps(backend.fs, backend.host, CSI_TAGS, backend.state,
                        freezes=backend.freezes), backend.state)

    # helpers -------------------------------------------------------------

    def _topology(self) -> pb.Topology:
        return pb.Topology(segments={self.topology_key: self.node_id})

    def _volume_message(self, lv: LogicalVolume, src: Source | None) -> pb.Volume:
        """The volume `lv`, made from `src` (naming.source_of(lv))."""
        msg = pb.Volume()
        self._fill_volume(msg, lv, src, self._topology())
        return msg

    @staticmethod
    def _fill_volume(msg: pb.Volume, lv: LogicalVolume, src: Source | None,
                     topology: pb.Topology) -> None:
        """Set the empty volume `msg` to `lv`, made from `src`, accessible from
        `topology`. Fields set on a message in place (a listing's entries
        added to its reply) cost a fraction of nested constructors, which
        copy each submessage again."""
        msg.volume_id = lv.name
        msg.capacity_bytes = lv.size
        msg.accessible_topology.append(topology)
        if src is not None and src.kind is SourceKind.SNAPSHOT:
            msg.content_source.snapshot.snapshot_id = src.id
        elif src is not None and src.kind is SourceKind.VOLUME:
            msg.content_source.volume.volume_id = src.id


    def _requested_source(self, req: pb.CreateVolumeRequest) -> Source | None:
        if not req.HasField("volume_content_source"):
            return None
        src = req.volume_content_source
        which = src.WhichOneof("type")
        if which == "snapshot":
            return Source(SourceKind.SNAPSHOT, validation.object_id(
                src.snapshot.snapshot_id, "volume_content_source.snapshot_id"))
        if which == "volume":
            return Source(SourceKind.VOLUME, validation.object_id(
                src.volume.volume_id, "volume_content_source.volume_id"))
        raise InvalidArgument("volume_content_source needs a snapshot or a volume")

    def _asked_class(self, parameters: Mapping[str, str]) -> str | None:
        """The device class the parameters name (None: the default); INVALID_ARGUMENT
        for unknown parameters."""
        own = validation.parameters(parameters, (naming.DEVICE_CLASS_PARAMETER,
                                                 encryption.PARAMETER, *qos.CSI_PARAMETERS))
        return own.get(naming.DEVICE_CLASS_PARAMETER) or None

    # volumes -------------------------------------------------------------

    def CreateVolume(self, request: pb.CreateVolumeRequest,
                     context: grpc.ServicerContext) -> pb.CreateVolumeResponse:
        name = validation.required(request.name, "name")
        asked = self._asked_class(request.parameters)
        fs_types = validation.requested_fs_types(request.volume_capabilities)
        required, limit = validation.capacity_range(
            request.capacity_range if request.HasField("capacity_range") else None)
        validation.topology_allows(
            request.accessibility_requirements
            if request.HasField("accessibility_requirements") else None,
            self.topology_key, self.node_id,
        )
        encrypted = validation.encryption_asked(request.parameters)
        # A VolumeAttributesClass's limits (mutable_parameters) win over the
        # StorageClass's, as the spec has it.
        limits = {**validation.qos_changes(request.parameters),
                  **validation.mutable_parameters(request.mutable_parameters)}
        source = self._requested_source(request)
        lv = self.volumes.create_volume(VolumeRequest(
            name, asked, required, limit, source, request.parameters, fs_types, encrypted,
            limits))
        # Its content source is the request's: a new volume is tagged with it,
        # and an existing one is returned only when its tag names the same.
        return pb.CreateVolumeResponse(volume=self._volume_message(lv, source))

    def DeleteVolume(self, request: pb.DeleteVolumeRequest,
                     context: grpc.ServicerContext) -> pb.DeleteVolumeResponse:
        self.volumes.delete_volume(validation.object_id(request.volume_id, "volume_id"))
        return pb.DeleteVolumeResponse()

    def ValidateVolumeCapabilities(
        self, request: pb.ValidateVolumeCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.ValidateVolumeCapabilitiesResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        if not request.volume_capabilities:
            raise InvalidArgument("volume_capabilities is required")
        pool, _ = naming.get_volume(self.pools, volume_id)
        for cap in request.volume_capabilities:
            problem = validation.capability_problem(cap, pool.default_fs_type)
            if problem:
                return pb.ValidateVolumeCapabilitiesResponse(message=problem)
        try:
            asked = self._asked_class(request.parameters)
        except InvalidArgument as err:
            return pb.ValidateVolumeCapabilitiesResponse(message=err.message)
        if asked is not None and asked != pool.class_name:
            return pb.ValidateVolumeCapabilitiesResponse(
                message=f"the volume is in device class {pool.class_name!r}, not {asked!r}")
        confirmed = pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context,
            volume_capabilities=request.volume_capabilities,
            parameters=request.parameters,
        )
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)

    def _listed(self, want: Callable[[LogicalVolume], bool], *, partial: bool = False
                ) -> tuple[list[tuple[Pool, LogicalVolume]], dict[str, LogicalVolume]]:
        """The CSI objects `want` picks in every class, with their pools, and each
        class's thin pool LV, from one listing (Pools.listing). A missing VG is
        UNAVAILABLE (a list without its volumes would say they are gone) unless
        `partial`."""
        lvs, missing = self.pools.listing()
        if missing and not partial:
            raise VolumeGroupMissing(
                f"volume group {', '.join(missing)} not found: its volumes cannot be listed")
        found = [(pool, lv) for pool, lv in lvs if pool is not None and want(lv)]
        return found, self.pools.thin_pool_lvs(lvs)

    def ListVolumes(self, request: pb.ListVolumesRequest,
                    context: grpc.ServicerContext) -> pb.ListVolumesResponse:
        volumes, thin_pools = self._listed(naming.is_csi_volume)
        page, token = self.paginator.page(
            volumes, lambda found: found[1].name, request.max_entries, request.starting_token
        )
        # Per call, not per volume: the topology, each pool's problems, and the
        # condition messages (most volumes share one: "healthy").
        topology = self._topology()
        problems: dict[str, tuple[str | None, str | None]] = {}
        messages: dict[naming.Condition, pb.VolumeCondition] = {}
        parts = []
        for pool, lv in page:
            pool_lv = thin_pools.get(pool.class_name)
            found = problems.get(pool.class_name)
            if found is None:
                found = problems[pool.class_name] = self._pool_problems(pool, pool_lv)
            cond = naming.condition(lv, pool_lv, pool.name, *found)
            entry = self._listed_entries.get(lv.name)
            if entry is None or entry[0] is not lv or entry[1] != cond:
                message = messages.get(cond)
                if message is None:
                    message = messages[cond] = condition_message(cond)
                one = pb.ListVolumesResponse()
                filled = one.entries.add()
                self._fill_volume(filled.volume, lv, naming.source_of(lv), topology)
                filled.status.volume_condition.CopyFrom(message)
                entry = (lv, cond, one.SerializeToString())
                with self._listed_lock:
                    self._listed_entries[lv.name] = entry
            parts.append(entry[2])
        with self._listed_lock:
            kept = self._listed_entries
            if len(kept) > len(volumes):  # volumes gone since: forget their entries
                names = {lv.name for _, lv in volumes}
                self._listed_entries = {k: v for k, v in kept.items() if k in names}
        # Replies with one entry each, joined: one reply with them all, in order.
        reply = pb.ListVolumesResponse.FromString(b"".join(parts))
        reply.next_token = token
        return reply

    def ControllerGetVolume(self, request: pb.ControllerGetVolumeRequest,
                            context: grpc.ServicerContext) -> pb.ControllerGetVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        lvs, missing = self.pools.listing()
        found = next(((p, lv) for p, lv in lvs
                      if p is not None and lv.name == volume_id and naming.is_csi_volume(lv)),
                     None)
        if found is None:
            if missing:
                raise VolumeGroupMissing(f"volume group {', '.join(missing)} not found: "
                                         f"volume {volume_id!r} may be there")
            raise NotFound(f"volume {volume_id!r} not found")
        pool, lv = found
        return pb.ControllerGetVolumeResponse(
            volume=self._volume_message(lv, naming.source_of(lv)),
            status=pb.ControllerGetVolumeResponse.VolumeStatus(
                volume_condition=self._condition(pool, lv, self.pools.thin_pool_lvs(lvs))
            ),
        )

    @staticmethod
    def _pool_problems(pool: Pool, pool_lv: LogicalVolume | None
                       ) -> tuple[str | None, str | None]:
        """What a volume's condition says of its pool, the same for each of its
        volumes: above a high-water mark, its VG's metadata not believed."""
        return pool.fill_problem(pool_lv), pool.metadata_problem()

    @classmethod
    def _condition(cls, pool: Pool, lv: LogicalVolume | None,
                   thin_pools: dict[str, LogicalVolume]) -> pb.VolumeCondition:
        pool_lv = thin_pools.get(pool.class_name)
        return condition_message(naming.condition(lv, pool_lv, pool.name,
                                                *cls._pool_problems(pool, pool_lv)))

    def GetCapacity(self, request: pb.GetCapacityRequest,
                    context: grpc.ServicerContext) -> pb.GetCapacityResponse:
        asked = self._asked_class(request.parameters)
        pool = self.pools.get(asked)
        if pool is None:
            # A StorageClass's class that this node does not have: Kubernetes
            # asks every node for every StorageClass (CSIStorageCapacity), and
            # room for nothing is the answer that keeps volumes away.
            log.debug("GetCapacity: no device class %r on this node; reporting 0", asked)
            return pb.GetCapacityResponse(available_capacity=0)
        if request.HasField("accessible_topology"):
            segs = request.accessible_topology.segments
            if segs.get(self.topology_key) != self.node_id:
                return pb.GetCapacityResponse(available_capacity=0)
        for cap in request.volume_capabilities:
            if validation.capability_problem(cap, pool.default_fs_type):
                return pb.GetCapacityResponse(available_capacity=0)
        try:
            report = pool.report(committed=True)
            cap_info = pool.capacity(report)
        except VolumeGroupMissing as err:
            # A query, not a change: a node without its VG or pool has room for
            # nothing. An error here would leave external-provisioner's last
            # CSIStorageCapacity (possibly positive) in place, and the scheduler
            # would keep sending volumes to this node.
            log.warning("GetCapacity: %s; reporting 0", err.message)
            return pb.GetCapacityResponse(available_capacity=0)
        problem = pool.creation_problem(report)
        if problem is not None:
            # Above the high-water mark, or with no room in the VG's metadata
            # area or the pool's device IDs, CreateVolume refuses everything:
            # say so, or the scheduler keeps sending volumes here.
            log.warning("GetCapacity: %s; reporting 0", problem)
            return pb.GetCapacityResponse(available_capacity=0)
        resp = pb.GetCapacityResponse(available_capacity=cap_info.available)
        resp.maximum_volume_size.value = cap_info.available
        resp.minimum_volume_size.value = cap_info.extent_size
        return resp

    def ControllerGetCapabilities(
        self, request: pb.ControllerGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.ControllerGetCapabilitiesResponse:
        rpcs = [
            RPC.CREATE_DELETE_VOLUME, RPC.GET_CAPACITY, RPC.LIST_VOLUMES, RPC.GET_VOLUME,
            RPC.VOLUME_CONDITION, RPC.CREATE_DELETE_SNAPSHOT, RPC.LIST_SNAPSHOTS,
            RPC.GET_SNAPSHOT, RPC.CLONE_VOLUME, RPC.SINGLE_NODE_MULTI_WRITER,
            RPC.MODIFY_VOLUME,
        ]
        if not self.config.node_expansion_only:
            rpcs.append(RPC.EXPAND_VOLUME)
        return pb.ControllerGetCapabilitiesResponse(capabilities=[
            pb.ControllerServiceCapability(rpc=RPC(type=t)) for t in rpcs
        ])

    def ControllerExpandVolume(
        self, request: pb.ControllerExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerExpandVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        if not request.HasField("capacity_range"):
            raise InvalidArgument("capacity_range is required")
        if self.config.node_expansion_only:
            raise FailedPrecondition("controller expansion is disabled (--node-expansion-only)")
        if request.HasField("volume_capability"):
            problem = validation.capability_problem(request.volume_capability,
                                                    self.pools.default.default_fs_type)
            if problem:
                raise InvalidArgument(problem)
        rng = request.capacity_range
        with self.locks.hold(volume_key(volume_id)):
            pool, lv = naming.get_volume(self.pools, volume_id)
            naming.check_format(lv)
            encrypted = encryption.is_encrypted(lv)
            lv = pool.grow(lv, rng.required_bytes, rng.limit_bytes)
        block = (request.HasField("volume_capability")
                 and request.volume_capability.HasField("block"))
        # A file system grows on the node; so does an encrypted volume's open
        # dm-crypt device (cryptsetup resize), raw block or not: without it,
        # kubelet never calls NodeExpandVolume and the device stays its old size.
        return pb.ControllerExpandVolumeResponse(
            capacity_bytes=lv.size, node_expansion_required=not block or encrypted
        )

    # Local volumes need no attach.

    def ControllerPublishVolume(
        self, request: pb.ControllerPublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerPublishVolumeResponse:
        raise Unimplemented("local volumes need no ControllerPublishVolume")

    def ControllerUnpublishVolume(
        self, request: pb.ControllerUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerUnpublishVolumeResponse:
        raise Unimplemented("local volumes need no ControllerUnpublishVolume")

    def ControllerModifyVolume(
        self, request: pb.ControllerModifyVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerModifyVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        changes = validation.mutable_parameters(request.mutable_parameters)
        if self.config.modify_validate_only:
            # Kubernetes' central csi-resizer copy: it reaches no node's LVM.
            # The node plugin that holds the volume reads the PV's
            # VolumeAttributesClass itself and converges (docs/qos.md).
            return pb.ControllerModifyVolumeResponse()
        limits = self.volumes.modify_volume(volume_id, changes)
        log.info("volume %s: IO limits now %s", volume_id, limits.describe())
        return pb.ControllerModifyVolumeResponse()

    # snapshots -----------------------------------------------------------

    def CreateSnapshot(self, request: pb.CreateSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.CreateSnapshotResponse:
        source_id = validation.object_id(request.source_volume_id, "source_volume_id")
        name = validation.required(request.name, "name")
        asked = self._asked_class(request.parameters)
        lv = self.volumes.create_snapshot(name, source_id, asked)
        return pb.CreateSnapshotResponse(snapshot=snapshot_message(lv))

    def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.DeleteSnapshotResponse:
        snapshot_id = validation.object_id(request.snapshot_id, "snapshot_id")
        if not naming.is_snapshot_id(snapshot_id):
            return pb.DeleteSnapshotResponse()
        with self.locks.hold(volume_key(snapshot_id)):
            found = self.pools.find(snapshot_id)
            if found is not None and naming.is_csi_snapshot(found[1]):
                group = naming.group_of(found[1])
                if group is not None:
                    # The spec: a member "CAN NOT be deleted stand alone".
                    raise InvalidArgument(
                        f"snapshot {snapshot_id} is a member of group snapshot {group}: "
                        "delete the group with DeleteVolumeGroupSnapshot")
                naming.check_format(found[1])
                found[0].lvm.remove(snapshot_id)
        return pb.DeleteSnapshotResponse()

    def ListSnapshots(self, request: pb.ListSnapshotsRequest,
                      context: grpc.ServicerContext) -> pb.ListSnapshotsResponse:
        found, _ = self._listed(naming.is_csi_snapshot)
        snaps = [lv for _, lv in found]
        if request.snapshot_id:
            snaps = [lv for lv in snaps if lv.name == request.snapshot_id]
        if request.source_volume_id:
            want = Source(SourceKind.VOLUME, request.source_volume_id)
            snaps = [lv for lv in snaps if naming.source_of(lv) == want]
        page, token = self.paginator.page(
            snaps, lambda lv: lv.name, request.max_entries, request.starting_token
        )
        return pb.ListSnapshotsResponse(
            entries=[pb.ListSnapshotsResponse.Entry(snapshot=snapshot_message(lv))
                     for lv in page],
            next_token=token,
        )

    def GetSnapshot(self, request: pb.GetSnapshotRequest,
                    context: grpc.ServicerContext) -> pb.GetSnapshotResponse:
        snapshot_id = validation.object_id(request.snapshot_id, "snapshot_id")
        return pb.GetSnapshotResponse(snapshot=snapshot_message(
            naming.get_snapshot(self.pools, snapshot_id)[1]))

