"""Staging and publishing the CSI plugin's volumes on this node: the Node
service's RPCs below the RPC edge, one call each.

The node servicer validates a request into plain values and makes one call
here (as the controller does into volumes/provisioning.py); everything from
there on is this module's: the volume's lock, what the node's records say
(volumes/node_records.py: the same stage or publish again, another one in
the way, the single-writer rule), activating and mounting through the volume
steps (volumes/lifecycle.py), binding a publish and undoing a bind that
could not be finished, the records' updates, and a volume's health and usage.

Transport-free: errors are the storage layer's (csi_local.errors) and the
RPC edge (csi/rpc.py) gives them their codes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Protocol

from csi_local.errors import (
    AccessTypeMismatch,
    NotAtPath,
    NotStaged,
    UnsupportedFilesystem,
    UsedDifferently,
    VolumeGroupMissing,
    VolumeInUse,
    WriterTaken,
)
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.crypt import Key, mapper_path
from csi_local.host.filesystems import Filesystems, Usage
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.host.mounts import Mount, mount_node
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption, naming
from csi_local.volumes.encryption import TopDevice
from csi_local.volumes.lifecycle import VolumeSteps
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.node_records import (
    AccessType,
    Publish,
    Staging,
    VolumeRecord,
    block_stage_file,
    writer_in_the_way,
)
from csi_local.volumes.pool import Pool, Pools
from csi_local.volumes.qos_enforcement import QosEnforcer


class StageRecords(Protocol):
    """Where the node records its stages and publishes (the CSI node's state
    file, nodestate/state_file.py)."""

    def get(self, volume_id: str) -> VolumeRecord: ...
    def set_staging(self, volume_id: str, staging: Staging | None) -> None: ...
    def add_publish(self, volume_id: str, target: str, publish: Publish) -> None: ...
    def remove_publish(self, volume_id: str, target: str) -> None: ...


@dataclass(frozen=True)
class StageRequest:
    """What a NodeStageVolume asks for, as plain values."""

    volume_id: str
    path: str  # the staging path, resolved
    access_type: AccessType
    # The file system the capability names; "": the volume's class's default
    # (and always "" for block access).
    fs_type: str
    mount_flags: tuple[str, ...]
    access_mode: int
    key: Key | None  # an encrypted volume's key, from the node-stage secrets


@dataclass(frozen=True)
class PublishRequest:
    """What a NodePublishVolume asks for, as plain values."""

    volume_id: str
    target: str  # resolved
    staging_path: str  # resolved
    access_type: AccessType
    mount_flags: tuple[str, ...]
    access_mode: int
    readonly: bool  # the request's flag, or a reader-only access mode


@dataclass(frozen=True)
class VolumeStats:
    """A staged volume's health and usage, as NodeGetVolumeStats reports them."""

    problems: tuple[str, ...]  # none: healthy
    block_bytes: int | None = None  # a block volume's size, when its device is there
    usage: Usage | None = None  # a mounted file system's


def check_restage(staging: Staging, req: StageRequest) -> None:
    """A volume staged already (`staging`) may be staged again only at the
    same path with the same capability: UsedDifferently otherwise. What the
    record does not know (flags of a stage rebuilt from the mount table)
    does not differ, nor does a file system the request leaves to the class."""
    if staging.path != req.path:
        raise UsedDifferently(f"volume {req.volume_id} is already staged at {staging.path}")
    flags_differ = staging.flags_known and staging.mount_flags != req.mount_flags
    if staging.access_type != req.access_type or flags_differ or (
        req.fs_type and staging.fs_type != req.fs_type
    ):
        raise UsedDifferently(
            f"volume {req.volume_id} is staged at {staging.path} with another capability")


