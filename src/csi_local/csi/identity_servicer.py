"""CSI Identity service."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from csi_local import __version__
from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.config import Config
from csi_local.errors import StorageError
from csi_local.volumes.pool import Pools

log = logging.getLogger(__name__)
Cap = pb.PluginCapability


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, config: Config, pools: Pools) -> None:
        self.config = config
        self.pools = pools
        self._last_status: tuple[bool, str | None] | None = None

    def GetPluginInfo(
        self, request: pb.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(
            name=self.config.driver_name, vendor_version=__version__
        )

    def GetPluginCapabilities(
        self, request: pb.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginCapabilitiesResponse:
        caps = [
            Cap(service=Cap.Service(type=Cap.Service.CONTROLLER_SERVICE)),
            Cap(service=Cap.Service(type=Cap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS)),
            Cap(volume_expansion=Cap.VolumeExpansion(type=Cap.VolumeExpansion.ONLINE)),
            # Changed-block tracking from the thin pool's own mappings.
            Cap(service=Cap.Service(type=Cap.Service.SNAPSHOT_METADATA_SERVICE)),
            # Snapshots of several volumes at one instant (csi_local.volumes.group_snapshots).
            Cap(service=Cap.Service(type=Cap.Service.GROUP_CONTROLLER_SERVICE)),
        ]
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    def pool_status(self) -> tuple[bool, str | None]:
        """(ready, why): whether Probe answers ready, and what to say about it.

        A node without the volume group at all is ready, with nothing to
        serve: Probe is the liveness check of the pod, and no restart makes a
        volume group appear. Answering not ready there restarted the plugin
        forever (livenessprobe fails /healthz on not ready) and kept
        csi-provisioner and csi-resizer in their start-up loop, which waits
        for ready before they serve anything (csi-lib-utils ProbeForever).
        The copy of the plugin beside csi-resizer has no volume group by
        design, and only answers identity and capability calls. Calls that
        need the volume group fail on their own, as UNAVAILABLE.

        A volume group without its thin pool, or with an inactive one, is a
        storage node that is broken or still coming up: not ready.
        """
        try:
            pools, missing_vgs = self.pools.read_thin_pools()
        except StorageError as err:
            return False, err.message
        problems = []
        missing = []
        for pool in self.pools:
            lvm, lv = pool.lvm, pools[pool.class_name]
            if lvm.vg in missing_vgs:
                missing.append(f"volume group {lvm.vg} not found" if len(self.pools) == 1
                               else f"volume group {lvm.vg} not found (device class "
                               f"{pool.class_name})")
            elif lv is None:
                problems.append(f"class {pool.class_name}: thin pool {lvm.vg}/{lvm.pool} "
                                "not found")
            elif not lv.is_thin_pool:
                problems.append(f"class {pool.class_name}: {lvm.vg}/{lvm.pool} is not a "
                                "thin pool")
            elif not lv.active:
                problems.append(f"class {pool.class_name}: thin pool {lvm.vg}/{lvm.pool} "
                                "is not active")
        if problems:
            return False, "; ".join(problems)
        if missing:
            # Every class's VG missing: a node without this kind of storage. Some
            # missing: those classes answer GetCapacity 0 and their volumes are
            # UNAVAILABLE; the others serve.
            return True, (f"{'; '.join(missing)} on this node: ready, but no volume can be "
                          "created or used there until it exists")
        return True, None

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        status = self.pool_status()
        # Logged on a change only: sidecars probe every few seconds.
        if status != self._last_status:
            ready, why = status
            if why is None:
                log.info("probe: ready")
            elif ready:
                log.warning("probe: %s", why)
            else:
                log.warning("probe: not ready: %s", why)
            self._last_status = status
        return pb.ProbeResponse(ready=BoolValue(value=status[0]))
