"""CSI Controller service: volumes and snapshots as thin LVs in one pool.

Thin: each RPC validates its request, calls the volume layer (volumes,
pool, lvm) and builds the reply. Storage errors pass through; the server
maps them to codes (csi_local.csi.rpc).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi import validation
from csi_local.csi.dependencies import Backend
from csi_local.csi.messages import snapshot_message
from csi_local.csi.rpc import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Unimplemented,
)
from csi_local.errors import VolumeGroupMissing
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.locks import volume_key
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes import encryption
from csi_local.volumes import naming as vols
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps
from csi_local.volumes.naming import Source, SourceKind
from csi_local.volumes.pool import Pool

log = logging.getLogger(__name__)
RPC = pb.ControllerServiceCapability.RPC


def condition_message(cond: vols.Condition) -> pb.VolumeCondition:
    return pb.VolumeCondition(abnormal=cond.abnormal, message=cond.message)


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, backend: Backend) -> None:
        self.config = backend.config
        self.pools = backend.pools
        self.state = backend.state
        self.locks = backend.locks
        self.paginator = backend.paginator
        self.steps = VolumeSteps(backend.fs, backend.host, CSI_TAGS, backend.state)

    # helpers -------------------------------------------------------------

    def _topology(self) -> pb.Topology:
        return pb.Topology(segments={self.config.topology_key: self.config.node_id})

    def _volume_message(self, lv: LogicalVolume) -> pb.Volume:
        msg = pb.Volume(
            volume_id=lv.name,
            capacity_bytes=lv.size,
            accessible_topology=[self._topology()],
        )
        src = vols.source_of(lv)
        if src is not None and src.kind is SourceKind.SNAPSHOT:
            msg.content_source.snapshot.snapshot_id = src.id
        elif src is not None and src.kind is SourceKind.VOLUME:
            msg.content_source.volume.volume_id = src.id
        return msg


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
        own = validation.parameters(parameters, (vols.DEVICE_CLASS_PARAMETER,
                                                 encryption.PARAMETER))
        return own.get(vols.DEVICE_CLASS_PARAMETER) or None

    def _elsewhere(self, pool: Pool, lv: LogicalVolume | None, what: str,
                   asked: str | None) -> None:
        """INVALID_ARGUMENT when `lv`, the source of a new volume or snapshot, is
        in another class than `pool`'s: a thin snapshot lives in its origin's
        pool, so nothing made from a source can change class."""
        other = self.pools.of_lv(lv) if lv is not None else None
        if other is None or other is pool:
            return
        how = f"asks for class {asked!r}" if asked else (
            f"names no deviceClass, so the default class {pool.class_name!r}")
        raise InvalidArgument(
            f"{what} is in device class {other.class_name!r} and what is made from it stays "
            f"there, but the request {how}: use a class parameter of {other.class_name!r}")

    # volumes -------------------------------------------------------------

    def CreateVolume(self, request: pb.CreateVolumeRequest,
                     context: grpc.ServicerContext) -> pb.CreateVolumeResponse:
        name = validation.required(request.name, "name")
        asked = self._asked_class(request.parameters)
        pool = self.pools.select(asked)
        caps = validation.capabilities(request.volume_capabilities, pool.default_fs_type)
        raw_caps = request.volume_capabilities
        rng = request.capacity_range if request.HasField("capacity_range") else None
        validation.topology_allows(
            request.accessibility_requirements
            if request.HasField("accessibility_requirements") else None,
            self.config.topology_key, self.config.node_id,
        )
        source = self._requested_source(request)
        volume_id = vols.volume_id_for(name)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.locks.hold(volume_key(volume_id)))
            if (source is not None and source.kind is SourceKind.VOLUME
                    and source.id != volume_id):
                # A clone reads its source: keep it from being unstaged or deleted
                # meanwhile (lock order: new volume, source, pool). A volume named
                # as its own source is not locked twice (that waits on itself): it
                # is NOT_FOUND below, or ALREADY_EXISTS for an existing volume.
                stack.enter_context(self.locks.hold(volume_key(source.id)))
            # With several classes the volume (a retry) or its source may be in
            # another VG than the chosen pool's, and a source names the class
            # when the request names none: one `lvs` over the classes' VGs first.
            # Both are under their locks, so this stays true. A missing VG other
            # than the chosen pool's does not stop a new volume (its own pool's
            # report fails if it is its VG), but a source that may be in it does.
            elsewhere: dict[str, tuple[Pool, LogicalVolume]] = {}
            if not self.pools.single_vg or (source is not None and len(self.pools) > 1):
                names = [volume_id] if source is None else [volume_id, source.id]
                elsewhere = self.pools.locate(
                    *names, required=[] if source is None else [source.id])
                if source is not None and asked is None and source.id in elsewhere:
                    # A restore or clone stays in its source's class.
                    pool = elsewhere[source.id][0]
                    caps = validation.capabilities(raw_caps, pool.default_fs_type)
            # One report, under the pool lock, answers all: does the volume exist
            # (a retry), its source, the extent size and the pool's room.
            # Without a source no volume's device is acted on: the committed
            # metadata and the pool's status answer without a process.
            report = stack.enter_context(pool.reserved(committed=source is None))
            existing = report.find(volume_id) or elsewhere.get(volume_id, (pool, None))[1]
            if existing is not None:
                lv = self._reuse(pool, report, existing, name, caps, rng, source, asked)
                if source is None and (vols.TAG_ENCRYPTED in lv.tags) != bool(
                        validation.encryption_tags(request.parameters, pool.encrypted_by_default,
                                                   vols.TAG_ENCRYPTED, None)):
                    raise AlreadyExists(f"volume {name!r} exists, and its encryption is not "
                                        "what the request asks")
            else:
                source_lv = None
                if source is not None:
                    source_lv = (report.find(source.id)
                                 or elsewhere.get(source.id, (pool, None))[1])
                    if source_lv is None or not vols.is_source(source_lv, source):
                        raise NotFound(f"{source.kind} {source.id!r} not found")
                    self._elsewhere(pool, source_lv, f"{source.kind} {source.id}", asked)
                lv = self._create(pool, report, volume_id, caps, rng, source, source_lv,
                                  vols.co_name_tags(dict(request.parameters)),
                                  request.parameters)
        return pb.CreateVolumeResponse(volume=self._volume_message(lv))

    def _reuse(self, pool: Pool, report: VgReport, lv: LogicalVolume, name: str,
               caps: list[validation.Capability], rng: pb.CapacityRange | None,
               source: Source | None, asked: str | None) -> LogicalVolume:
        """The same name again: the same volume if compatible, converging an
        interrupted create; ALREADY_EXISTS otherwise (under the pool lock)."""
        if not vols.is_csi_volume(lv) or self.pools.of_lv(lv) is None:
            raise AlreadyExists(f"name {name!r} maps to LV {lv.vg}/{lv.name}, which is not "
                                "a volume")
        other = self.pools.of_lv(lv)
        if other is not pool:
            assert other is not None
            raise AlreadyExists(
                f"volume {name!r} exists in device class {other.class_name!r}, not in "
                f"{pool.class_name!r}" + ("" if asked else " (the default)"))
        if vols.source_of(lv) != source:
            raise AlreadyExists(f"volume {name!r} exists with another content source")
        want = vols.requested_size(lv)
        if not validation.in_range(want, rng):
            raise AlreadyExists(
                f"volume {name!r} exists with {want} bytes, outside the requested range"
            )
        minimum = max(fsrules.min_size(c.fs_type) for c in caps)
        if want < minimum:
            raise AlreadyExists(
                f"volume {name!r} exists with {want} bytes, too small for the requested "
                f"file system (at least {minimum} bytes)"
            )
        if lv.size < want:  # killed between snapshot and extend: finish the job
            pool.require_room(report, want - lv.size)
            lv = pool.lvm.extend_to(lv, want)
        return lv

    def _create(self, pool: Pool, report: VgReport, volume_id: str,
                caps: list[validation.Capability], rng: pb.CapacityRange | None,
                source: Source | None, source_lv: LogicalVolume | None,
                co_tags: list[str], parameters: Mapping[str, str]) -> LogicalVolume:
        """Make the volume (hold its lock, its source's and the pool's); `source_lv`
        is the source, found in `pool`."""
        extent = report.extent_size
        encrypted = validation.encryption_tags(parameters, pool.encrypted_by_default,
                                               vols.TAG_ENCRYPTED, source_lv)
        # An encrypted volume's file system is its LUKS2 header smaller.
        minimum = max(fsrules.min_size(c.fs_type) for c in caps) + (
            encryption.OVERHEAD_BYTES if encrypted else 0)
        if source_lv is not None:
            if rng is not None and rng.limit_bytes and rng.limit_bytes < source_lv.size:
                raise OutOfRange(
                    f"limit_bytes {rng.limit_bytes} is smaller than the source's "
                    f"{source_lv.size} bytes"
                )
            minimum = max(minimum, source_lv.size)
        size = validation.size_for(rng, extent, minimum=minimum)
        tags = [f"{vols.TAG_KIND}={vols.KIND_VOLUME}", f"{vols.TAG_SIZE}={size}", *co_tags,
                *encrypted]
        if source is None or source_lv is None:
            # No "fresh" tag: the node formats a volume only while its thin
            # device maps no block (see VolumeSteps.freshness).
            return pool.create_thin(report, volume_id, size, tags)
        # Tagged new-fsid and, when it outgrows its source, grow-fs by the clone step.
        return self.steps.clone(pool, report, source_lv, volume_id, [*tags, source.tag()], size)

    def DeleteVolume(self, request: pb.DeleteVolumeRequest,
                     context: grpc.ServicerContext) -> pb.DeleteVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        if not vols.is_volume_id(volume_id):
            return pb.DeleteVolumeResponse()  # never ours, so already gone
        with self.locks.hold(volume_key(volume_id)):
            rec = self.state.get(volume_id)
            if not rec.empty:
                where = rec.staging.path if rec.staging else ", ".join(rec.publishes)
                raise FailedPrecondition(
                    f"volume {volume_id} is still staged or published on this node ({where})"
                )
            # An LV in the committed metadata is found without a process; only
            # one that is not there (a retry, most likely) costs an `lvs`.
            found = self.pools.find_committed(volume_id) or self.pools.find(volume_id)
            if found is not None and vols.is_csi_volume(found[1]):
                found[0].lvm.remove(volume_id)  # VolumeInUse: FAILED_PRECONDITION
                if found[1].uuid:  # a mark left by a stage killed in its mkfs
                    self.state.clear_formatting(found[1].uuid)
        return pb.DeleteVolumeResponse()

    def ValidateVolumeCapabilities(
        self, request: pb.ValidateVolumeCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.ValidateVolumeCapabilitiesResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        if not request.volume_capabilities:
            raise InvalidArgument("volume_capabilities is required")
        pool, _ = vols.get_volume(self.pools, volume_id)
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
        volumes, thin_pools = self._listed(vols.is_csi_volume)
        page, token = self.paginator.page(
            volumes, lambda found: found[1].name, request.max_entries, request.starting_token
        )
        entries = [
            pb.ListVolumesResponse.Entry(
                volume=self._volume_message(lv),
                status=pb.ListVolumesResponse.VolumeStatus(
                    volume_condition=self._condition(pool, lv, thin_pools)
                ),
            )
            for pool, lv in page
        ]
        return pb.ListVolumesResponse(entries=entries, next_token=token)

    def ControllerGetVolume(self, request: pb.ControllerGetVolumeRequest,
                            context: grpc.ServicerContext) -> pb.ControllerGetVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        lvs, missing = self.pools.listing()
        found = next(((p, lv) for p, lv in lvs
                      if p is not None and lv.name == volume_id and vols.is_csi_volume(lv)),
                     None)
        if found is None:
            if missing:
                raise VolumeGroupMissing(f"volume group {', '.join(missing)} not found: "
                                         f"volume {volume_id!r} may be there")
            raise NotFound(f"volume {volume_id!r} not found")
        pool, lv = found
        return pb.ControllerGetVolumeResponse(
            volume=self._volume_message(lv),
            status=pb.ControllerGetVolumeResponse.VolumeStatus(
                volume_condition=self._condition(pool, lv, self.pools.thin_pool_lvs(lvs))
            ),
        )

    @staticmethod
    def _condition(pool: Pool, lv: LogicalVolume | None,
                   thin_pools: dict[str, LogicalVolume]) -> pb.VolumeCondition:
        pool_lv = thin_pools.get(pool.class_name)
        return condition_message(vols.condition(lv, pool_lv, pool.name,
                                                pool.fill_problem(pool_lv),
                                                pool.metadata_problem()))

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
            if segs.get(self.config.topology_key) != self.config.node_id:
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
            pool, lv = vols.get_volume(self.pools, volume_id)
            lv = pool.grow(lv, rng.required_bytes, rng.limit_bytes)
        block = (request.HasField("volume_capability")
                 and request.volume_capability.HasField("block"))
        return pb.ControllerExpandVolumeResponse(
            capacity_bytes=lv.size, node_expansion_required=not block
        )

    # Local volumes need no attach, and there is nothing to modify.

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
        raise Unimplemented("ControllerModifyVolume is not supported")

    # snapshots -----------------------------------------------------------

    def CreateSnapshot(self, request: pb.CreateSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.CreateSnapshotResponse:
        source_id = validation.object_id(request.source_volume_id, "source_volume_id")
        name = validation.required(request.name, "name")
        asked = self._asked_class(request.parameters)
        if asked is not None:
            self.pools.select(asked)  # an unknown class: INVALID_ARGUMENT
        snapshot_id = vols.snapshot_id_for(name)
        # Lock order: snapshot, source, pool. One report then answers all: a retry,
        # the source, and the pool's room. A source ID that is this snapshot's own
        # is not locked twice (that waits on itself): it is no volume, NOT_FOUND.
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.locks.hold(volume_key(snapshot_id)))
            if source_id != snapshot_id:
                stack.enter_context(self.locks.hold(volume_key(source_id)))
            # A snapshot lives in its source's pool. With one class that is the
            # pool; with several, one `lvs` over them finds the source (and a
            # snapshot of the same name in any class) first.
            pool = self.pools.default
            elsewhere: dict[str, tuple[Pool, LogicalVolume]] = {}
            if len(self.pools) > 1:
                # A snapshot can only be in its source's pool: a missing VG matters
                # only when the source is not found (it may be there).
                elsewhere = self.pools.locate(snapshot_id, source_id, required=[source_id])
                pool = elsewhere.get(source_id, elsewhere.get(snapshot_id, (pool, None)))[0]
            report = stack.enter_context(pool.reserved())
            existing = report.find(snapshot_id) or elsewhere.get(snapshot_id, (pool, None))[1]
            if existing is not None:
                src = vols.source_of(existing)
                if (not vols.is_csi_snapshot(existing) or self.pools.of_lv(existing) is None
                        or src != Source(SourceKind.VOLUME, source_id)):
                    raise AlreadyExists(
                        f"snapshot {name!r} exists for another source volume"
                    )
                if asked is not None:
                    self._elsewhere(self.pools.select(asked), existing,
                                    f"snapshot {snapshot_id}", asked)
                return pb.CreateSnapshotResponse(snapshot=snapshot_message(existing))
            source_lv = report.find(source_id)
            if (source_lv is None or not vols.is_csi_volume(source_lv)
                    or self.pools.of_lv(source_lv) is not pool):
                raise NotFound(f"volume {source_id!r} not found")
            if asked is not None:
                self._elsewhere(self.pools.select(asked), source_lv, f"volume {source_id}",
                                asked)
            tags = [f"{vols.TAG_KIND}={vols.KIND_SNAPSHOT}",
                    Source(SourceKind.VOLUME, source_id).tag()]
            lv = self.steps.snapshot(pool, report, source_lv, snapshot_id, tags)
        return pb.CreateSnapshotResponse(snapshot=snapshot_message(lv))

    def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest,
                       context: grpc.ServicerContext) -> pb.DeleteSnapshotResponse:
        snapshot_id = validation.object_id(request.snapshot_id, "snapshot_id")
        if not vols.is_snapshot_id(snapshot_id):
            return pb.DeleteSnapshotResponse()
        with self.locks.hold(volume_key(snapshot_id)):
            found = self.pools.find(snapshot_id)
            if found is not None and vols.is_csi_snapshot(found[1]):
                group = vols.group_of(found[1])
                if group is not None:
                    # The spec: a member "CAN NOT be deleted stand alone".
                    raise InvalidArgument(
                        f"snapshot {snapshot_id} is a member of group snapshot {group}: "
                        "delete the group with DeleteVolumeGroupSnapshot")
                found[0].lvm.remove(snapshot_id)
        return pb.DeleteSnapshotResponse()

    def ListSnapshots(self, request: pb.ListSnapshotsRequest,
                      context: grpc.ServicerContext) -> pb.ListSnapshotsResponse:
        found, _ = self._listed(vols.is_csi_snapshot)
        snaps = [lv for _, lv in found]
        if request.snapshot_id:
            snaps = [lv for lv in snaps if lv.name == request.snapshot_id]
        if request.source_volume_id:
            want = Source(SourceKind.VOLUME, request.source_volume_id)
            snaps = [lv for lv in snaps if vols.source_of(lv) == want]
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
            vols.get_snapshot(self.pools, snapshot_id)[1]))

