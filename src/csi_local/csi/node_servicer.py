"""CSI Node service: stage (activate, mkfs once, mount), publish (bind), stats, expand.

Thin, like the controller: requests are validated, the volume layer and the
file-system layer do the work, and the Host answers what is mounted.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import NamedTuple

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi import validation
from csi_local.csi.dependencies import Backend
from csi_local.csi.rpc import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from csi_local.errors import VolumeGroupMissing
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.crypt import Key, mapper_path
from csi_local.host.kernel import Host
from csi_local.host.mounts import Mount, mount_node
from csi_local.nodestate.state_file import AccessType, Publish, Staging, VolumeRecord
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption
from csi_local.volumes import naming as vols
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.pool import Pool

log = logging.getLogger(__name__)
NodeCap = pb.NodeServiceCapability.RPC
SINGLE_WRITER = pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER


def block_stage_file(staging_path: str, volume_id: str) -> str:
    """Block volumes are staged as the device node bind-mounted onto a file in
    the staging directory, so the kernel's mount table shows them too."""
    return os.path.join(staging_path, volume_id)


class Device(NamedTuple):
    """A volume's block device: its node and its numbers (-1 when inactive)."""

    path: str
    major: int
    minor: int

    @classmethod
    def of(cls, lv: LogicalVolume) -> Device:
        return cls(lv.path, lv.kernel_major, lv.kernel_minor)

    @classmethod
    def top(cls, host: Host, lv: LogicalVolume) -> Device:
        """The device the volume is used through: its open dm-crypt device
        when it is encrypted, else the LV (volumes/encryption.py)."""
        top = encryption.top_device(host, lv)
        return cls(top.path, top.major, top.minor)


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, backend: Backend) -> None:
        self.config = backend.config
        self.pools = backend.pools
        self.fs = backend.fs
        self.host = backend.host
        self.state = backend.state
        self.locks = backend.locks
        self.steps = VolumeSteps(backend.fs, backend.host, CSI_TAGS, backend.state,
                                 on_open_failure=backend.on_open_failure)

    def _lock(self, volume_id: str) -> contextlib.AbstractContextManager[None]:
        return self.locks.hold(volume_key(volume_id))

    def _volume(self, volume_id: str) -> tuple[Pool, LogicalVolume]:
        return vols.get_volume(self.pools, volume_id)

    def _find(self, volume_id: str) -> LogicalVolume | None:
        found = self.pools.find(volume_id)
        return found[1] if found is not None else None

    def _device_mounted_at(self, dev: Device, path: str,
                           table: list[Mount] | None = None) -> bool:
        """True when the device is what is mounted at `path` (file system or node bind);
        `table`: the mount table the caller read already."""
        return self.host.device_mounted_at(path, dev.major, dev.minor, table)

    def _staged_device(self, volume_id: str) -> Device:
        """The device of a staged volume, from its node under /dev: a staged volume
        is active, and a stat costs nothing where an `lvs` costs a process.
        Falls back to LVM (NOT_FOUND when the LV is gone). An encrypted volume
        is used through its dm-crypt device, named after it."""
        crypt_path = mapper_path(encryption.mapper_name(volume_id))
        numbers = self.host.device_numbers(crypt_path)
        if numbers is not None:
            return Device(crypt_path, *numbers)
        for vg in self.pools.classes.volume_groups:
            path = os.path.join("/dev", vg, volume_id)
            numbers = self.host.device_numbers(path)
            if numbers is not None:
                return Device(path, *numbers)
        return Device.top(self.host, self._volume(volume_id)[1])

    # stage ---------------------------------------------------------------

    def NodeStageVolume(self, request: pb.NodeStageVolumeRequest,
                        context: grpc.ServicerContext) -> pb.NodeStageVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        default_fs = self.pools.default.default_fs_type
        cap = validation.capability(request.volume_capability, default_fs)
        key = validation.encryption_key(request.secrets)
        with self._lock(volume_id):
            # Stage needs the LV's tags, class and device, which the VG's
            # committed metadata and the kernel give without a process.
            pool, lv = vols.get_volume(self.pools, volume_id, committed=True)
            if pool.default_fs_type != default_fs:  # no fs_type asked: the class's default
                cap = validation.capability(request.volume_capability, pool.default_fs_type)
            rec = self.state.get(volume_id)
            if rec.staging is not None:
                s = rec.staging
                if s.path != staging_path:
                    raise AlreadyExists(f"volume {volume_id} is already staged at {s.path}")
                wanted_fs = cap.fs_type if cap.access_type is AccessType.MOUNT else ""
                flags_differ = s.flags_known and s.mount_flags != cap.mount_flags
                if s.access_type != cap.access_type or flags_differ or (
                    request.volume_capability.mount.fs_type and s.fs_type != wanted_fs
                ):
                    raise AlreadyExists(
                        f"volume {volume_id} is staged at {s.path} with another capability"
                    )
            lv = pool.lvm.activate(lv)
            self.host.wait_for_device(lv.path)
            if cap.access_type is AccessType.BLOCK:
                staging = self._stage_block(pool, lv, staging_path, cap, key)
            else:
                staging = self._stage_mount(pool, lv, staging_path, cap, key)
            if rec.staging != staging:
                self.state.set_staging(volume_id, staging)
        return pb.NodeStageVolumeResponse()

    def _stage_block(self, pool: Pool, lv: LogicalVolume, staging_path: str,
                     cap: validation.Capability, key: Key | None) -> Staging:
        os.makedirs(staging_path, exist_ok=True)
        target = block_stage_file(staging_path, lv.name)
        if self._device_mounted_at(Device.top(self.host, lv), target):
            self.steps.verify_key(lv, key)  # a wrong key is refused here too
        else:
            device, opened = self.steps.open_device(lv, key)
            try:
                self.steps.mark_used(pool.lvm, lv)  # handed out raw: never formatted after
                if not os.path.exists(target):
                    with open(target, "a"):
                        pass
                self.fs.bind(device, target, readonly=False)
            except BaseException:
                if opened:
                    self.steps.close_device(lv.name)
                raise
        # A grow-fs tag stays for the first stage as a file system (nothing to grow here).
        return Staging(path=staging_path, access_type=AccessType.BLOCK, access_mode=cap.mode)

    def _stage_mount(self, pool: Pool, lv: LogicalVolume, staging_path: str,
                     cap: validation.Capability, key: Key | None) -> Staging:
        os.makedirs(staging_path, exist_ok=True)
        fs_type = cap.fs_type
        device = encryption.top_device(self.host, lv)
        if self._device_mounted_at(Device(device.path, device.major, device.minor),
                                   staging_path):
            self.steps.verify_key(lv, key)  # a wrong key is refused here too
            top = self.host.top_mount(staging_path)
            assert top is not None
            fs_type = top.fs_type
        else:
            fs_type = self.steps.first_mount(pool.lvm, lv, staging_path, cap.fs_type,
                                             cap.mount_flags, key)
        # Grown while unused (a CO expands an unused volume with
        # ControllerExpandVolume alone): the file system follows its LV here.
        self.steps.grow_to_device(pool.lvm, lv, staging_path, fs_type, key,
                                  was_open=device.encrypted)
        return Staging(path=staging_path, access_type=AccessType.MOUNT, fs_type=fs_type,
                       mount_flags=cap.mount_flags, access_mode=cap.mode)

    def NodeUnstageVolume(self, request: pb.NodeUnstageVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodeUnstageVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        with self._lock(volume_id):
            rec = self.state.get(volume_id)
            if rec.publishes:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published at {', '.join(sorted(rec.publishes))}"
                )
            if rec.staging is not None and rec.staging.path != staging_path:
                raise NotFound(f"volume {volume_id} is staged at {rec.staging.path}, not "
                               f"{staging_path}")
            if not vols.is_volume_id(volume_id):
                return pb.NodeUnstageVolumeResponse()  # never ours: nothing to undo
            # Without a record (a stage killed before its state write), LVM says
            # whether what is mounted there is this volume.
            lv = self._find(volume_id) if rec.staging is None else None
            block_file = block_stage_file(staging_path, volume_id)
            block_staged = (rec.staging is not None
                            and rec.staging.access_type is AccessType.BLOCK)
            dev = Device.top(self.host, lv) if lv is not None else None
            if block_staged or (dev is not None and self._device_mounted_at(dev, block_file)):
                # Only a file this plugin made and bound its device onto is removed.
                self.fs.umount(block_file)
                if os.path.isfile(block_file) and not os.path.islink(block_file):
                    os.unlink(block_file)
            if self.host.is_mount_point(staging_path) and (
                (rec.staging is not None and rec.staging.access_type is AccessType.MOUNT)
                or (dev is not None and self._device_mounted_at(dev, staging_path))
            ):
                self.fs.umount(staging_path)
            # An encrypted volume's dm-crypt device goes with its last user,
            # recorded or not (a stage killed before its state write).
            self.steps.close_device(volume_id)
            if rec.staging is not None:
                self.state.set_staging(volume_id, None)
        return pb.NodeUnstageVolumeResponse()

    # publish -------------------------------------------------------------

    def NodePublishVolume(self, request: pb.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> pb.NodePublishVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        target = validation.path(request.target_path, "target_path")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        cap = validation.capability(request.volume_capability,
                                    self.pools.default.default_fs_type)
        # After every REQUIRED field: staging_target_path is optional in the spec
        # (only a plugin that stages needs it), so a request missing a required
        # field as well is INVALID_ARGUMENT, not this.
        if not request.staging_target_path:
            # The spec's code for "STAGE_UNSTAGE_VOLUME is set but no staging path".
            raise FailedPrecondition("staging_target_path is required: this plugin stages "
                                     "volumes before publishing them")
        staging_path = validation.path(request.staging_target_path, "staging_target_path")
        readonly = request.readonly or cap.read_only_mode
        pod = validation.pod_info(request.volume_context)
        with self._lock(volume_id):
            rec = self.state.get(volume_id)
            if rec.staging is None or rec.staging.path != staging_path:
                self._volume(volume_id)  # NOT_FOUND first, for a volume that does not exist
                raise FailedPrecondition(f"volume {volume_id} is not staged at {staging_path}")
            dev = self._staged_device(volume_id)
            if rec.staging.access_type != cap.access_type:
                raise InvalidArgument(
                    f"volume {volume_id} is staged as {rec.staging.access_type}, "
                    f"not {cap.access_type}"
                )
            want = Publish(readonly=readonly, access_mode=cap.mode,
                           mount_flags=cap.mount_flags)
            have = rec.publishes.get(target)
            if have is not None and not have.matches(want):
                raise AlreadyExists(f"volume {volume_id} is published at {target} differently")
            table = self.host.mounts()  # read once: both paths are answered from it
            if (cap.access_type is AccessType.MOUNT
                    and not self._device_mounted_at(dev, staging_path, table)):
                # Binding the bare staging directory would hand the workload the
                # node's own file system instead of its volume.
                raise FailedPrecondition(
                    f"volume {volume_id} is not mounted at its staging path {staging_path} "
                    "(unmounted behind the plugin's back?); stage it again")
            others = {t: p for t, p in rec.publishes.items() if t != target}
            if not readonly and others and (
                cap.mode == SINGLE_WRITER
                or any(p.access_mode == SINGLE_WRITER and not p.readonly for p in others.values())
            ):
                writers = [t for t, p in others.items() if not p.readonly]
                if writers:
                    raise FailedPrecondition(
                        f"volume {volume_id} is SINGLE_NODE_SINGLE_WRITER and already has a "
                        f"writer at {writers[0]}"
                    )
            if self._device_mounted_at(dev, target, table):
                top = self.host.top_mount(target, table)
                if top is not None and top.read_only != readonly:
                    # A publish interrupted between the bind and its remount.
                    self.fs.remount_bind(target, readonly=readonly)
            else:
                if cap.access_type is AccessType.BLOCK:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    if not os.path.exists(target):
                        with open(target, "a"):
                            pass
                    self._publish_block(dev.path, target, readonly)
                else:
                    os.makedirs(target, exist_ok=True)
                    self.fs.bind(staging_path, target, readonly=readonly,
                                 flags=cap.mount_flags)
            if have is None:
                try:
                    self.state.add_publish(volume_id, target, want)
                except BaseException:
                    self._unmount_target(target)  # and its read-only loop device
                    raise
            elif have != want:
                self.state.add_publish(volume_id, target, want)
        # Which pod a volume went to (kubelet's podInfoOnMount): the server's
        # own line names only the RPC, and a target path names only the pod's UID.
        if pod is not None:
            log.info("volume %s published at %s for pod %s/%s (uid %s)", volume_id, target,
                     pod.namespace, pod.name, pod.uid)
        return pb.NodePublishVolumeResponse()

    def _publish_block(self, device: str, target: str, readonly: bool) -> None:
        if not readonly:
            self.fs.bind(device, target, readonly=False)
            return
        loop = self.fs.readonly_loop(device)
        try:
            self.fs.bind(loop, target, readonly=True)
        except BaseException:
            self.fs.detach_loop(loop)
            raise

    def _unmount_target(self, target: str) -> None:
        """Unmount a publish target, detaching the read-only loop device under it."""
        loops = [node for m in self.host.mounts_at(target)
                 if (node := mount_node(m)) and self.host.loop_backing(node)]
        self.fs.umount(target)
        for node in loops:
            self.fs.detach_loop(node)

    def NodeUnpublishVolume(self, request: pb.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext) -> pb.NodeUnpublishVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        target = validation.path(request.target_path, "target_path")
        with self._lock(volume_id):
            rec = self.state.get(volume_id)
            # Without a record (a publish killed before its state write), LVM says
            # whether what is mounted there is this volume.
            ours = target in rec.publishes
            if not ours and vols.is_volume_id(volume_id) and self.host.is_mount_point(target):
                lv = self._find(volume_id)
                ours = lv is not None and self._device_mounted_at(Device.top(self.host, lv),
                                                                  target)
            if ours:
                self._unmount_target(target)
                if os.path.isdir(target):
                    with contextlib.suppress(OSError):
                        os.rmdir(target)
                elif os.path.isfile(target):
                    os.unlink(target)
            if target in rec.publishes:
                self.state.remove_publish(volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    # stats and expansion ---------------------------------------------------

    @staticmethod
    def _volume_path(rec: VolumeRecord, raw: str) -> str:
        """`raw` as a path this volume is staged or published at, else NOT_FOUND.

        The spec's error tables for NodeGetVolumeStats and NodeExpandVolume
        prescribe NOT_FOUND for "the volume does not exist on the specified
        path", so a path that cannot be the volume's (relative, a symlink,
        malformed) is NOT_FOUND as well, not INVALID_ARGUMENT.
        """
        try:
            path = validation.path(raw, "volume_path")
        except InvalidArgument:
            path = None
        if (rec.staging is None or path is None
                or (path != rec.staging.path and path not in rec.publishes)):
            raise NotFound(f"volume {rec.volume_id} is not staged or published at {raw!r}")
        return path

    def NodeGetVolumeStats(self, request: pb.NodeGetVolumeStatsRequest,
                           context: grpc.ServicerContext) -> pb.NodeGetVolumeStatsResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        raw_path = validation.required(request.volume_path, "volume_path")
        rec = self.state.get(volume_id)
        path = self._volume_path(rec, raw_path)
        assert rec.staging is not None
        lvs, missing = self.pools.listing()
        found = next(((p, x) for p, x in lvs
                      if p is not None and x.name == volume_id and vols.is_csi_volume(x)), None)
        if found is None and missing:
            raise VolumeGroupMissing(f"volume group {', '.join(missing)} not found: the "
                                     f"volume {volume_id} cannot be checked")
        lv = found[1] if found is not None else None
        pool = found[0] if found is not None else self.pools.default
        pool_lv = self.pools.thin_pool_lvs(lvs).get(pool.class_name)
        condition = vols.condition(lv, pool_lv, pool.name, pool.fill_problem(pool_lv),
                                   pool.metadata_problem())
        problems = [condition.message] if condition.abnormal else []
        resp = pb.NodeGetVolumeStatsResponse()
        block = rec.staging.access_type is AccessType.BLOCK
        check = block_stage_file(path, volume_id) if block and path == rec.staging.path else path
        top = self.host.top_mount(check)
        dev = Device.top(self.host, lv) if lv is not None else None
        mounted = top is not None and dev is not None and self.host.shows_device(
            top, dev.major, dev.minor)
        if lv is not None and self.steps.is_encrypted(lv) and dev is not None and \
                dev.path == lv.path:
            problems.append(f"its dm-crypt device "
                            f"{mapper_path(encryption.mapper_name(volume_id))} is gone")
        elif not mounted:
            problems.append(f"{path} is not mounted")
        if block:
            if lv is not None and lv.active and dev is not None and dev.major >= 0:
                resp.usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES,
                                                 total=self.host.device_size(dev.path)))
        elif mounted and top is not None:
            # A flag may hold several options ("noatime,ro"): ro asked for is no fault.
            asked = {o for flag in rec.staging.mount_flags for o in fsrules.split(flag)}
            if top.fs_read_only and "ro" not in asked:
                problems.append("file system is read-only (I/O errors?)")
            u = self.fs.usage(path)
            resp.usage.extend([
                pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=u.total_bytes,
                               used=u.used_bytes, available=u.available_bytes),
                pb.VolumeUsage(unit=pb.VolumeUsage.INODES, total=u.total_inodes,
                               used=u.used_inodes, available=u.available_inodes),
            ])
        if problems:
            resp.volume_condition.abnormal = True
            resp.volume_condition.message = "; ".join(problems)
        else:
            resp.volume_condition.message = "volume is healthy"
        return resp

    def NodeExpandVolume(self, request: pb.NodeExpandVolumeRequest,
                         context: grpc.ServicerContext) -> pb.NodeExpandVolumeResponse:
        volume_id = validation.object_id(request.volume_id, "volume_id")
        raw_path = validation.required(request.volume_path, "volume_path")
        key = validation.encryption_key(request.secrets)
        with self._lock(volume_id):
            pool, lv = self._volume(volume_id)
            rec = self.state.get(volume_id)
            self._volume_path(rec, raw_path)
            assert rec.staging is not None
            if request.HasField("capacity_range"):
                rng = request.capacity_range
                lv = pool.grow(lv, rng.required_bytes, rng.limit_bytes)
            # An encrypted volume's dm-crypt device grows to its LV first.
            device = self.steps.grow_device(lv, key)
            if rec.staging.access_type is AccessType.MOUNT:
                self.fs.grow(device, rec.staging.path, rec.staging.fs_type)
        return pb.NodeExpandVolumeResponse(capacity_bytes=lv.size)

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
