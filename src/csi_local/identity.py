"""CSI Identity service."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from csi_local import __version__
from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.config import Config
from csi_local.errors import CsiError
from csi_local.lvm import Lvm

log = logging.getLogger(__name__)
Cap = pb.PluginCapability


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, config: Config, lvm: Lvm) -> None:
        self.config = config
        self.lvm = lvm
        self._last_reason: str | None = None

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
        ]
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    def not_ready_reason(self) -> str | None:
        """Why the plugin cannot serve volumes now, or None when it can."""
        try:
            self.lvm.volume_group()
            pool = self.lvm.thin_pool()
        except CsiError as err:
            return err.message
        if not pool.active:
            return f"thin pool {self.lvm.vg}/{self.lvm.pool} is not active"
        return None

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        reason = self.not_ready_reason()
        if reason != self._last_reason:
            if reason is None:
                log.info("probe: ready")
            else:
                log.warning("probe: not ready: %s", reason)
            self._last_reason = reason
        return pb.ProbeResponse(ready=BoolValue(value=reason is None))
