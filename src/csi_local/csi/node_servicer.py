"""CSI Node service: stage (activate, mkfs once, mount), publish (bind), stats, expand.

Thin, like the controller: each RPC validates its request into plain
values, makes one call into the volume layer (volumes.staging.Stager) and
builds the reply. Storage errors pass through; the server maps them to
codes (csi_local.csi.rpc).
"""

from __future__ import annotations

import logging

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi import validation
from csi_local.csi.dependencies import Backend
from csi_local.csi.rpc import FailedPrecondition, InvalidArgument
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps
from csi_local.volumes.staging import PublishRequest, Stager, StageRequest

log = logging.getLogger(__name__)
NodeCap = pb.NodeServiceCapability.RPC


def _volume_path(raw: str) -> str | None:
    """A NodeGetVolumeStats' or NodeExpandVolume's volume_path, resolved;
    None for one that cannot be any volume's path (relative, a symlink,
    malformed). The spec's tables for both prescribe NOT_FOUND for "the
    volume does not exist on the specified path", so such a path is the
    volume layer's NotAtPath, not INVALID_ARGUMENT."""
    try:
        return validation.path(raw, "volume_path")
    except InvalidArgument:
        return None


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, backend: Backend) -> None:
        self.config = backend.config
        self.pools = backend.pools
        self.volumes = Stager(
            backend.pools, backend.locks, backend.fs, backend.host,
            VolumeSteps(backend.fs, backend.host, CSI_TAGS, backend.state,
                        on_open_failure=backend.on_open_failure),
            backend.state, backend.qos)

    def _capability(self, cap: pb.VolumeCapability) -> validation.Capability:
        """The request's one capability. A file system it does not name is
        checked here as the default class's; the volume layer resolves it to
        the volume's own class's default."""
        return validation.capability(cap, self.pools.default.default_fs_type)

    # stage ---------------------------------------------------------------

    def NodeStageVolume(self, request: pb.NodeStageVolumeRequest,
                        context: grpc.ServicerContext) -> pb.NodeStageVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        cap = self._capability(request.volume_capability)
        key = validation.encryption_key(request.secrets)
        self.volumes.stage(StageRequest(
            volume_id, staging_path, cap.access_type, request.volume_capability.mount.fs_type,
            cap.mount_flags, cap.mode, key))
        return pb.NodeStageVolumeResponse()

    def NodeUnstageVolume(self, request: pb.NodeUnstageVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodeUnstageVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        self.volumes.unstage(volume_id, staging_path)
        return pb.NodeUnstageVolumeResponse()

    # publish -------------------------------------------------------------

    def NodePublishVolume(self, request: pb.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodePublishVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        target = validation.path(request.target_path, "target_path")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        cap = self._capability(request.volume_capability)
        # After every REQUIRED field: staging_target_path is optional in the spec
        # (only a plugin that stages needs it), so a request missing a required
        # field as well is INVALID_ARGUMENT, not this.
        if not request.staging_target_path:
            # The spec's code for "STAGE_UNSTAGE_VOLUME is set but no staging path".
            raise FailedPrecondition("staging_target_path is required: this plugin stages "
                                     "volumes before publishing them")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        pod = validation.pod_info(request.volume_context)
        self.volumes.publish(PublishRequest(
            volume_id, target, staging_path, cap.access_type, cap.mount_flags, cap.mode,
            readonly=request.readonly or cap.read_only_mode))
        # Which pod a volume went to (kubelet's podInfoOnMount): the server's
        # own line names only the RPC, and a target path names only the pod's UID.
        if pod is not None:
            log.info("volume %s published at %s for pod %s/%s (uid %s)", volume_id, target,
                     pod.namespace, pod.name, pod.uid)
        return pb.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: pb.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext) -> pb.NodeUnpublishVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        target = validation.path(request.target_path, "target_path")
        self.volumes.unpublish(volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    # stats and expansion ---------------------------------------------------

    def NodeGetVolumeStats(self, request: pb.NodeGetVolumeStatsRequest,
                           context: grpc.ServicerContext) -> pb.NodeGetVolumeStatsResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        raw_path = validation.required(request.volume_path, "volume_path")
        stats = self.volumes.stats(volume_id, _volume_path(raw_path), raw_path)
        resp = pb.NodeGetVolumeStatsResponse()
        if stats.block_bytes is not None:
            resp.usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES,
                                             total=stats.block_bytes))
        if stats.usage is not None:
            u = stats.usage
            resp.usage.extend([
                pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=u.total_bytes,
                               used=u.used_bytes, available=u.available_bytes),
                pb.VolumeUsage(unit=pb.VolumeUsage.INODES, total=u.total_inodes,
                               used=u.used_inodes, available=u.available_inodes),
            ])
        if stats.problems:
            resp.volume_condition.abnormal = True
            resp.volume_condition.message = "; ".join(stats.problems)
        else:
            resp.volume_condition.message = "volume is healthy"
        return resp

    def NodeExpandVolume(self, request: pb.NodeExpandVolumeRequest,
                         context: grpc.ServicerContext) -> pb.NodeExpandVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        raw_path = validation.required(request.volume_path, "volume_path")
        key = validation.encryption_key(request.secrets)
        rng = request.capacity_range
        capacity = ((rng.required_bytes, rng.limit_bytes)
                    if request.HasField("capacity_range") else None)
        size = self.volumes.expand(volume_id, _volume_path(raw_path), raw_path, capacity, key)
        return pb.NodeExpandVolumeResponse(capacity_bytes=size)

    # info ------------------------------------------------------------------

    def NodeGetCapabilities(self, request: pb.NodeGetCapabilitiesRequest,
                            context: grpc.ServicerContext) -> pb.NodeGetCapabilitiesResponse:
        rpcs = [NodeCap.STAGE_UNSTAGE_VOLUME, NodeCap.GET_VOLUME_STATS, NodeCap.VOLUME_CONDITION,
                NodeCap.SINGLE_NODE_MULTI_WRITER, NodeCap.EXPAND_VOLUME]
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=NodeCap(type=t)) for t in rpcs
        ])

    def NodeGetInfo(self, request: pb.NodeGetInfoRequest,
                    context: grpc.ServicerContext) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(
            node_id=self.config.node_id,
            max_volumes_per_node=self.config.max_volumes_per_node,
            accessible_topology=pb.Topology(
                segments={self.config.topology_key: self.config.node_id}
            ),
        )