class Stager:
    """The Node service's stage, publish, stats and expansion on this node."""

    def __init__(self, pools: Pools, locks: Locks, fs: Filesystems, host: Kernel,
                 steps: VolumeSteps, records: StageRecords,
                 qos: QosEnforcer | None = None) -> None:
        self.pools = pools
        self.locks = locks
        self.fs = fs
        self.host = host
        self.steps = steps
        self.records = records
        self.qos = qos  # IO limits on the workloads a publish is for (docs/qos.md)

    def _lock(self, volume_id: str) -> contextlib.AbstractContextManager[None]:
        return self.locks.hold(volume_key(volume_id))

    def _find(self, volume_id: str, *, committed: bool = False) -> LogicalVolume | None:
        """The volume's LV; `committed`: from the committed metadata when it
        answers (no process)."""
        found = (self.pools.find_committed(volume_id) if committed else None
                 ) or self.pools.find(volume_id)
        return found[1] if found is not None else None

    def _device_mounted_at(self, dev: TopDevice, path: str,
                           table: list[Mount] | None = None) -> bool:
        """True when the device is what is mounted at `path` (file system or node bind);
        `table`: the mount table the caller read already."""
        return self.host.device_mounted_at(path, dev.major, dev.minor, table)

    def _top(self, lv: LogicalVolume) -> TopDevice:
        """The device the volume is used through: its open dm-crypt device
        when it is encrypted, else the LV."""
        return encryption.top_device(self.host, lv)

    def _staged_device(self, volume_id: str) -> TopDevice:
        """The device of a staged volume, from its node under /dev: a staged volume
        is active, and a stat costs nothing where an `lvs` costs a process.
        Falls back to LVM (LvNotFound when the LV is gone). An encrypted volume
        is used through its dm-crypt device, named after it."""
        crypt_path = mapper_path(encryption.mapper_name(volume_id))
        numbers = self.host.device_numbers(crypt_path)
        if numbers is not None:
            return TopDevice(crypt_path, *numbers, encrypted=True)
        for vg in self.pools.classes.volume_groups:
            path = os.path.join("/dev", vg, volume_id)
            numbers = self.host.device_numbers(path)
            if numbers is not None:
                return TopDevice(path, *numbers, encrypted=False)
        return self._top(naming.get_volume(self.pools, volume_id)[1])

    # stage ---------------------------------------------------------------

    def stage(self, req: StageRequest) -> None:
        """Activate, open (encrypted), format once and mount the volume at its
        staging path, or bind its device there (block); the same stage again
        is done already. UsedDifferently when it is staged elsewhere or
        otherwise, LvNotFound for a volume that is not there."""
        volume_id = req.volume_id
        with self._lock(volume_id):
            # Stage needs the LV's tags, class and device, which the VG's
            # committed metadata and the kernel give without a process.
            pool, lv = naming.get_volume(self.pools, volume_id, committed=True)
            naming.check_format(lv)
            fs_type = ""
            if req.access_type is AccessType.MOUNT:
                fs_type = req.fs_type or pool.default_fs_type
                if not req.fs_type:
                    # The class's default is known only now: the edge checked
                    # the default class's.
                    problem = fsrules.filesystem_problem(fs_type)
                    if problem is not None:
                        raise UnsupportedFilesystem(problem)
            rec = self.records.get(volume_id)
            if rec.staging is not None:
                check_restage(rec.staging, req)
            lv = pool.lvm.activate(lv)
            self.host.wait_for_device(lv.path)
            if req.access_type is AccessType.BLOCK:
                staging = self._stage_block(pool, lv, req)
            else:
                staging = self._stage_mount(pool, lv, req, fs_type)
            if rec.staging != staging:
                self.records.set_staging(volume_id, staging)

    def _stage_block(self, pool: Pool, lv: LogicalVolume, req: StageRequest) -> Staging:
        os.makedirs(req.path, exist_ok=True)
        target = block_stage_file(req.path, lv.name)
        if self._device_mounted_at(self._top(lv), target):
            self.steps.verify_key(lv, req.key)  # a wrong key is refused here too
        else:
            device, opened = self.steps.open_device(lv, req.key)
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
        return Staging(path=req.path, access_type=AccessType.BLOCK, access_mode=req.access_mode)

    def _stage_mount(self, pool: Pool, lv: LogicalVolume, req: StageRequest,
                     fs_type: str) -> Staging:
        os.makedirs(req.path, exist_ok=True)
        device = self._top(lv)
        if self._device_mounted_at(device, req.path):
            self.steps.verify_key(lv, req.key)  # a wrong key is refused here too
            top = self.host.top_mount(req.path)
            assert top is not None
            fs_type = top.fs_type
        else:
            fs_type = self.steps.first_mount(pool.lvm, lv, req.path, fs_type,
                                             req.mount_flags, req.key)
        # Grown while unused (a CO expands an unused volume with
        # ControllerExpandVolume alone): the file system follows its LV here.
        self.steps.grow_to_device(pool.lvm, lv, req.path, fs_type, req.key,
                                  was_open=device.encrypted)
        return Staging(path=req.path, access_type=AccessType.MOUNT, fs_type=fs_type,
                       mount_flags=req.mount_flags, access_mode=req.access_mode)

    def unstage(self, volume_id: str, staging_path: str) -> None:
        """Unmount the stage, close an encrypted volume's dm-crypt device, and
        forget the stage; nothing to do for what is not staged. VolumeInUse
        while it is published, NotAtPath when it is staged elsewhere."""
        with self._lock(volume_id):
            rec = self.records.get(volume_id)
            if rec.publishes:
                raise VolumeInUse(
                    f"volume {volume_id} is still published at {', '.join(sorted(rec.publishes))}"
                )
            if rec.staging is not None and rec.staging.path != staging_path:
                raise NotAtPath(f"volume {volume_id} is staged at {rec.staging.path}, not "
                                f"{staging_path}")
            if not naming.is_volume_id(volume_id):
                return  # never ours: nothing to undo
            # Without a record (a stage killed before its state write), LVM says
            # whether what is mounted there is this volume.
            lv = self._find(volume_id) if rec.staging is None else None
            block_file = block_stage_file(staging_path, volume_id)
            block_staged = (rec.staging is not None
                            and rec.staging.access_type is AccessType.BLOCK)
            dev = self._top(lv) if lv is not None else None
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
                self.records.set_staging(volume_id, None)

    # publish -------------------------------------------------------------

    def publish(self, req: PublishRequest) -> None:
        """Bind the staged volume at the target (read-only as asked), or find
        it bound there already. LvNotFound for a volume that is not there,
        NotStaged when it is not staged (mounted) at the staging path,
        AccessTypeMismatch, UsedDifferently for another publish at the
        target, WriterTaken for a second writer of a single-writer volume."""
        volume_id, target = req.volume_id, req.target
        with self._lock(volume_id):
            rec = self.records.get(volume_id)
            if rec.staging is None or rec.staging.path != req.staging_path:
                # LvNotFound first, for a volume that does not exist.
                naming.get_volume(self.pools, volume_id)
                raise NotStaged(f"volume {volume_id} is not staged at {req.staging_path}")
            # Staged, but perhaps by a newer csi-local before a downgrade: its
            # tags, from the committed metadata (no process), say which format.
            lv = naming.get_volume(self.pools, volume_id, committed=True)[1]
            naming.check_format(lv)
            dev = self._staged_device(volume_id)
            if rec.staging.access_type != req.access_type:
                raise AccessTypeMismatch(
                    f"volume {volume_id} is staged as {rec.staging.access_type}, "
                    f"not {req.access_type}"
                )
            want = Publish(readonly=req.readonly, access_mode=req.access_mode,
                           mount_flags=req.mount_flags)
            have = rec.publishes.get(target)
            if have is not None and not have.matches(want):
                raise UsedDifferently(f"volume {volume_id} is published at {target} differently")
            table = self.host.mounts()  # read once: both paths are answered from it
            if (req.access_type is AccessType.MOUNT
                    and not self._device_mounted_at(dev, req.staging_path, table)):
                # Binding the bare staging directory would hand the workload the
                # node's own file system instead of its volume.
                raise NotStaged(
                    f"volume {volume_id} is not mounted at its staging path {req.staging_path} "
                    "(unmounted behind the plugin's back?); stage it again")
            writer = writer_in_the_way(rec.publishes, target, want)
            if writer is not None:
                raise WriterTaken(f"volume {volume_id} is SINGLE_NODE_SINGLE_WRITER and "
                                  f"already has a writer at {writer}")
            if self._device_mounted_at(dev, target, table):
                top = self.host.top_mount(target, table)
                if top is not None and top.read_only != req.readonly:
                    # A publish interrupted between the bind and its remount.
                    self.fs.remount_bind(target, readonly=req.readonly)
            elif req.access_type is AccessType.BLOCK:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if not os.path.exists(target):
                    with open(target, "a"):
                        pass
                self._publish_block(dev.path, target, req.readonly)
            else:
                os.makedirs(target, exist_ok=True)
                self.fs.bind(req.staging_path, target, readonly=req.readonly,
                             flags=req.mount_flags)
            if have is None:
                try:
                    self.records.add_publish(volume_id, target, want)
                except BaseException:
                    self._unmount_target(target)  # and its read-only loop device
                    raise
            elif have != want:
                self.records.add_publish(volume_id, target, want)
            if self.qos is not None:
                # After the bind: the mount stands whatever the limits meet.
                self.qos.apply(lv, target)

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

    def unpublish(self, volume_id: str, target: str) -> None:
        """Unmount the target and remove what the publish made there, and
        forget the publish; nothing to do for what is not published."""
        with self._lock(volume_id):
            rec = self.records.get(volume_id)
            # Without a record (a publish killed before its state write), LVM says
            # whether what is mounted there is this volume.
            ours = target in rec.publishes
            if not ours and naming.is_volume_id(volume_id) and self.host.is_mount_point(target):
                lv = self._find(volume_id)
                ours = lv is not None and self._device_mounted_at(self._top(lv), target)
            if ours:
                self._unmount_target(target)
                if os.path.isdir(target):
                    with contextlib.suppress(OSError):
                        os.rmdir(target)
                elif os.path.isfile(target):
                    os.unlink(target)
            if target in rec.publishes:
                self.records.remove_publish(volume_id, target)
            if self.qos is not None and ours and naming.is_volume_id(volume_id):
                self.qos.release(volume_id, target, [t for t in rec.publishes if t != target],
                                 lambda: self._find(volume_id, committed=True))

    # stats and expansion ---------------------------------------------------

    @staticmethod
    def _staged_at(rec: VolumeRecord, path: str | None, asked: str) -> tuple[Staging, str]:
        """The volume's stage and `path`, where `path` is a path the volume is
        staged or published at; NotAtPath otherwise. `path` None: the request's
        `asked` is no path the volume could be at (relative, a symlink,
        malformed), which the spec's tables call "does not exist" as well."""
        if (rec.staging is None or path is None
                or (path != rec.staging.path and path not in rec.publishes)):
            raise NotAtPath(f"volume {rec.volume_id} is not staged or published at {asked!r}")
        return rec.staging, path

    def stats(self, volume_id: str, path: str | None, asked: str) -> VolumeStats:
        """The health and usage of the volume staged or published at `path`
        (see _staged_at for `path` and `asked`). VolumeGroupMissing when a VG
        that may hold it is missing."""
        staging, path = self._staged_at(self.records.get(volume_id), path, asked)
        lvs, missing = self.pools.listing()
        found = next(((p, x) for p, x in lvs if p is not None and x.name == volume_id
                      and naming.is_csi_volume(x)), None)
        if found is None and missing:
            raise VolumeGroupMissing(f"volume group {', '.join(missing)} not found: the "
                                     f"volume {volume_id} cannot be checked")
        lv = found[1] if found is not None else None
        pool = found[0] if found is not None else self.pools.default
        pool_lv = self.pools.thin_pool_lvs(lvs).get(pool.class_name)
        condition = naming.condition(lv, pool_lv, pool.name, pool.fill_problem(pool_lv),
                                     pool.metadata_problem())
        problems = [condition.message] if condition.abnormal else []
        block = staging.access_type is AccessType.BLOCK
        check = staging.mount_point(volume_id) if path == staging.path else path
        top = self.host.top_mount(check)
        dev = self._top(lv) if lv is not None else None
        mounted = top is not None and dev is not None and self.host.shows_device(
            top, dev.major, dev.minor)
        if lv is not None and self.steps.is_encrypted(lv) and dev is not None and \
                dev.path == lv.path:
            problems.append(f"its dm-crypt device "
                            f"{mapper_path(encryption.mapper_name(volume_id))} is gone")
        elif not mounted:
            problems.append(f"{path} is not mounted")
        if block:
            block_bytes = None
            if lv is not None and lv.active and dev is not None and dev.major >= 0:
                block_bytes = self.host.device_size(dev.path)
            return VolumeStats(tuple(problems), block_bytes=block_bytes)
        if not mounted or top is None:
            return VolumeStats(tuple(problems))
        # A flag may hold several options ("noatime,ro"): ro asked for is no fault.
        asked_flags = {o for flag in staging.mount_flags for o in fsrules.split(flag)}
        if top.fs_read_only and "ro" not in asked_flags:
            problems.append("file system is read-only (I/O errors?)")
        return VolumeStats(tuple(problems), usage=self.fs.usage(path))

    def expand(self, volume_id: str, path: str | None, asked: str,
               capacity: tuple[int, int] | None, key: Key | None) -> int:
        """Grow the volume's LV to `capacity` (required, limit bytes; None: as
        it is), its dm-crypt device and its mounted file system to the LV;
        returns the LV's size. LvNotFound, then NotAtPath (see _staged_at)."""
        with self._lock(volume_id):
            pool, lv = naming.get_volume(self.pools, volume_id)
            naming.check_format(lv)
            staging, _ = self._staged_at(self.records.get(volume_id), path, asked)
            if capacity is not None:
                lv = pool.grow(lv, *capacity)
            # An encrypted volume's dm-crypt device grows to its LV first.
            device = self.steps.grow_device(lv, key)
            if staging.access_type is AccessType.MOUNT:
                self.fs.grow(device, staging.path, staging.fs_type)
        return lv.size
